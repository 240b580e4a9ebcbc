"""Evaluate a checkpoint with EleutherAI's lm-evaluation-harness, at any tensor-parallel size.

    python tools/eval_harness.py --load checkpoints/demo --tasks lambada_openai,hellaswag --batch-size 8
    python tools/eval_harness.py --load CKPT --tasks my_task --include-path my_tasks/ --output results.json
    torchrun --nproc_per_node 2 tools/eval_harness.py --tp 2 --load CKPT --tasks piqa --num-fewshot 5

--load takes what tools/generate.py takes: a gptpar checkpoint saved at any tp x pp (a checkpoint directory, or the
save directory holding `latest`), a universal checkpoint, or a local Hugging Face GPT-2 / BLOOM directory
(gptpar.checkpoint.model_loading); each rank keeps its tensor-parallel blocks (pp = 1), so a 176B checkpoint is evaluated
where it was trained, without converting it. Text is encoded with --tokenizer, else the checkpoint's own (the
run's data.tokenizer_model, a SentencePiece model or a Hugging Face tokenizer; or the Hugging Face directory's),
without special tokens, as gptpar's preprocessing encodes the training data.

The model is an lm-eval `TemplateLM`, as the harness's own Hugging Face model (lm_eval.models.huggingface.HFLM) is,
and follows HFLM wherever the numbers depend on it: the context/continuation split (TemplateLM's), requests sorted
longest first and batched (`--batch-size` per forward, right-padded; identical requests, and multiple-choice
answers whose context and tokens but the last agree, share one forward, so ties break as HFLM's do), the rolling
windows of loglikelihood_rolling (the harness's own, of the length HFLM resolves: the model's positions, else the
tokenizer's model_max_length, else 2048; or --max-length), the prefix token (the tokenizer's declared BOS, else its
end-of-document token), and generate_until (greedy, stop sequences plus the end-of-document token, 256 new tokens
unless the task says otherwise, the context cut from the left to leave room for them; the rows of a batch are
left-padded and generated together over a KV cache, gptpar.model.generation.generate_batch). A task that asks for
sampling (do_sample) is refused. The model runs in eval mode, in bf16 on a GPU and fp32 on a CPU (--dtype);
log-softmax is taken in fp32.

With --tp N (under torchrun, one rank per tp rank): rank 0 runs the harness; every rank runs the model. Each model
call rank 0 makes is broadcast to the other ranks (ModelServer), which run the same forward with it, its
collectives included.

Output (rank 0): the harness's results table on stdout; with --output FILE the harness's JSON (results, configs,
versions, n-shot, ..., with --log-samples every document's requests and responses) and gptpar's provenance
under "gptpar" (the checkpoint's path, iteration and consumed samples and tokens, tp, dtype, max length).
Bad arguments (an unknown task, a tokenizer with ids the model lacks, a --tp that does not split the heads, a
--num-fewshot above a task's few-shot documents, a task whose local jsonl does not parse, an --output that cannot
be written, --log-samples without --output, ...) print one message and exit 2 before any weights are read: rank 0
builds the tasks, their documents read, before the model. An error on rank 0 once the model is loaded releases the
other ranks at once.
"""
import argparse
import json
import os
import re
import sys


