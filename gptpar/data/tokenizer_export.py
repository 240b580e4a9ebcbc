"""The run's tokenizer as a Hugging Face fast tokenizer, for an export that `AutoTokenizer.from_pretrained` reads.

A Hugging Face tokenizer (`tokenizer.json` or a tokenizer directory) is carried over as it is. A SentencePiece BPE
model (what tools/train_tokenizer.py writes) is rebuilt with the `tokenizers` library, reproducing what
SentencePiece does with that model's own settings:

    normalizer      the dummy prefix (`add_dummy_prefix`: one "▁" before the text), spaces -> "▁"
                    (tools/train_tokenizer.py's models use the identity normalization; a model with a precompiled
                    character map is refused, as is a unigram model)
    pre-tokenizer   user-defined symbols ("\\n", "\\t") isolated; words split as SentencePiece's `split_by_whitespace`
                    does with `allow_whitespace_only_pieces` (a run of "▁" stays whole, its last joins the word
                    after it: `▁*[^▁]+`); digits one by one (`split_digits`)
    model           BPE over the model's pieces, its merges in the order of the pieces' scores (transformers'
                    SentencePieceExtractor), unknown characters fused into one <unk> (or byte fallback)
    special tokens  the model's control pieces (<pad>, <s>, <eod>) and <unk>, declared pad/bos/eos/unk
    decoder         "▁" -> " ", bytes of byte fallback -> characters; no strip of a leading space, so a piece
                    decoded alone keeps its space (transformers' pipeline decodes a continuation alone) and a
                    whole text decodes with the one space of its dummy prefix before it (docs/evaluation.md)

`export_tokenizer` checks the result: `AutoTokenizer` on the written folder must encode every probe text to the ids
gptpar's own tokenizer gives, else the export is refused. Two differences are known and left: text that spells a
special token literally (`"<eod>"` in a document) encodes to that token in Hugging Face (as every Hugging Face
tokenizer does) where SentencePiece spells it out, and adjacent characters outside the vocabulary (without byte
fallback) may fuse into one <unk> differently.
"""
from __future__ import annotations

import re
from typing import Dict, List

from gptpar.data.indexed import DataError
from gptpar.data.tokenizer import HFTokenizer, load_tokenizer

# Text the exported tokenizer must encode exactly as gptpar's does: code, prose, whitespace runs, digits.
PROBES = ("def parse(text, sep=','):\n    \"\"\"Split `text`.\"\"\"\n\treturn [x.strip() for x in text.split(sep)]\n",
          "  leading spaces, trailing spaces  \n\n\nand blank lines\n",
          "The 3 quick brown foxes jumped over 12345 lazy dogs; 6.02e23 + 1 = 7!",
          "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
          "if __name__ == \"__main__\":\n\tmain()  # tab-indented\n", " ", "\n", "a")


def _sentencepiece_fast(path: str):
    """A `tokenizers.Tokenizer` that encodes as the SentencePiece BPE model at `path` does (module docstring)."""
    from sentencepiece import sentencepiece_model_pb2 as model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    proto = model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != 2:  # BPE
        raise DataError(f"{path}: exporting a SentencePiece tokenizer to Hugging Face reads BPE models only (this one "
                        "is a unigram model): export with --tokenizer pointing at a Hugging Face tokenizer instead")
    if normalizer.precompiled_charsmap or trainer.treat_whitespace_as_suffix:
        raise DataError(f"{path}: its normalization ({normalizer.name}) or whitespace rule has no Hugging Face "
                        "equivalent gptpar builds: train it with tools/train_tokenizer.py, or export with a Hugging "
                        "Face tokenizer (--tokenizer)")
    merges = SentencePieceExtractor(path).extract(None)["merges"]
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=trainer.unk_piece, fuse_unk=True,
                               byte_fallback=trainer.byte_fallback, dropout=None))
    steps = [normalizers.Prepend("▁")] if normalizer.add_dummy_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    user = [p.piece for p in proto.pieces if p.type == 4]  # USER_DEFINED: always their own piece
    split: List = [pre_tokenizers.Split(Regex("|".join(re.escape(u) for u in user)), behavior="isolated")] if user else []
    if trainer.split_by_whitespace:
        split.append(pre_tokenizers.Split(Regex("▁*[^▁]+|▁+"), behavior="isolated"))
    if trainer.split_digits:
        split.append(pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    # Every "▁" decodes to its space, the first one too: transformers' text-generation pipeline decodes the
    # continuation alone and appends it to the prompt, so a continuation's leading "▁" must stay a space. Stripping
    # it (SentencePiece's decode; tokenizers' Metaspace decoder unless prepend_scheme="never") would run "rose"
    # and "three" together.
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                            for p in proto.pieces if p.type in (2, 3)])  # UNKNOWN, CONTROL
    return tok, {"unk_token": trainer.unk_piece, **{name: proto.pieces[i].piece for name, i in
                                                    (("pad_token", trainer.pad_id), ("bos_token", trainer.bos_id),
                                                     ("eos_token", trainer.eos_id)) if 0 <= i < len(proto.pieces)}}


def special_token_ids(path: str) -> Dict[str, int]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} of the tokenizer at `path`: eos is its end-of-document
    token (what gptpar's data separates documents with), bos its declared begin-of-sequence token (else eos), pad
    its pad token (else eos)."""
    tokenizer = load_tokenizer(path)
    bos = tokenizer.declared_bos
    return {"bos_token_id": tokenizer.eod if bos is None else bos, "eos_token_id": tokenizer.eod,
            "pad_token_id": tokenizer.eod if tokenizer.pad is None else tokenizer.pad}


def export_tokenizer(path: str, out_dir: str) -> None:
    """Write the tokenizer at `path` (SentencePiece .model, or a Hugging Face tokenizer) into `out_dir` as
    `PreTrainedTokenizerFast.save_pretrained` does, then check that `AutoTokenizer` reads it back and encodes
    PROBES as gptpar's tokenizer does (DataError naming the first difference otherwise)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = load_tokenizer(path)
    if isinstance(ours, HFTokenizer):
        eos = ours.backend.id_to_token(ours.eod)
        fast = PreTrainedTokenizerFast(tokenizer_object=ours.backend, **dict(ours.declared, eos_token=eos))
    else:
        tok, specials = _sentencepiece_fast(path)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    fast.model_max_length = int(1e30)  # the model's positions decide (config.json)
    fast.save_pretrained(out_dir)
    back = AutoTokenizer.from_pretrained(out_dir)
    for text in PROBES:
        want, got = ours.encode(text), back(text, add_special_tokens=False)["input_ids"]
        if list(want) != list(got):
            raise DataError(f"{path}: the Hugging Face tokenizer exported from it encodes {text[:40]!r} to {got[:12]}, "
                            f"gptpar's tokenizer to {list(want)[:12]}: this tokenizer cannot be exported exactly")


__all__ = ["PROBES", "special_token_ids", "export_tokenizer"]
