"""`make demo`: train a small GPT on real text over 2 CPU (gloo) ranks, show the log lines, save a checkpoint.

Set-up, once, cached under data/demo/:
    tools/make_demo_corpus.py   the Python standard library's sources as a jsonl corpus (no download)
    tools/train_tokenizer.py    a BPE tokenizer whose size is configs/demo_cpu.json's model.vocab_size
    tools/preprocess_data.py    Megatron .bin/.idx files
Then the run (its time on a 2-core machine: the README), printed before it starts:
    deepspeed --num_gpus 2 pretrain_gpt.py --config configs/demo_cpu.json
then a continuation of the start of a Python function sampled from the model just trained:
    tools/generate.py --load checkpoints/demo --prompt ... (decoded with the demo's tokenizer)
then the run's metrics drawn (tools/plot_metrics.py) into runs/demo/metrics.png, whose path it prints, and, last,
the model evaluated with EleutherAI's lm-evaluation-harness on three small local tasks (tools/eval_tasks: a
multiple-choice, a perplexity and a generation task on Python; a few seconds, offline), its table printed:
    tools/eval_harness.py --load checkpoints/demo --tasks demo_python --include-path tools/eval_tasks
Every `make demo` trains from scratch: the demo's checkpoints and metrics (checkpoints/demo, runs/demo) are
cleared first; `--resume` keeps them and continues from the last checkpoint instead.

    python tools/demo.py [--launcher deepspeed|torchrun] [--resume] [--verbose]
                         [pretrain_gpt.py options, e.g. --set ...]
"""
import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
CONFIG = "configs/demo_cpu.json"
DATA_DIR = "data/demo"
CORPUS = os.path.join(DATA_DIR, "corpus.jsonl")
MAX_DOCS = 2000
# What the trained model is asked to continue, and how: top-k sampling (seeded, so a rerun prints the same text).
PROMPT = 'def read_lines(path):\n    """Return the lines of a text file."""\n'
SAMPLE = ["--max-new-tokens", "64", "--temperature", "0.8", "--top-k", "40", "--seed", "1234", "--stop-at-eod"]
# The evaluation: the three tasks tagged demo_python in tools/eval_tasks (YAML + jsonl, read offline).
EVAL = ["--tasks", "demo_python", "--include-path", "tools/eval_tasks", "--batch-size", "8",
        "--bootstrap-iters", "1000", "--output", "runs/demo/eval.json"]


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    p.add_argument("--resume", action="store_true", help="keep checkpoints/demo and continue from it")
    p.add_argument("--verbose", action="store_true",
                   help="everything: the launcher's INFO lines, the resolved config, third-party warnings "
                        "(pretrain_gpt.py --verbose)")
    p.add_argument("--prepare-only", action="store_true",
                   help="build data/demo (corpus, tokenizer, .bin/.idx) and stop (bench/gpu.sh prepare uses it)")
    return p.parse_known_args()


def run(cmd, env):
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def tokenizer_size(path):
    from gptpar.data.tokenizer import load_tokenizer

    return load_tokenizer(path).vocab_size


def prepare_data(cfg, env):
    """Corpus -> tokenizer -> .bin/.idx, each step skipped when its output is already there."""
    tokenizer, prefix = cfg["data"]["tokenizer_model"], cfg["data"]["data_path"]
    vocab = cfg["model"]["vocab_size"]
    py = sys.executable
    os.makedirs(os.path.join(ROOT, DATA_DIR), exist_ok=True)
    if not os.path.exists(os.path.join(ROOT, CORPUS)):
        run([py, "tools/make_demo_corpus.py", "--output", CORPUS, "--max-docs", str(MAX_DOCS)], env)
    model = os.path.join(ROOT, tokenizer)
    if not os.path.exists(model) or tokenizer_size(model) != vocab:  # the embedding is sized by the config
        run([py, "tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", str(vocab), "--model-type", "bpe",
             "--output-prefix", tokenizer[:-len(".model")], "--byte-fallback"], env)
        for stale in (prefix + ".bin", prefix + ".idx"):
            if os.path.exists(os.path.join(ROOT, stale)):
                os.remove(os.path.join(ROOT, stale))
    if tokenizer_size(model) != vocab:
        sys.exit(f"demo: {tokenizer} has {tokenizer_size(model)} pieces but {CONFIG} says model.vocab_size={vocab}")
    if not os.path.exists(os.path.join(ROOT, prefix + ".idx")):
        run([py, "tools/preprocess_data.py", "--input", CORPUS, "--json-keys", "text", "--tokenizer-model",
             tokenizer, "--output-prefix", prefix[:-len("_text_document")], "--workers", "2", "--append-eod",
             "--no-progress"], env)


