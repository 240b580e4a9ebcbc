"""Write a jsonl corpus of real text already on this machine: the Python standard library's sources.

    python tools/make_demo_corpus.py --output data/demo.jsonl --max-docs 2000
Each line is {"text": <a module's source>, "path": <its path under the stdlib>}; order is sorted by path, so
the corpus is the same on every machine with the same Python. No download.
"""
import argparse
import json
import os
import sys
import sysconfig

MAX_FILE_BYTES = 200_000  # skip generated giants (e.g. unicode tables) that would dominate a small corpus


def iter_stdlib_sources(root):
    for dirpath, dirnames, filenames in os.walk(root):
        # site-packages holds third-party code, not the standard library; sort for a stable order.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "dist-packages"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                if os.path.getsize(path) <= MAX_FILE_BYTES:
                    yield path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="where to read sources from")
    args = p.parse_args(argv)
    if not os.path.isdir(args.stdlib):
        sys.exit(f"error: {args.stdlib}: not a directory")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        sys.exit(f"error: {args.output}: output directory {out_dir} does not exist; create it first")
    tmp, n, n_bytes = f"{args.output}.tmp-{os.getpid()}", 0, 0
    with open(tmp, "w", encoding="utf-8") as out:
        for path in iter_stdlib_sources(args.stdlib):
            if args.max_docs is not None and n >= args.max_docs:
                break
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few test fixtures are deliberately not UTF-8
            if not text.strip():
                continue
            line = json.dumps({"text": text, "path": os.path.relpath(path, args.stdlib)}, ensure_ascii=False)
            out.write(line + "\n")
            n, n_bytes = n + 1, n_bytes + len(text)
    os.replace(tmp, args.output)
    print(f"wrote {n:,} documents ({n_bytes / 1e6:.1f} MB of text) from {args.stdlib} -> {args.output}")
