"""Attention / loss masks and position ids against a direct, loop-by-loop construction."""
import itertools

import pytest
import torch

from gptpar.data.masks import build_batch, build_masks, random_prefix_lengths

EOD = 0


def reference_masks(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss, prefix_lengths,
                    loss_on_targets_only):
    """Megatron's get_ltor_masks_and_position_ids loop (with its prefix-LM extension), in 'may attend' form."""
    b, s = tokens.shape
    attention = torch.tril(torch.ones(b, s, s))
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in range(s):
            if tokens[row, i] != eod:
                continue
            if reset_attention_mask:
                attention[row, i + 1:, : i + 1] = 0
            if reset_position_ids:
                position_ids[row, i + 1:] -= i + 1 - prev
                prev = i + 1
        if prefix_lengths is not None:
            p = int(prefix_lengths[row])
            for q in range(s):
                for k in range(s):
                    if q < p and k < p and (not reset_attention_mask or
                                            not any(tokens[row, e] == eod for e in range(min(q, k), max(q, k)))):
                        attention[row, q, k] = 1   # the prefix sees itself in both directions
                # The label of position q is token q + 1: it is a target iff q + 1 >= p.
                if loss_on_targets_only and q + 1 < p:
                    loss_mask[row, q] = 0.0
    return attention.bool()[:, None], loss_mask, position_ids


@pytest.mark.parametrize("reset_pos,reset_att,eod_loss,prefix,targets_only",
                         [c for c in itertools.product([False, True], repeat=5) if c[3] or not c[4]])
def test_masks_match_direct_construction(reset_pos, reset_att, eod_loss, prefix, targets_only):
    gen = torch.Generator().manual_seed(0)
    b, s = 3, 12
    tokens = torch.randint(0, 4, (b, s), generator=gen)   # EOD (0) about one token in four
    prefix_lengths = random_prefix_lengths(b, s, gen) if prefix else None
    kwargs = dict(reset_position_ids=reset_pos, reset_attention_mask=reset_att, eod_mask_loss=eod_loss,
                  prefix_lengths=prefix_lengths, loss_on_targets_only=targets_only)
    attention, loss_mask, position_ids = build_masks(tokens, EOD, **kwargs)
    ref_attention, ref_loss, ref_pos = reference_masks(tokens, EOD, reset_pos, reset_att, eod_loss,
                                                       prefix_lengths, targets_only)
    assert loss_mask.dtype == torch.float and loss_mask.shape == (b, s) and torch.equal(loss_mask, ref_loss)
    assert position_ids.dtype == torch.long and torch.equal(position_ids, ref_pos)
    if not (reset_att or prefix):
        assert attention is None   # plain causal: the model may use its fused causal path
    else:
        assert attention.dtype == torch.bool and attention.shape == (b, 1, s, s)
        assert torch.equal(attention, ref_attention)


def test_prefix_lm_is_bidirectional_in_prefix_only():
    s, p = 6, 3
    tokens = torch.arange(1, s + 1)[None]
    attention, loss_mask, _ = build_masks(tokens, EOD, prefix_lengths=torch.tensor([p]), loss_on_targets_only=True)
    m = attention[0, 0]
    assert m[0, p - 1]                           # first prefix token sees the last prefix token
    assert not m[0, p] and not m[p, p + 1]       # nothing sees the future outside the prefix
    assert m[p:, :p].all()                       # targets see the whole prefix
    # Position p - 1 predicts token p, the first target, so it is the first position with loss.
    assert loss_mask[0].tolist() == [0.0] * (p - 1) + [1.0] * (s - p + 1)


def test_random_prefix_lengths_and_batch():
    gen = torch.Generator().manual_seed(1)
    lengths = random_prefix_lengths(1000, 8, gen)
    assert lengths.shape == (1000,) and lengths.min() >= 1 and lengths.max() <= 7
    assert set(lengths.tolist()) == set(range(1, 8))
    text = torch.randint(1, 50, (2, 9), generator=gen)
    batch = build_batch(text, EOD, prefix_lengths=lengths[:2], loss_on_targets_only=True)
    assert torch.equal(batch["tokens"], text[:, :-1]) and torch.equal(batch["labels"], text[:, 1:])
    with pytest.raises(ValueError, match="prefix_lengths must be"):
        build_masks(text[:, :-1], EOD, prefix_lengths=torch.tensor([9, 1]))
    with pytest.raises(ValueError, match="needs prefix_lengths"):
        build_masks(text[:, :-1], EOD, loss_on_targets_only=True)