def launch_command(launcher, extra, verbose=False):
    """The training command; quiet by default: DeepSpeed's launcher at `--log_level warning` (its INFO lines, e.g.
    `Setting CUDA_VISIBLE_DEVICES=0,1` on a CPU, held back), `--verbose` passed on to pretrain_gpt.py otherwise."""
    bindir = os.path.dirname(sys.executable)
    port = _free_port()
    if launcher == "deepspeed":
        head = [os.path.join(bindir, "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
        head += [] if verbose else ["--log_level", "warning"]
    else:
        head = [os.path.join(bindir, "torchrun"), "--nproc_per_node", "2", "--master_port", str(port)]
    return head + ["pretrain_gpt.py", "--config", CONFIG] + extra + (["--verbose"] if verbose else [])


def summary(cfg, seconds):
    path = os.path.join(ROOT, cfg["logging"]["metrics_file"])
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    train = [r for r in records if not r.get("eval") and r.get("lm_loss") is not None]
    evals = [r for r in records if r.get("eval")]
    print(f"\ndemo finished in {seconds / 60:.1f} min", flush=True)
    if train:
        print(f"  lm loss (mean over each log interval): {train[0]['lm_loss']:.3f} at iteration "
              f"{train[0]['iteration']} -> {train[-1]['lm_loss']:.3f} at iteration {train[-1]['iteration']}")
    if evals:
        print(f"  validation loss: {evals[0]['lm_loss']:.3f} (ppl {evals[0]['ppl']:.1f}) at iteration "
              f"{evals[0]['iteration']} -> {evals[-1]['lm_loss']:.3f} (ppl {evals[-1]['ppl']:.1f}) at iteration "
              f"{evals[-1]['iteration']}")
    save = os.path.join(ROOT, cfg["checkpoint"]["save"])
    latest = os.path.join(save, "latest")
    if os.path.exists(latest):
        print(f"  checkpoint: {os.path.join(cfg['checkpoint']['save'], open(latest).read().strip())} "
              f"(resume: add --resume, or run pretrain_gpt.py with the same config)")
    print(f"  metrics: {cfg['logging']['metrics_file']}, TensorBoard: {cfg['logging']['tensorboard_dir']}")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args, extra = parse()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    with open(os.path.join(ROOT, CONFIG)) as f:
        cfg = json.load(f)
    prepare_data(cfg, env)
    if args.prepare_only:
        return
    if not args.resume:
        for path in (cfg["checkpoint"]["save"], os.path.dirname(cfg["logging"]["metrics_file"])):
            shutil.rmtree(os.path.join(ROOT, path), ignore_errors=True)
    start = time.time()
    cmd = launch_command(args.launcher, extra, args.verbose)
    print("$ " + shlex.join([os.path.relpath(cmd[0], ROOT)] + cmd[1:]), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if rc != 0:
        sys.exit(f"demo: training exited with {rc}")
    summary(cfg, time.time() - start)
    print("\nthe trained model continues a prompt:", flush=True)
    run([sys.executable, "tools/generate.py", "--load", cfg["checkpoint"]["save"], "--prompt", PROMPT] + SAMPLE, env)
    draw_plot(cfg)  # the picture of the run
    print("\nthe trained model evaluated with lm-evaluation-harness:", flush=True)
    run([sys.executable, "tools/eval_harness.py", "--load", cfg["checkpoint"]["save"]] + EVAL, env)  # last: its table


def draw_plot(cfg):
    """The demo's loss curves and the rest of its metrics as a PNG beside the metrics file (tools/plot_metrics.py)."""
    from gptpar.tools import plot_metrics

    metrics = cfg["logging"]["metrics_file"]
    output = os.path.join(os.path.dirname(metrics), "metrics.png")
    try:
        plot_metrics.write_plot([os.path.join(ROOT, metrics)], os.path.join(ROOT, output))
    except ValueError as e:
        print(f"  plot: not drawn: {e}", flush=True)
        return
    print(f"  plot: {output} (python tools/plot_metrics.py RUN_DIR_OR_JSONL [...] --output FILE.png)", flush=True)
