"""Train a SentencePiece tokenizer (BPE or unigram) from jsonl or plain-text files.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --model-type bpe \
        --output-prefix data/tok
    -> data/tok.model, data/tok.vocab

Special ids: 0 <pad>, 1 <unk>, 2 <s>, 3 <eod> (SentencePiece's EOS, used as end-of-document). Whitespace is
kept verbatim (identity normalisation; newline and tab are pieces) so code and prose decode exactly. Byte
fallback is on unless --no-byte-fallback: a character the corpus did not teach (an emoji, a rare accent) becomes
its UTF-8 bytes and decodes back, instead of <unk>. A corpus too small for --vocab-size (a few hundred documents
reach a few thousand pieces) gets the most pieces SentencePiece can learn from it, said on the output line; the
config's model.vocab_size only has to hold them (pretrain checks the data's largest id).
"""
import argparse
import io
import os
import re
import sys


from gptpar.data.indexed import DataError
from gptpar.data.jsonl import check_input_file, iter_texts

SPECIALS = dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece="<pad>", unk_piece="<unk>",
                bos_piece="<s>", eos_piece="<eod>")


def iter_sentences(paths, keys):
    """SentencePiece trains on lines: split each document at newlines (newline itself is a user symbol)."""
    for path in paths:
        for text in iter_texts(path, keys):
            for line in text.split("\n"):
                if line.strip():
                    yield line


# SentencePiece's refusal of a vocabulary its corpus cannot fill, with the most it can: the size to cap at.
TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")


def reachable_vocab_size(error: Exception):
    """The largest vocabulary SentencePiece said it can learn (from its 'too high' refusal), else None."""
    m = TOO_HIGH.search(str(error))
    return int(m.group(2)) if m else None


def train(paths, vocab_size, model_type, output_prefix, byte_fallback=False, keys=("text",),
          input_sentence_size=2_000_000, character_coverage=0.9999, cap_vocab=False):
    """Train and write `output_prefix`.model/.vocab; returns the number of pieces. `cap_vocab`: a vocabulary
    the corpus cannot fill is trained at the largest size SentencePiece says it can (else a DataError)."""
    import sentencepiece as spm
    for path in paths:
        check_input_file(path)
        next(iter(iter_texts(path, keys)), None)  # validates the first record before training starts
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"{output_prefix}: output directory {out_dir} does not exist; create it first")
    try:
        model = train_model(paths, keys, vocab_size, model_type, byte_fallback, input_sentence_size,
                            character_coverage)
    except DataError as e:
        reachable = reachable_vocab_size(e)
        if not cap_vocab or reachable is None or reachable >= vocab_size:
            raise
        model = train_model(paths, keys, reachable, model_type, byte_fallback, input_sentence_size,
                            character_coverage)
    # Write under a temporary name, then rename: a crash never leaves a half-written .model.
    tmp = f"{output_prefix}.model.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model)
    sp = spm.SentencePieceProcessor(model_proto=model)
    vocab_tmp = f"{output_prefix}.vocab.tmp-{os.getpid()}"
    with open(vocab_tmp, "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n")
    os.replace(vocab_tmp, f"{output_prefix}.vocab")
    os.replace(tmp, f"{output_prefix}.model")
    return sp.get_piece_size()


def train_model(paths, keys, vocab_size, model_type, byte_fallback, input_sentence_size, character_coverage):
    """One SentencePiece training run; the serialized model."""
    import sentencepiece as spm

    model = io.BytesIO()
    errors = []  # a DataError raised inside SentencePiece's read loop would come back wrapped and garbled

    def sentences():
        try:
            yield from iter_sentences(paths, keys)
        except DataError as e:
            errors.append(e)

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=byte_fallback, character_coverage=character_coverage,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, user_defined_symbols=["\n", "\t"], max_sentence_length=1 << 16,
            train_extremely_large_corpus=False, minloglevel=2, **SPECIALS)
    except RuntimeError as e:
        if errors:
            raise errors[0] from None
        hint = " (use a smaller --vocab-size or more text)" if "Vocabulary size" in str(e) else ""
        raise DataError(f"sentencepiece training failed: {e}{hint}") from e
    if errors:
        raise errors[0]
    return model.getvalue()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (fields from --json-keys) or text files")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="characters the corpus did not teach become byte pieces (default: on)")
    p.add_argument("--exact-vocab-size", action="store_true",
                   help="refuse a --vocab-size the corpus cannot fill instead of training the most it can")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, help="lines sampled for training")
    args = p.parse_args(argv)
    if args.vocab_size < 8:
        sys.exit(f"error: --vocab-size {args.vocab_size} is too small (the 4 special tokens alone take 4 ids)")
    try:
        n = train(args.input, args.vocab_size, args.model_type, args.output_prefix, args.byte_fallback,
                  args.json_keys, args.input_sentence_size, cap_vocab=not args.exact_vocab_size)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    capped = (f" (the most this corpus reaches; --vocab-size {args.vocab_size} asked for more, "
              f"--exact-vocab-size refuses instead)" if n < args.vocab_size else "")
    fallback = ", byte fallback" if args.byte_fallback else ", no byte fallback: unseen characters decode as <unk>"
    print(f"trained {args.model_type} tokenizer, {n} pieces{capped}{fallback} -> {args.output_prefix}.model")
