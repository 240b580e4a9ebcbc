"""What a resume says about the checkpoint it was given, through pretrain_gpt.py's main on one gloo rank (one spawn
runs every case): a finished run resumed says there is nothing to train and exits 0 without training, evaluating
or saving; an `iter_N` folder holding another iteration is refused naming both; a checkpoint saved by a run with
another seed or global batch size is named with each key before it is used (gptpar.checkpoint.continuity), and
one of the same run is not."""
import os
import shutil

import pytest

from gptpar.checkpoint.layout import read_latest
from gptpar.testing import run_distributed
from gptpar.testing.runs import log_lines, main_output, write_config

ONE_RANK = {"data_parallel_size": 1}


def run_cases(d):
    out = {}

    def run(name, config, *extra):
        out[name] = main_output(["--config", config] + list(extra))

    a = str(d / "A")
    two = write_config(d / "two.json", parallel=ONE_RANK, training=dict(train_iters=2, lr_warmup_iters=1,
                                                                        eval_interval=2, eval_iters=1),
                       checkpoint=dict(save=a, load=a))
    run("train", two)
    run("finished", two)
    # iteration 2's folder copied under iteration 4's name
    shutil.copytree(d / "A" / "iter_0000002", d / "B" / "iter_0000004")
    (d / "B" / "latest").write_text("iter_0000004")
    run("renamed", two, "--set", f"checkpoint.load={d / 'B'}", "--set", f"checkpoint.save={d / 'C'}")
    three = ["--set", "training.train_iters=3", "--set", "training.eval_interval=null"]
    run("other_run", two, *three, "--set", f"checkpoint.save={d / 'D'}", "--set", "training.seed=7",
        "--set", "training.global_batch_size=16")
    run("same_run", two, *three, "--set", f"checkpoint.save={d / 'E'}")
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume_messages")
    return d, run_distributed(run_cases, 1, (d,), timeout=600)[0]


def test_a_finished_run_resumed_says_nothing_to_train(cases):
    d, out = cases
    rc, text = out["train"]
    assert rc == 0 and "training finished at iteration 2" in text, text
    rc, text = out["finished"]
    assert rc == 0, text
    lines = text.splitlines()
    resumed = next(i for i, line in enumerate(lines) if line.startswith(f"resumed from {d}/A/iter_0000002"))
    # after the resume line, only the answer: no LR line, no iteration, no evaluation, no save
    assert lines[resumed + 1:] == ["nothing to train: the checkpoint is at iteration 2 = training.train_iters (2); "
                                   "raise training.train_iters to train on"], text
    assert "Traceback" not in text and read_latest(str(d / "A")) == "iter_0000002"


def test_a_folder_holding_another_iteration_than_its_name_is_refused(cases):
    d, out = cases
    rc, text = out["renamed"]
    assert rc == 2, text
    assert (f"pretrain_gpt.py: checkpoint error: checkpoint {d}/B/iter_0000004 is named iter_0000004 but holds "
            f"iteration 2 (its rank files' counter)") in text
    assert "rename it iter_0000002" in text and "Traceback" not in text and not log_lines(text)
    assert not os.path.exists(d / "C" / "iter_0000003")


def test_another_runs_checkpoint_is_named_with_each_key_that_differs(cases):
    d, out = cases
    rc, text = out["other_run"]
    assert rc == 0, text
    notes = [line for line in text.splitlines() if line.startswith("note: this run's ")]
    assert notes == [
        "note: this run's training.seed differs from the checkpoint's run: checkpoint 1234, config 7: the samples "
        "from here on are another sequence than the saved run's",
        "note: this run's training.global_batch_size differs from the checkpoint's run: checkpoint 8, config 16: "
        "its consumed samples carry over; each iteration from here takes the new batch size"], text
    assert text.index(notes[-1]) < text.index(f"resumed from {d}/A/iter_0000002")  # said before it is used
    assert [line.split("/")[0].split()[-1] for line in log_lines(text)] == ["3"]
    rc, text = out["same_run"]
    assert rc == 0 and "note: this run's" not in text, text
