"""Attention mask, loss mask and position ids for a batch of GPT inputs (Megatron's get_ltor_masks_and_position_ids).

Conventions
- `tokens` (b, s) are the model inputs text[:, :-1]; the label of position t is text[:, t + 1].
- `attention_mask` is bool (b, 1, s, s), True = query row may attend to key column (torch's
  scaled_dot_product_attention convention; Megatron stores the opposite). None means "plain causal",
  so the model may take its fused causal path.
- Prefix-LM (Megatron-DeepSpeed's semi-autoregressive mode, as in T5's prefix-LM): with prefix length P,
  input positions 0..P-1 form the prefix and attend to each other in both directions; positions >= P attend
  causally (to the whole prefix and to earlier targets). With `loss_on_targets_only` the loss is kept only
  where the *label* lies outside the prefix: positions t >= P - 1. Position P - 1 (the last prefix token)
  carries loss because it predicts token P, the first target; positions 0..P-2 predict prefix tokens and
  carry none. This matches Megatron-DeepSpeed's `loss_mask[b, :prefix_index - 1] = 0`.
"""
import torch


def build_masks(tokens, eod, *, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                prefix_lengths=None, loss_on_targets_only=False):
    """-> (attention_mask bool (b, 1, s, s) or None, loss_mask float (b, s), position_ids long (b, s))."""
    b, s = tokens.shape
    device = tokens.device
    is_eod = tokens == eod                                             # (b, s)
    positions = torch.arange(s, device=device)                         # (s,)

    loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    position_ids = positions.expand(b, s).clone()
    if reset_position_ids:
        # Start of the current document = 1 + position of the last EOD strictly before t (0 if none).
        after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))      # (b, s)
        start = torch.cummax(after_eod, dim=1).values
        start = torch.cat([torch.zeros_like(start[:, :1]), start[:, :-1]], dim=1)          # shift: strictly before
        position_ids = position_ids - start

    if prefix_lengths is not None:
        prefix_lengths = torch.as_tensor(prefix_lengths, device=device).long()
        if prefix_lengths.shape != (b,) or bool(((prefix_lengths < 0) | (prefix_lengths > s)).any()):
            raise ValueError(f"prefix_lengths must be a (batch,) = ({b},) tensor of values in [0, {s}], "
                             f"got {tuple(prefix_lengths.shape)} {prefix_lengths.tolist()}")
        if loss_on_targets_only:
            # Keep positions whose label t + 1 lies at or after the prefix end: t >= P - 1.
            loss_mask = loss_mask * (positions[None, :] >= prefix_lengths[:, None] - 1).float()
    elif loss_on_targets_only:
        raise ValueError("loss_on_targets_only needs prefix_lengths")

    if not reset_attention_mask and prefix_lengths is None:
        return None, loss_mask, position_ids

    allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, s, s)   # (b, s_q, s_k)
    if prefix_lengths is not None:
        in_prefix = positions[None, :] < prefix_lengths[:, None]                          # (b, s)
        allowed = allowed | (in_prefix[:, :, None] & in_prefix[:, None, :])
    if reset_attention_mask:
        # Document id of each position = number of EODs strictly before it; attend only within a document.
        doc = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()                         # (b, s)
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    return allowed[:, None], loss_mask, position_ids


def random_prefix_lengths(batch, seq_length, generator=None):
    """Uniform prefix lengths in [1, seq_length - 1] (a non-empty prefix and at least one target). (batch,)"""
    if seq_length < 2:
        raise ValueError(f"prefix-LM needs seq_length >= 2, got {seq_length}")
    return torch.randint(1, seq_length, (batch,), generator=generator)


def build_batch(text, eod, **mask_kwargs):
    """text (b, s + 1) -> dict(tokens, labels (b, s), attention_mask, loss_mask, position_ids)."""
    text = torch.as_tensor(text).long()
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = build_masks(tokens, eod, **mask_kwargs)
    return dict(tokens=tokens, labels=labels, attention_mask=attention_mask, loss_mask=loss_mask,
                position_ids=position_ids)