# HFLM's defaults: the longest window when neither the model nor the tokenizer says, and the new tokens of a
# generation whose task names none.
DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
DTYPES = ("auto", "float32", "bfloat16", "float16")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="gptpar checkpoint (any tp x pp), universal checkpoint or Hugging "
                                                 "Face model directory")
    p.add_argument("--tag", help="checkpoint tag inside --load (default: what `latest` points at)")
    p.add_argument("--tasks", required=True, help="comma-separated task, group or tag names (or task YAML files)")
    p.add_argument("--include-path", help="a folder of task YAML files to add to the harness's")
    p.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own, else 0)")
    p.add_argument("--batch-size", type=int, default=1, help="requests per forward (default 1)")
    p.add_argument("--limit", type=float, help="documents per task (a fraction of them when < 1)")
    p.add_argument("--output", help="write the results JSON here")
    p.add_argument("--log-samples", action="store_true", help="add every document's requests and responses to "
                                                              "--output")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size = the number of ranks (torchrun)")
    p.add_argument("--no-verify", action="store_true", help="do not check the weight files against the sha256 their "
                                                            "manifest records (checked by default, before each is parsed)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--max-length", type=int, help="longest sequence fed to the model (default: as HFLM resolves it)")
    p.add_argument("--tokenizer", help="tokenizer path (default: the checkpoint's)")
    p.add_argument("--seed", default="0,1234,1234,1234",
                   help="the harness's seeds: python,numpy,torch,few-shot (or one value for all)")
    p.add_argument("--bootstrap-iters", type=int, default=100000,
                   help="bootstrap iterations for the standard errors (0: none)")
    return p.parse_args(argv)


class UsageError(Exception):
    """A bad argument, found before any weights are read."""


class RequestError(Exception):
    """A task asks for what this model does not do (sampling, a context that cannot fit)."""


def check_args(args):
    """The arguments that need nothing read; returns the four seeds. Raises UsageError."""
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp != ranks:
        raise UsageError(f"--tp {args.tp} needs {args.tp} ranks, this run has {ranks}: start it with torchrun "
                         f"--nproc_per_node {args.tp} tools/eval_harness.py --tp {args.tp} ...")
    for flag, value, low in (("--batch-size", args.batch_size, 1), ("--num-fewshot", args.num_fewshot, 0),
                             ("--max-length", args.max_length, 1), ("--bootstrap-iters", args.bootstrap_iters, 0)):
        if value is not None and value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if args.limit is not None:
        if not args.limit > 0 or (args.limit >= 1 and args.limit != int(args.limit)):
            raise UsageError(f"--limit must be a whole number of documents or a fraction in (0, 1), "
                             f"got {args.limit:g}")
        args.limit = int(args.limit) if args.limit >= 1 else args.limit
    if args.include_path and not os.path.isdir(args.include_path):
        raise UsageError(f"--include-path {args.include_path} is not a folder of task YAML files")
    if args.log_samples and not args.output:
        raise UsageError("--log-samples needs --output FILE: the samples go into the results JSON (lm-eval's own "
                         "command line refuses --log_samples without --output_path too)")
    if args.output:
        check_output(args.output)
    try:
        seeds = [int(s) for s in args.seed.split(",")]
    except ValueError:
        seeds = []
    if len(seeds) not in (1, 4):
        raise UsageError(f"--seed {args.seed!r}: give one integer or four (python,numpy,torch,few-shot)")
    return seeds * 4 if len(seeds) == 1 else seeds


def check_output(path):
    """--output names a file whose folder takes a new file: checked by creating and removing one there, so that a
    read-only folder or mount is found before the evaluation rather than after it. Raises UsageError."""
    import tempfile

    if os.path.isdir(path):
        raise UsageError(f"--output {path} is a folder: give the results file's path, e.g. "
                         f"{os.path.join(path, 'results.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--output {path}: its folder does not exist (create it first)")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.probe-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--output {path}: its folder {folder} takes no new file ({e.strerror}): give --output a "
                         f"writable folder") from None


