"""Generate text from a checkpoint, or score held-out text, at any tensor-parallel size (pp = 1).

    python tools/generate.py --load checkpoints/demo --prompt "def parse(" --max-new-tokens 48 --top-k 40
    python tools/generate.py --load CKPT --prompt-ids 5,17,42 --max-new-tokens 32 --greedy --print-ids
    torchrun --nproc_per_node 2 tools/generate.py --tp 2 --load CKPT --prompt-ids 5,17,42 --greedy --print-ids
    python tools/generate.py --load CKPT --eval-file held_out.jsonl          # perplexity of the `text` fields

--load takes a gptpar checkpoint saved at any tp x pp (a checkpoint directory, or the save directory holding
`latest`), a universal checkpoint or a local Hugging Face model directory: gptpar.checkpoint.model_loading.load_model reads
the full weights, and each rank keeps its tensor-parallel blocks. Text is encoded and decoded with --tokenizer,
else the checkpoint's own (the run's data.tokenizer_model, or the Hugging Face directory's tokenizer.json).

Output (rank 0, stdout): the prompt and its continuation as text when there is a tokenizer; `ids: a,b,c` (the
new ids only, comma-separated) with --print-ids or when there is no tokenizer; for --eval-file one line
`eval: FILE: D documents, N tokens, loss L, perplexity P` (P = exp of the mean loss over every predicted token,
each document scored in windows of model.seq_length, its first token never predicted). Bad arguments exit 2
before any weights are read.
"""
import argparse
import math
import os
import sys



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="gptpar checkpoint (any tp x pp) or Hugging Face model directory")
    p.add_argument("--tag", help="checkpoint tag inside --load (default: what `latest` points at)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    what.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 5,17,42")
    what.add_argument("--eval-file", help="jsonl of held-out documents: print their perplexity")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="--eval-file fields to score")
    p.add_argument("--tokenizer", help="tokenizer path (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (no sampling)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within the top-p probability mass (1: all)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed: the same seed draws the same tokens")
    p.add_argument("--stop-at-eod", action="store_true", help="stop after the tokenizer's end-of-document token")
    p.add_argument("--print-ids", action="store_true", help="also print the new ids: `ids: a,b,c`")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence each step (no KV cache)")
    p.add_argument("--no-verify", action="store_true", help="do not check the weight files against the sha256 their "
                                                            "manifest records (checked by default, before each is parsed)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size = the number of ranks (torchrun)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: only 1 (any pp checkpoint loads)")
    return p.parse_args(argv)


class UsageError(Exception):
    """A bad argument, found before any weights are read."""


def check_args(args):
    from gptpar.model.generation import Sampling

    if args.pp != 1:
        raise UsageError(f"--pp {args.pp}: generation runs at pp = 1 (use --tp to split the model); a checkpoint "
                         f"saved at any pp loads")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != ranks:
        raise UsageError(f"--tp {args.tp} needs {args.tp} ranks, this run has {ranks}: start it with torchrun "
                         f"--nproc_per_node {args.tp} tools/generate.py --tp {args.tp} ...")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.eval_file is not None and not os.path.isfile(args.eval_file):
        raise UsageError(f"--eval-file {args.eval_file} " + ("is a folder" if os.path.isdir(args.eval_file) else
                                                             "not found") + ": pass a jsonl file of documents")
    try:
        return Sampling(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    except ValueError as e:  # its message starts with the field's name
        raise UsageError("--" + str(e).replace("top_", "top-", 1)) from None


def load_inputs(args):
    """(tokenizer or None, prompt ids or None, eval documents or None) from the arguments; raises UsageError."""
    from gptpar.data.jsonl import iter_texts
    from gptpar.data.tokenizer import load_tokenizer
    from gptpar.checkpoint.weights import check_weight_files
    from gptpar.checkpoint.model_loading import tokenizer_path

    check_weight_files(args.load, args.tag)  # every weight file there and whole, before anything is built
    try:
        path = tokenizer_path(args.load, args.tag, args.tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    tokenizer = load_tokenizer(path) if path else None
    if tokenizer is None and (args.prompt is not None or args.eval_file or args.stop_at_eod):
        raise UsageError(f"{args.load} names no tokenizer to encode text with: pass --tokenizer PATH "
                         f"(or --prompt-ids)")
    if args.prompt_ids is not None:
        try:
            return tokenizer, [int(i) for i in args.prompt_ids.split(",")], None
        except ValueError:
            raise UsageError(f"--prompt-ids {args.prompt_ids!r}: give integers separated by commas, "
                             f"e.g. 5,17,42") from None
    if args.prompt is not None:
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise UsageError("--prompt encodes to no tokens: give some text")
        return tokenizer, ids, None
    documents = [tokenizer.encode(t) for t in iter_texts(args.eval_file, args.json_keys)]
    if not any(len(doc) > 1 for doc in documents):
        raise UsageError(f"--eval-file {args.eval_file}: no document has 2 tokens or more, nothing to score")
    return tokenizer, None, documents


def check_against_model(args, tokenizer, prompt_ids):
    """The model's shape, read without its weights, against the tokenizer, the prompt, --max-new-tokens and --tp:
    ids the model has no embedding for, a sequence longer than its positions and a tp that does not split it are
    refused, naming the field."""
    from gptpar.checkpoint.weights import read_weights_config
    from gptpar.model.generation import check_length
    from gptpar.checkpoint.model_loading import check_tokenizer_fits

    config = read_weights_config(args.load, args.tag)
    try:
        check_tokenizer_fits(config, tokenizer)
        config.check_parallel(args.tp, 1)
        if prompt_ids is not None:
            check_length(config, len(prompt_ids), args.max_new_tokens)
    except ValueError as e:
        raise UsageError(str(e)) from None
    bad = [i for i in prompt_ids or [] if not 0 <= i < config.vocab_size]
    if bad:
        raise UsageError(f"prompt ids {bad[:5]} are outside the model's vocabulary [0, {config.vocab_size}) "
                         f"(model.vocab_size)")


def run(args, sampling, tokenizer, prompt_ids, documents, log):
    from gptpar.model.generation import generate, mean_token_loss
    from gptpar.checkpoint.model_loading import load_model
    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import share_cpu_threads

    share_cpu_threads()
    pstate = init_parallel(tp=args.tp, pp=1, dp=1)
    model = load_model(args.load, args.tag, pstate, log=log, verify=not args.no_verify)
    if documents is not None:
        loss, tokens = mean_token_loss(model, documents, model.config.seq_length)
        log(f"eval: {args.eval_file}: {len(documents)} documents, {tokens} tokens, loss {loss:.9g}, "
            f"perplexity {math.exp(loss):.9g}")
        return
    stop = tokenizer.eod if args.stop_at_eod else None
    new = generate(model, prompt_ids, args.max_new_tokens, sampling, use_cache=not args.no_cache, stop_id=stop)
    if tokenizer is not None:
        log(tokenizer.decode(prompt_ids + new))
    if args.print_ids or tokenizer is None:
        log("ids: " + ",".join(map(str, new)))


def main(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist

    from gptpar.data.indexed import DataError
    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.parallel import destroy_parallel

    owns_process_group = not dist.is_initialized()  # a test harness may have made it
    try:
        sampling = check_args(args)
        tokenizer, prompt_ids, documents = load_inputs(args)
        check_against_model(args, tokenizer, prompt_ids)
        rank = int(os.environ.get("RANK", "0"))
        run(args, sampling, tokenizer, prompt_ids, documents, log=print if rank == 0 else (lambda *a: None))
    except (UsageError, DataError, CheckpointError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if owns_process_group:
            destroy_parallel()
    return 0
