"""Tokenise a jsonl corpus into Megatron-compatible MMIDIDX files, one pair per json key.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --tokenizer-model tok.model --output-prefix data/corpus --workers 2 --append-eod
    -> data/corpus_text_document.bin / .idx
"""
import argparse
import sys


from gptpar.data.indexed import DataError
from gptpar.data.preprocess import preprocess


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenise (one output per key)")
    p.add_argument("--tokenizer-model", required=True,
                   help="SentencePiece .model, or a Hugging Face tokenizer.json or tokenizer directory")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between throughput updates")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in batch logs)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        s = preprocess(args.input, args.json_keys, args.tokenizer_model, args.output_prefix,
                       workers=args.workers, append_eod=args.append_eod, log_interval=args.log_interval,
                       progress=not args.no_progress)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"done: {s['docs']:,} documents in {s['seconds']:.1f} s "
          f"({s['docs'] / max(s['seconds'], 1e-9):,.0f} docs/s, {s['tokens_per_second']:,.0f} tokens/s), "
          f"dtype {s['dtype']}")
    for key, prefix in zip(args.json_keys, s["outputs"]):
        print(f"  {key}: {s['tokens'][key]:,} tokens, {s['empty_skipped'][key]:,} empty documents skipped "
              f"-> {prefix}.bin/.idx")