def load_tokenizer(args):
    """(tokenizer, its path) of --tokenizer or the checkpoint; raises UsageError."""
    from gptpar.data.tokenizer import load_tokenizer as load
    from gptpar.checkpoint.model_loading import tokenizer_path

    try:
        path = tokenizer_path(args.load, args.tag, args.tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not path:
        raise UsageError(f"{args.load} names no tokenizer to encode the tasks' text with: pass --tokenizer PATH")
    return load(path), path


def check_model(args, tokenizer):
    """The model's config, read without its weights and checked against the tokenizer and --tp; every weight file
    there and whole (gptpar.checkpoint.weights.check_weight_files)."""
    from gptpar.checkpoint.weights import check_weight_files, read_weights_config
    from gptpar.checkpoint.model_loading import check_tokenizer_fits

    check_weight_files(args.load, args.tag)
    config = read_weights_config(args.load, args.tag)
    try:
        check_tokenizer_fits(config, tokenizer)
        config.check_parallel(args.tp, 1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_length and config.learned_positions and args.max_length > config.max_position_embeddings:
        raise UsageError(f"--max-length {args.max_length} exceeds the model's model.max_position_embeddings "
                         f"({config.max_position_embeddings})")
    return config


def tokenizer_model_max_length(path):
    """A Hugging Face tokenizer directory's declared model_max_length (None when it declares none)."""
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isdir(path) or not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f).get("model_max_length")


def max_length(args, config, tokenizer_path):
    """--max-length, else what HFLM resolves for the same model (lm_eval.models.utils.resolve_max_length): the
    positions of a model with learned ones (GPT-2's n_positions), else the tokenizer's model_max_length (an ALiBi
    model's exported config names no positions), else 2048."""
    from types import SimpleNamespace

    from lm_eval.models.utils import resolve_max_length

    if args.max_length:
        return args.max_length
    positions = config.max_position_embeddings if config.learned_positions else None
    return resolve_max_length(SimpleNamespace(n_positions=positions),
                              SimpleNamespace(model_max_length=tokenizer_model_max_length(tokenizer_path)),
                              default=DEFAULT_MAX_LENGTH)


def resolve_tasks(tasks, include_path):
    """(the harness's TaskManager, the task names with glob patterns expanded). Tasks found in --include-path
    alone skip indexing the harness's own thousands of tasks. Raises UsageError naming an unknown task."""
    import difflib

    from lm_eval.tasks import TaskManager

    wanted = [t.strip() for t in tasks.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--tasks names no task")

    def expand(manager):
        found = [[t] if os.path.isfile(t) else manager.match_tasks([t]) for t in wanted]
        return [name for names in found for name in names], [t for t, names in zip(wanted, found) if not names]

    if include_path:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        names, unknown = expand(manager)
        if not unknown:
            return manager, names
    manager = TaskManager(include_path=include_path)
    names, unknown = expand(manager)
    if unknown:
        where = f"the harness's tasks or {include_path}" if include_path else "the harness's tasks"
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f" (close: {', '.join(close)})" if close else ""
        raise UsageError(f"--tasks: unknown task {unknown[0]!r}{hint}: no task, group or tag of {where} has that "
                         f"name (`lm-eval ls tasks` lists them; add your own with --include-path)")
    return manager, names


def load_tasks(manager, names, num_fewshot):
    """The harness's tasks and groups for `names`, built (their documents read) before any weights are, in the
    order the harness lists them: what `run_harness` evaluates. A task whose local data does not parse, or whose
    few-shot documents are fewer than its prompts draw, raises UsageError naming it."""
    import logging

    quiet = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]  # their error and retry lines
    levels = [log.level for log in quiet]  # would precede ours
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    try:
        loaded = manager.load(names)
    except Exception as e:  # noqa: BLE001 - the datasets library's errors name neither the task nor the file
        raise UsageError(task_load_error(manager, names, e)) from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    for name, task in loaded["tasks"].items():
        check_fewshot(name, task, num_fewshot)
    groups = list(loaded["groups"].values())
    nested = {id(sub) for group in groups for sub in group.get_all_groups()}
    owner = {id(task): group for group in groups if id(group) not in nested for task in group.get_all_tasks()}
    built = []
    for task in loaded["tasks"].values():
        top = owner.get(id(task), task)
        if not any(top is b for b in built):
            built.append(top)
    return built


def check_fewshot(name, task, num_fewshot):
    """lm-eval draws each prompt's examples without replacement from the task's few-shot documents, leaving out
    the document under evaluation when they are its test split: there must be that many. Raises UsageError."""
    own = task.get_config("num_fewshot")
    from_flag = num_fewshot is not None and own != 0  # a task whose config says 0 keeps 0 (lm-eval's rule)
    shots = num_fewshot if from_flag else (own or 0)
    sampler = getattr(task, "sampler", None)
    if not shots or sampler is None:
        return
    pool = len(sampler.fewshot_docs())
    split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    itself = split is not None and split == task.config.test_split
    most = pool - 1 if itself else pool
    if shots > most:
        asked = f"--num-fewshot {shots}" if from_flag else f"task {name}'s own num_fewshot {shots}"
        where = f" (its {split} split, one of them the document under evaluation)" if itself else ""
        raise UsageError(f"{asked}: task {name} has {pool} documents to draw examples from{where}: use "
                         f"--num-fewshot {max(most, 0)} or fewer")


def task_configs(manager, names):
    """(name, YAML config) of every task the names stand for (a group's or a tag's tasks included)."""
    index, wanted, seen = manager.task_index, list(names), set()
    while wanted:
        name = wanted.pop(0)
        if not isinstance(name, str) or name in seen:
            continue
        seen.add(name)
        wanted += [entry.name for entry in index.values() if name in (entry.tags or ())]  # a tag's tasks
        cfg = (index[name].cfg if name in index else None) or {}
        if isinstance(cfg.get("task"), list):  # a group's tasks
            wanted += [t.get("task") if isinstance(t, dict) else t for t in cfg["task"]]
        yield name, cfg


def task_data_files(manager, names):
    """The local files that the tasks named read through their YAML's dataset_kwargs.data_files."""
    files = []
    for _, cfg in task_configs(manager, names):
        data = (cfg.get("dataset_kwargs") or {}).get("data_files")
        paths = data.values() if isinstance(data, dict) else [data]
        for path in paths:
            for p in [path] if isinstance(path, str) else path or []:
                if isinstance(p, str) and os.path.isfile(p) and p not in files:
                    files.append(p)
    return files


def first_malformed_line(path):
    """(line number, why) of the first line of a jsonl file that is not one JSON value; None when every line is
    one, or when the whole file is one JSON document (the json loader reads those too)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError as e:
                bad = (number, getattr(e, "msg", str(e)))
                break
        else:
            return None
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
        return None
    except ValueError:
        return bad


def task_load_error(manager, names, error):
    """One line for a task that the harness could not build: the malformed line of its local data when there is
    one, else the innermost error."""
    for path in task_data_files(manager, names):
        bad = first_malformed_line(path)
        if bad:
            return (f"--tasks: {path} line {bad[0]} is not valid JSON ({bad[1]}): each line of a task's jsonl "
                    f"must be one JSON object; fix or remove that line")
    chain = [error]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    unreachable = [e for e in chain if "Couldn't reach" in str(e) or type(e).__name__ in (
        "LocalEntryNotFoundError", "OfflineModeIsEnabled")]
    if unreachable:
        found = re.search(r"Couldn't reach '([^']+)'", " ".join(str(e) for e in unreachable))
        dataset = found.group(1) if found else None
        tasks = [name for name, cfg in task_configs(manager, names) if dataset and cfg.get("dataset_path") == dataset]
        return (f"--tasks: task {', '.join(tasks or names)} needs the dataset {dataset or '(its dataset)'} from the "
                "Hugging Face Hub, which cannot be reached from here (offline): evaluate it once where the Hub is "
                "reachable (the datasets cache, HF_DATASETS_CACHE, keeps it for offline runs), or evaluate local "
                "tasks with --include-path (tools/eval_tasks has examples)")
    error = chain[-1]
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"--tasks: the harness could not load {', '.join(names)} ({type(error).__name__}: {first})"


def default_dtype(name, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class ModelServer:
    """The model on every tensor-parallel rank. Rank 0 calls `log_probs` and `generate`; the other ranks wait in
    `serve` and run each call rank 0 makes with the same arguments (one broadcast of the call per call), since
    every forward is a collective over the tp ranks. `close` (rank 0) ends the other ranks' `serve`."""

    CALLS = ("log_probs", "generate")

    def __init__(self, model, tokenizer, pstate):
        self.model, self.tokenizer = model, tokenizer
        self.rank, self.world_size, self.device = pstate.rank, pstate.world_size, pstate.device
        self.closed = False

    def call(self, name, *args):
        if self.world_size > 1:
            import torch.distributed as dist

            dist.broadcast_object_list([(name, args)], src=0)
        return getattr(self, name)(*args)

    def serve(self):
        """Run rank 0's calls until it closes. A call that raises here raises on rank 0 too (the same arguments,
        the same checks): rank 0 reports it and closes, so this rank keeps waiting for that close."""
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args = box[0]
            if name == "close":
                return
            if name not in self.CALLS:
                raise RuntimeError(f"rank 0 sent an unknown call {name!r}")
            try:
                getattr(self, name)(*args)
            except Exception:  # noqa: BLE001 - rank 0 meets the same error and says it
                pass

    def close(self):
        """Release the other ranks' `serve` (rank 0; once)."""
        if self.world_size > 1 and not self.closed:
            import torch.distributed as dist

            self.closed = True
            dist.broadcast_object_list([("close", ())], src=0)

    def log_probs(self, rows, keep):
        """Each row's last keep[i] positions' log-probabilities over the vocabulary, fp32 (keep[i], V) on rank 0
        (None elsewhere): one forward of the rows right-padded with id 0, which causal attention keeps away from
        every real position."""
        import torch
        import torch.nn.functional as F

        from gptpar.model.generation import full_vocab_logits

        width = max(len(row) for row in rows)
        ids = torch.tensor([list(row) + [0] * (width - len(row)) for row in rows], dtype=torch.long,
                           device=self.device)  # (b, s)
        with torch.no_grad():
            logits = self.model(ids)  # (b, s, V/tp)
            picked = torch.cat([logits[i, len(row) - k:len(row)] for i, (row, k) in enumerate(zip(rows, keep))])
            picked = full_vocab_logits(self.model, picked)  # (sum of keep, V): the vocab gathered, padding dropped
        if self.rank != 0:
            return None
        return list(F.log_softmax(picked.float(), dim=-1).split(list(keep)))

    def generate(self, prompts, max_new_tokens, until):
        """Greedy continuations (ids) of the prompts, each ending at the end-of-document token, at the first of
        the stop strings `until` in its text, or after max_new_tokens. Every rank decides alike (same ids)."""
        from gptpar.model.generation import Sampling, generate_batch

        stops = [s for s in until if s]

        def stopped(_, new_ids):
            text = self.tokenizer.decode(new_ids)
            return any(s in text for s in stops)

        return generate_batch(self.model, prompts, max_new_tokens, Sampling(greedy=True),
                              stop_id=self.tokenizer.eod, stop=stopped if stops else None)


class HarnessMethods:
    """lm-eval's TemplateLM over a ModelServer: what `harness_model` puts in front of the harness's base class (kept
    apart so that this module imports lm_eval only inside functions). Follows lm_eval.models.huggingface.HFLM."""

    backend = "causal"

    def __init__(self, server, tokenizer, *, max_length, batch_size, prefix_token_id, info):
        super().__init__()  # lm_eval's LM: rank 0 of 1 for the harness
        self.server, self.tokenizer = server, tokenizer
        self._max_length, self.batch_size, self._prefix_token_id, self.info = (max_length, batch_size,
                                                                              prefix_token_id, info)

    @property
    def eot_token_id(self):
        return self.tokenizer.eod

    @property
    def prefix_token_id(self):
        return self._prefix_token_id

    @property
    def max_length(self):
        return self._max_length

    @property
    def max_gen_toks(self):
        return DEFAULT_MAX_GEN_TOKS

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        ids = self.tokenizer.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens=True):
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def get_model_info(self):
        return self.info

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        """(log-likelihood of the continuation, whether greedy decoding gives it) per (strings, context ids,
        continuation ids) request, in request order."""
        import torch
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        def longest_first(req):  # HFLM's order: longest first, ties by the ids
            return -len(req[1] + req[2]), tuple(req[1] + req[2])

        # Requests whose context + continuation[:-1] agree share one forward (get_cache hands it to each).
        order = Collator(requests, sort_fn=longest_first, group_by="contexts",
                         group_fn=lambda req: req[-2] + req[-1][:-1])
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch_size):
            rows, keep = [], []
            for _, context, continuation in chunk:
                if not context or not continuation or len(continuation) > self.max_length:
                    raise RequestError(f"a request with {len(context)} context and {len(continuation)} continuation "
                                     f"tokens: both must be non-empty and the continuation at most the max length "
                                     f"{self.max_length}")
                rows.append((context + continuation)[-(self.max_length + 1):][:-1])  # cut from the left
                keep.append(len(continuation))
            for (strings, context, continuation), log_probs in zip(chunk, self.server.call("log_probs", rows, keep)):
                log_probs = log_probs.unsqueeze(0)  # (1, len(continuation), V)
                greedy = log_probs.argmax(dim=-1)
                for strings, tokens, log_probs in order.get_cache(req_str=strings, cxt_toks=context,
                                                                  cont_toks=continuation, logits=log_probs):
                    tokens = torch.tensor(tokens, dtype=torch.long, device=log_probs.device).unsqueeze(0)
                    # A grouped request's continuation ends where its group's longest does: its last positions.
                    n = tokens.shape[1]
                    score = torch.gather(log_probs[:, -n:], 2, tokens.unsqueeze(-1)).sum()
                    answer = (float(score), bool((greedy[:, -n:] == tokens).all()))
                    results.append(answer)
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, answer)
                    bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each string's log-likelihood, every token predicted once, in the harness's rolling windows of
        max_length tokens (after the prefix token), summed in window order."""
        from lm_eval import utils

        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0] * len(requests)
        for index, (score, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[index] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations of each context, cut at the first stop sequence (HFLM's rules)."""
        from lm_eval.models.utils import (Collator, handle_stop_sequences, normalize_gen_kwargs,
                                          postprocess_generated_text)
        from tqdm import tqdm

        # Longest context first; requests with other generation arguments in other batches.
        order = Collator([req.args for req in requests], sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
                         group_by="gen_kwargs", group_fn=lambda req: req[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise RequestError(f"a task asks for sampling (generation_kwargs {dict(all_kwargs[0])}): "
                                 f"tools/eval_harness.py decodes greedily only (set do_sample: false)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs.pop("max_gen_toks")
            room = self.max_length - max_gen_toks  # the context is cut from the left to leave room
            if room < 1:
                raise RequestError(f"a task asks for {max_gen_toks} new tokens, which leaves no room for a context "
                                 f"in the max length {self.max_length} (--max-length)")
            prompts = [self.tok_encode(context, left_truncate_len=room) or [self.prefix_token_id]
                       for context in contexts]
            for (context, gen_kwargs), ids in zip(chunk, self.server.call("generate", prompts, max_gen_toks, until)):
                text = postprocess_generated_text(self.tok_decode(ids), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)


def harness_model(server, tokenizer, **kwargs):
    """An lm_eval TemplateLM (HarnessMethods on lm-eval's base class) over `server`."""
    from lm_eval.api.model import TemplateLM

    cls = type("GptparLM", (HarnessMethods, TemplateLM), {"__doc__": HarnessMethods.__doc__})
    return cls(server, tokenizer, **kwargs)


class OutputError(Exception):
    """--output could not be written after the evaluation (a disk that filled up since the check)."""


def run_harness(args, lm, manager, tasks, seeds):
    """The harness's simple_evaluate over `lm`: its results dict."""
    from lm_eval import simple_evaluate

    random_seed, numpy_seed, torch_seed, fewshot_seed = seeds
    return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=args.num_fewshot,
                           batch_size=args.batch_size, limit=args.limit, bootstrap_iters=args.bootstrap_iters,
                           log_samples=args.log_samples, random_seed=random_seed, numpy_random_seed=numpy_seed,
                           torch_random_seed=torch_seed, fewshot_random_seed=fewshot_seed)


def report(args, results, provenance, log):
    """The table (stdout) and, with --output, the JSON: the harness's results plus gptpar's provenance."""
    from lm_eval.utils import handle_non_serializable, make_table

    iteration = provenance["iteration"]
    log(f"{provenance['checkpoint']}" + (f" (iteration {iteration}, {provenance['consumed_tokens']} tokens)"
                                         if iteration is not None else "")
        + f", tp {provenance['tp']}, {provenance['dtype']}, max length {provenance['max_length']}, "
          f"batch size {args.batch_size}, limit {args.limit}, num_fewshot {args.num_fewshot}")
    log(make_table(results))
    if results.get("groups"):
        log(make_table(results, "groups"))
    if args.output:
        out = dict(results, gptpar=provenance)
        tmp = f"{args.output}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1, default=handle_non_serializable, ensure_ascii=False)
            os.replace(tmp, args.output)
        except OSError as e:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise OutputError(f"could not write --output {args.output} ({e.strerror}); the table above holds the "
                              f"results, nothing was left there") from None
        log(f"results: {args.output}")


def run(args, seeds, tokenizer, tokenizer_path, config, log):
    import torch.distributed as dist

    from gptpar.checkpoint.model_loading import checkpoint_provenance, load_model
    from gptpar.model.pipeline import model_parameter_count
    from gptpar.parallel import init_parallel
    from gptpar.training.assembly import share_cpu_threads

    share_cpu_threads()
    length = max_length(args, config, tokenizer_path)
    provenance = checkpoint_provenance(args.load, args.tag)
    pstate = init_parallel(tp=args.tp, pp=1, dp=1)
    # Rank 0 checks the task names (the harness's index); every rank learns the verdict.
    # Rank 0 builds the tasks (their documents read) before any weights are: a task that cannot run says so now.
    verdict = [None]
    if pstate.rank == 0:
        try:
            manager, names = resolve_tasks(args.tasks, args.include_path)
            tasks = load_tasks(manager, names, args.num_fewshot)
        except UsageError as e:
            verdict = [str(e)]
    if pstate.world_size > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UsageError(verdict[0])

    dtype = default_dtype(args.dtype, pstate.device)
    model = load_model(args.load, args.tag, pstate, dtype, log=lambda line: print(line, file=sys.stderr)
                       if pstate.rank == 0 else None, verify=not args.no_verify)
    server = ModelServer(model, tokenizer, pstate)
    if pstate.rank != 0:
        server.serve()
        return
    try:  # whatever rank 0 raises from here on, the other ranks are released at once
        provenance.update(tp=args.tp, dtype=str(dtype).replace("torch.", ""), max_length=length,
                          tokenizer=os.path.abspath(tokenizer_path))
        info = {"model_num_parameters": model_parameter_count(config),
                "model_dtype": provenance["dtype"], "gptpar_checkpoint": provenance["checkpoint"]}
        # HFLM's prefix for a request without context: the tokenizer's declared BOS, else its end-of-document token.
        prefix = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
        lm = harness_model(server, tokenizer, max_length=length, batch_size=args.batch_size,
                           prefix_token_id=prefix, info=info)
        results = run_harness(args, lm, manager, tasks, seeds)
    finally:
        server.close()
    report(args, results, provenance, log)


def main(argv=None):
    args = parse_args(argv)
    import torch.distributed as dist

    from gptpar.data.indexed import DataError
    from gptpar.parallel import destroy_parallel
    from gptpar.checkpoint.exceptions import CheckpointError

    owns_process_group = not dist.is_initialized()  # a test harness may have made it
    rank = int(os.environ.get("RANK", "0"))
    try:
        seeds = check_args(args)
        tokenizer, tokenizer_path = load_tokenizer(args)
        config = check_model(args, tokenizer)
        run(args, seeds, tokenizer, tokenizer_path, config, log=print if rank == 0 else (lambda *a: None))
    except (UsageError, DataError, CheckpointError, RequestError) as e:
        if rank == 0:  # every rank finds the same: one message
            print(f"eval_harness.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except OutputError as e:
        print(f"eval_harness.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if owns_process_group:
            destroy_parallel()
    return 0
