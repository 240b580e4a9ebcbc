"""Concatenate several MMIDIDX datasets (same dtype) into one.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab
A directory given as input stands for every `*.idx` dataset inside it, in name order (as Megatron's tool).
"""
import argparse
import glob
import os
import sys


from gptpar.data.indexed import DataError, IndexedDataset, merge_datasets


def expand_inputs(inputs):
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.idx")))
            if not found:
                raise DataError(f"{item}: directory holds no .idx files")
            prefixes.extend(f[: -len(".idx")] for f in found)
        else:
            prefixes.append(item[: -4] if item.endswith((".bin", ".idx")) else item)
    return prefixes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    try:
        prefixes = expand_inputs(args.input)
        if os.path.abspath(args.output_prefix) in map(os.path.abspath, prefixes):
            raise DataError(f"{args.output_prefix}: output would overwrite one of the inputs; pick another prefix")
        n_docs = merge_datasets(prefixes, args.output_prefix)
        n_tokens = IndexedDataset(args.output_prefix).num_tokens
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"merged {len(prefixes)} datasets: {n_docs:,} documents, {n_tokens:,} tokens "
          f"-> {args.output_prefix}.bin/.idx")
