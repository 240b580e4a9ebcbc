"""Train a SentencePiece tokenizer (BPE or unigram) from jsonl or plain-text files.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --model-type bpe \
        --output-prefix data/tok --byte-fallback
    -> data/tok.model, data/tok.vocab

Special ids: 0 <pad>, 1 <unk>, 2 <s>, 3 <eod> (SentencePiece's EOS, used as end-of-document). Whitespace is
kept verbatim (identity normalisation; newline and tab are pieces) so code and prose decode exactly.
"""
import argparse
import io
import os
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


def train(paths, vocab_size, model_type, output_prefix, byte_fallback=False, keys=("text",),
          input_sentence_size=2_000_000, character_coverage=0.9999):
    import sentencepiece as spm
    for path in paths:
        check_input_file(path)
        next(iter(iter_texts(path, keys)), None)  # validates the first record before training starts
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        raise DataError(f"{output_prefix}: output directory {out_dir} does not exist; create it first")
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
    # Write under a temporary name, then rename: a crash never leaves a half-written .model.
    tmp = f"{output_prefix}.model.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab_tmp = f"{output_prefix}.vocab.tmp-{os.getpid()}"
    with open(vocab_tmp, "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n")
    os.replace(vocab_tmp, f"{output_prefix}.vocab")
    os.replace(tmp, f"{output_prefix}.model")
    return sp.get_piece_size()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl (fields from --json-keys) or text files")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--byte-fallback", action="store_true", help="unknown characters become byte pieces")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, help="lines sampled for training")
    args = p.parse_args(argv)
    if args.vocab_size < 8:
        sys.exit(f"error: --vocab-size {args.vocab_size} is too small (the 4 special tokens alone take 4 ids)")
    try:
        n = train(args.input, args.vocab_size, args.model_type, args.output_prefix, args.byte_fallback,
                  args.json_keys, args.input_sentence_size)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"trained {args.model_type} tokenizer, {n} pieces -> {args.output_prefix}.model")
