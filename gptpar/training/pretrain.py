"""The trainer's main: parse -> init -> build -> train -> clean up; pretrain_gpt.py at the repository root runs it.

Exit codes: 0 done (SIGTERM / SIGINT / SIGUSR1 / the kill switch file save after the current iteration first; a kill
switch file present at launch exits before building anything); 2 refused before anything changed
(a config error before any process group; a checkpoint, save folder or data that preflight refuses before the
model is built; a log that cannot be written; the master port already in use); 1 a failed save, a run gone NaN,
replicas that diverged, a log write that failed mid-run (after a save), or a collective that timed out (another rank
stopped answering) or lost its peer (another rank's process is gone): those two write this rank's diagnostics first
(gptpar.training.diagnostics; SIGUSR2 writes them live) and exit without saving. A rank whose launcher dies exits at
once without saving; one whose DeepSpeed runner dies while launch.py lives saves first
(gptpar.training.launcher_watch). The run is assembled in gptpar.training.assembly.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time

import torch.distributed as dist

from gptpar.data.indexed import DataError
from gptpar.model.kernels import describe_kernels
from gptpar.parallel import LaunchError, destroy_parallel, init_parallel, is_collective_timeout, is_peer_lost
from gptpar.quiet import held_back_lines
from gptpar.training.assembly import (build_trainer, checkpoint_shape, dry_run, setup_environment,
                                   write_resolved_config)
from gptpar.checkpoint.checkpointer import NonFiniteWeightsError
from gptpar.checkpoint.exceptions import CheckpointError, CheckpointSaveError
from gptpar.training.cli import parse, usage
from gptpar.training.collectives import CollectiveLog
from gptpar.training.diagnostics import Diagnostics, diagnostics_dir, point_nccl_dump_at
from gptpar.config import ConfigError
from gptpar.training.launcher_watch import launcher_chain, watch_launcher
from gptpar.training.reporting import LogPathError, LogWriteError
from gptpar.training.preflight import run_preflight
from gptpar.training.replicas import ReplicaDivergenceError
from gptpar.training.trainer import NonFiniteError

# What ends a run early, its exit code and the start of its one-line message: 1 = the run's own failure,
# 2 = refused before anything was changed.
FAILURES = ((NonFiniteWeightsError, 1, ""),  # the last save refused: the weights hold NaN/Inf
            (CheckpointSaveError, 1, "checkpoint save failed: "),  # a full disk or an I/O error while saving
            (NonFiniteError, 1, ""),
            (LogWriteError, 1, "log write failed: "),  # the metrics file or TensorBoard, mid-run (saved first)
            (ReplicaDivergenceError, 1, ""),
            (CheckpointError, 2, "checkpoint error: "),  # load, save folder or shape refused
            (DataError, 2, "data error: "),
            (LogPathError, 2, "logging error: "))  # logging.metrics_file / tensorboard_dir cannot be written


# How long a rank other than its node's first waits, after a refusal, for its launcher to end it (see say_refusal).
REFUSAL_WAIT_SECONDS = 60.0


def say_refusal(line: str) -> None:
    """One line per node for a refusal that every rank of the node meets alike (they read the same files): local
    rank 0 says it. A launcher ends every rank once one fails (torchrun, DeepSpeed's launch.py), so another local
    rank that refused first would end rank 0 before its line: under one, that rank waits to be ended, and says the
    line itself only if it was not."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        if not launcher_chain():
            return
        time.sleep(REFUSAL_WAIT_SECONDS)
    print(line, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """The run, or its exit code; SIGINT outside the training loop (whose stop signals save first) exits 130 in one
    line instead of a KeyboardInterrupt traceback."""
    try:
        return run(argv)
    except KeyboardInterrupt:
        print(f"pretrain_gpt.py: rank {os.environ.get('RANK', '0')}: interrupted (SIGINT) outside the training loop "
              "(starting up or shutting down): exiting without saving", file=sys.stderr, flush=True)
        return 130


def run(argv=None) -> int:
    # parse: every config error ends here, before any process group exists
    try:
        cfg, flags, sizes = parse(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as e:
        say_refusal(f"pretrain_gpt.py: config error: {e}")
        return 2
    if flags["help"] or flags["dry_run"]:
        try:
            print(usage() if flags["help"] else dry_run(cfg, *sizes, flags["sec_per_iter"], flags["calibration"],
                                                        gpu=flags["gpu"], assume=flags["assume"], as_json=flags["json"]),
                  flush=True)
        except ConfigError as e:  # a --calibration file that cannot be read
            print(f"pretrain_gpt.py: config error: {e}", file=sys.stderr, flush=True)
            return 2
        return 0

    # init: first of all, never outlive the launcher (gptpar.training.launcher_watch)
    watch = watch_launcher(label=f"rank {os.environ.get('RANK', '0')}",
                           save_seconds=60 * cfg.parallel.distributed_timeout_minutes)
    verbose = flags["verbose"]
    setup_environment(verbose)
    owns_process_group = not dist.is_initialized()  # a test harness may have made it
    tp, pp, dp = sizes
    point_nccl_dump_at(diagnostics_dir(cfg))
    try:
        pstate = init_parallel(tp, pp, dp, timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    except LaunchError as e:
        print(f"pretrain_gpt.py: launch error: {e}", file=sys.stderr, flush=True)
        watch.stop()
        return 2
    collectives = CollectiveLog().install()  # before DeepSpeed's backend keeps references to torch's functions
    diagnostics = Diagnostics(diagnostics_dir(cfg), pstate, collectives).install()
    log = print if pstate.rank == 0 else (lambda *args, **kwargs: None)
    log(f"gptpar: {pstate.world_size} rank(s) = tp {tp} x pp {pp} x dp {dp} on {pstate.backend}; "
        f"{describe_kernels(pstate.device, cfg.training.optimizer, cfg.training.compile)}", flush=True)
    if verbose:
        log(f"resolved config:\n{cfg.to_json()}", flush=True)
    preflight = None
    try:
        # check what load, save and the data mean before anything is built (rank 0 decides for all)
        preflight = run_preflight(cfg, pstate, checkpoint_shape(cfg, pstate), functools.partial(log, flush=True))
        if preflight.stop:
            log(preflight.stop, flush=True)
            return 0
        if pstate.rank == 0:
            log(write_resolved_config(cfg, pstate, verbose), flush=True)
        # build (DeepSpeed's known-harmless lines held back unless --verbose)
        with contextlib.nullcontext() if verbose else held_back_lines():
            trainer = build_trainer(cfg, pstate, log, preflight.load_target, preflight.init_from, collectives)
        watch.save_with(trainer.signals.request)  # DeepSpeed's runner gone: save, then exit
        if cfg.training.zero_stage_note:
            log(cfg.training.zero_stage_note, flush=True)
        log(trainer.engine.precision_plan(), flush=True)
        trainer.resume()
        # train
        finished = trainer.nothing_to_train()
        if finished is not None:
            log(finished, flush=True)
        else:
            reason = trainer.train()
            log(f"training finished at iteration {trainer.counters.iteration}: {reason}", flush=True)
        dist.barrier()
    except tuple(kind for kind, _, _ in FAILURES) as e:
        code, prefix = next((code, prefix) for kind, code, prefix in FAILURES if isinstance(e, kind))
        print(f"pretrain_gpt.py: {prefix}{e}", file=sys.stderr, flush=True)
        return code
    except RuntimeError as e:
        if not (is_collective_timeout(e) or is_peer_lost(e)):
            raise
        written = diagnostics.write(str(e))
        where = (f"; what this rank was doing is in {written} (tools/diagnose_hang.py {os.path.dirname(written)} "
                 "names the rank the others waited for)" if written else "")
        print(f"pretrain_gpt.py: rank {pstate.rank}: {collective_failure(e, cfg)}{where}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        # clean up
        if preflight is not None:
            preflight.release()
        diagnostics.close()
        collectives.uninstall()
        if owns_process_group:
            destroy_parallel()
        watch.stop()
    return 0


def collective_failure(e: RuntimeError, cfg) -> str:
    """The one line for a collective that timed out or lost its peer (no traceback: the cause is another rank)."""
    cause = str(e).splitlines()[0][:300]
    if is_collective_timeout(e):
        minutes = cfg.parallel.distributed_timeout_minutes
        return (f"a collective waited past parallel.distributed_timeout_minutes = {minutes:g} ({minutes * 60:g} s) "
                "for another rank, which stopped answering (stopped, e.g. by SIGSTOP or a debugger; hung; or its "
                "node lost): exiting without saving. Find that rank (its last lines, `py-spy dump --pid`), or raise "
                "parallel.distributed_timeout_minutes if a step really takes that long; then resume from `latest` "
                f"({cause})")
    return ("another rank's process is gone (killed, crashed or its node lost: its own last lines say why), so a "
            "collective lost its connection: exiting without saving, since its peers cannot save with it. Under "
            "`python -m gptpar.launch --max-restarts N` (or torchrun's) the ranks restart and resume from `latest`; "
            f"else resume from `latest` by hand ({cause})")



def exit_now(code: int) -> None:
    """Leave with `code` once everything is saved, closed and flushed, skipping the interpreter's teardown, where
    torch's and DeepSpeed's exit handlers rarely abort (exit -6) after a clean run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
