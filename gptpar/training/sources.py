"""The trainer's inputs: datasets from the config, and this rank's micro-batch dicts for one global batch.

Train samples are addressed by their global index (consumed samples + position in the global batch, see
gptpar.training.batches), so a resumed run continues at the same sample. Synthetic data (data.synthetic)
draws sample i from a generator seeded by (training.seed, i); its validation set uses seed + 1, so it
never repeats a training sample. Evaluation always reads the first `eval_iters` global batches of each
validation set, so successive evaluations are comparable. The validation sets are data.valid_data_path's
(named sets, gptpar.data.gpt_dataset.parse_valid_data_path) or else the validation split of data.data_path
(one unnamed set, key None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from gptpar.training.batches import SyntheticDataset, rank_micro_batches


@dataclass
class MaskOptions:
    """Megatron's masking flags (data section) and the end-of-document id they need."""

    eod: Optional[int] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    prefix_lm: bool = False
    loss_on_targets_only: bool = False

    @property
    def plain(self) -> bool:
        return not (self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss or self.prefix_lm)

    @property
    def has_attention_mask(self) -> bool:
        return self.reset_attention_mask or self.prefix_lm


class BatchSource:
    """This dp rank's micro-batches (dicts for TrainEngine) of the global batch after `consumed` samples."""

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, masks: MaskOptions, seed: int):
        self.dataset, self.mbs, self.dp_rank, self.dp_size = dataset, micro_batch_size, dp_rank, dp_size
        self.masks, self.seed = masks, seed

    def micro_batches(self, consumed: int, global_batch_size: int) -> List[dict]:
        texts = rank_micro_batches(self.dataset, consumed, global_batch_size, self.mbs, self.dp_rank,
                                   self.dp_size)  # each (mbs, s + 1)
        return [self._to_inputs(text, consumed, j) for j, text in enumerate(texts)]

    def _to_inputs(self, text: torch.Tensor, consumed: int, j: int) -> dict:
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # (b, s)
        if self.masks.plain:
            return {"input_ids": tokens, "labels": labels}
        from gptpar.data.masks import build_masks, random_prefix_lengths

        m = self.masks
        prefix = None
        if m.prefix_lm:  # seeded by the batch's place in the data, never by the rank or the wall clock
            g = torch.Generator().manual_seed(self.seed * 1000003 + consumed + j * self.mbs * self.dp_size
                                              + self.dp_rank * self.mbs)
            prefix = random_prefix_lengths(tokens.shape[0], tokens.shape[1], g)
        attention_mask, loss_mask, position_ids = build_masks(
            tokens, m.eod, reset_position_ids=m.reset_position_ids, reset_attention_mask=m.reset_attention_mask,
            eod_mask_loss=m.eod_mask_loss, prefix_lengths=prefix, loss_on_targets_only=m.loss_on_targets_only)
        out = {"input_ids": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            out["attention_mask"] = attention_mask
        return out


def build_sources(cfg, pstate, train_samples: int, eval_samples: int, log=print):
    """(train BatchSource, {validation set name or None: BatchSource}) for the config's data section; the dict
    is empty when there is nothing to validate on.

    Real data: rank 0 builds (and caches) the sample indices first, the other ranks then read the cache.
    """
    d, t, m = cfg.data, cfg.training, cfg.model
    masks = MaskOptions(reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask,
                        eod_mask_loss=d.eod_mask_loss, prefix_lm=d.prefix_lm,
                        loss_on_targets_only=d.loss_on_targets_only)
    if d.synthetic:
        train = SyntheticDataset(m.vocab_size, m.seq_length, t.seed)
        valid = SyntheticDataset(m.vocab_size, m.seq_length, t.seed + 1)
    else:
        train, valid = _real_datasets(cfg, pstate, train_samples, eval_samples, log)
    if not masks.plain:
        masks.eod = _eod(d.tokenizer_model)

    def source(dataset):
        return BatchSource(dataset, t.micro_batch_size, pstate.dp_rank, pstate.dp_size, masks, t.seed)

    if not isinstance(valid, dict):
        valid = {} if valid is None else {None: valid}
    return source(train), {name: source(dataset) for name, dataset in valid.items()}


def _real_datasets(cfg, pstate, train_samples: int, eval_samples: int, log):
    from gptpar.data.gpt_dataset import build_train_valid_test_datasets, build_valid_datasets

    d, m = cfg.data, cfg.model

    def build():
        named = d.valid_data_path is not None
        train, valid, _ = build_train_valid_test_datasets(d.data_path, d.split, m.seq_length, cfg.training.seed,
                                                          (train_samples, 0 if named else eval_samples, 0))
        if named and eval_samples:
            valid = build_valid_datasets(d.valid_data_path, m.seq_length, cfg.training.seed, eval_samples)
        return train, valid

    if pstate.rank == 0:
        where = f"data.valid_data_path {d.valid_data_path}" if d.valid_data_path is not None else f"split {d.split}"
        log(f"building datasets from {d.data_path} (split {d.split}): {train_samples} train samples, and "
            f"{eval_samples} validation samples from {where}, of {m.seq_length} tokens")
        train, valid = build()
    if dist.is_initialized():
        dist.barrier()
    if pstate.rank != 0:
        train, valid = build()
    return train, valid


def _eod(tokenizer_model: Optional[str]) -> int:
    if tokenizer_model is None:
        raise ValueError("data masking options need the end-of-document id: set data.tokenizer_model")
    from gptpar.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_model).eod


__all__ = ["MaskOptions", "BatchSource", "build_sources"]
