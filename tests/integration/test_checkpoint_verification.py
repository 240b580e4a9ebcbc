"""One verification on every read: a byte flipped inside each kind of file each reader reads (a training
checkpoint's model states and optimizer shards, a universal copy's fp32.pt, a weights-only export, a Hugging Face
export) is refused by every reader — a resume at the same and at another shape, a universal copy reused or loaded,
checkpoint.init_from, a weights-only checkpoint.load, tools/generate.py, tools/eval_harness.py and every
tools/convert_checkpoint.py target — naming the file, exit 2, no traceback; a deleted or half-written manifest is
refused naming it; and an async snapshot that fails on one rank ends every rank at the same iteration, `latest`
unchanged, the previous checkpoint resuming bitwise.

The checkpoint is a real 2-rank run's (dp 2, ZeRO-1), its conversions made by the tools; every expected outcome is
the run's own (its losses), never a copied number."""
import contextlib
import io
import json
import os
import shutil

import pytest

from gptpar.testing import flip_a_byte_inside_a_tensor, run_distributed
from gptpar.testing.runs import ROOT, environ_kept, read_jsonl, run_mains, write_config


MODEL = dict(vocab_size=300)  # room for the byte-level tokenizer the evaluation needs
SHARD = "mp_rank_00_model_states.pt"
OPTIM_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # written (and verified) by rank 1
QUIET = ["--set", "checkpoint.save=null"]


def _flipped(src, dst, *relpaths):
    shutil.copytree(src, dst)
    for rel in relpaths:
        flip_a_byte_inside_a_tensor(os.path.join(dst, rel))
    return str(dst)


def _tool(module, argv):
    """(exit code, stdout + stderr) of a tool's main called here."""
    buf = io.StringIO()
    with environ_kept(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = module.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, buf.getvalue()


def _two_rank_cases(d, runs):
    """On each rank: gptpar.training.pretrain.main for each case; rank 1's async snapshot of iteration 4 fails in "fail"."""
    import torch.distributed as dist

    from gptpar.checkpoint.writer import CheckpointWriter

    real_save = CheckpointWriter.save

    def failing_save(self, state_dict, path):
        if "iter_0000004.tmp-" in path and dist.get_rank() == 1:
            def no_memory(nbytes, pinned, **_):
                raise RuntimeError("cannot allocate pinned host memory (injected)")
            real_take, self._buffers.take = self._buffers.take, no_memory
            try:
                return real_save(self, state_dict, path)
            finally:
                self._buffers.take = real_take
        return real_save(self, state_dict, path)

    out = {}
    for name, argv in runs:
        if name == "fail":
            CheckpointWriter.save = failing_save
        out.update(run_mains([(name, argv)]))
        CheckpointWriter.save = real_save
    return out


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A 2-rank run saving iterations 2 and 4, then its universal, weights-only and Hugging Face conversions."""
    from gptpar.tools import convert_checkpoint

    from gptpar.testing.tiny_tokenizer import train_hf_tokenizer

    d = tmp_path_factory.mktemp("verification")
    ck = str(d / "ck")
    base = write_config(d / "base.json", model=MODEL, training=dict(train_iters=4),
                        checkpoint=dict(save=ck, save_interval=2))
    (out0, _) = run_distributed(run_mains, 2, ([("base", ["--config", base])],), timeout=600)
    assert out0["base"][0] == 0, out0["base"][1]
    for target, extra in (("u", []), ("w", []), ("hf", [])):
        to = {"u": "universal", "w": "gptpar", "hf": "hf"}[target]
        rc, text = _tool(convert_checkpoint, ["--load", ck, "--to", to, "--output", str(d / target)] + extra)
        assert rc == 0, text
    train_hf_tokenizer(d / "tok", vocab_size=MODEL["vocab_size"])
    return d


def test_a_flipped_byte_ends_a_resume_on_every_rank(d):
    """Same shape: rank 1 finds its shard changed as DeepSpeed loads it, both ranks stop with the same line naming
    it (exit 2); with the manifest deleted or cut in half the checkpoint is refused before anything is built,
    naming the manifest. An async snapshot failing on rank 1 stops both ranks at the next iteration (exit 1),
    `latest` unchanged, and the checkpoint before it resumes to the failed run's losses, bit for bit."""
    from gptpar.checkpoint.layout import read_latest

    ck = d / "ck"
    flip = _flipped(ck, d / "flip", f"iter_0000004/{OPTIM_1}")
    cut, gone = str(d / "cut"), str(d / "gone")
    shutil.copytree(ck, cut)
    shutil.copytree(ck, gone)
    manifest = os.path.join(cut, "iter_0000004", "gptpar_manifest.json")
    text = open(manifest).read()
    open(manifest, "w").write(text[:len(text) // 2])
    os.remove(os.path.join(gone, "iter_0000004", "gptpar_manifest.json"))
    fail = str(d / "async")
    six = write_config(d / "six.json", model=MODEL, training=dict(train_iters=6),
                       checkpoint=dict(save=fail, load=fail, save_interval=2, async_save=True),
                       logging=dict(metrics_file=str(d / "failed.jsonl")))
    runs = [(name, ["--config", write_config(d / f"{name}.json", model=MODEL, training=dict(train_iters=6),
                                            checkpoint=dict(load=folder, save=folder))])
            for name, folder in (("flip", flip), ("cut", cut), ("gone", gone))]
    runs += [("fail", ["--config", six])]
    out = run_distributed(_two_rank_cases, 2, (d, runs), timeout=900)
    for rank in (0, 1):
        rc, text = out[rank]["flip"]
        assert rc == 2 and f"{flip}/iter_0000004/{OPTIM_1} does not match its sha256 in the manifest" in text, text
        assert "Traceback" not in text
    assert read_latest(flip) == "iter_0000004" and sorted(os.listdir(flip)) == sorted(os.listdir(ck))
    rc, text = out[0]["cut"]
    assert rc == 2 and f"{manifest} is unreadable" in text and "Traceback" not in text, text
    rc, text = out[0]["gone"]
    assert rc == 2 and "iter_0000004 is incomplete (it has no gptpar_manifest.json)" in text, text
    assert "the newest complete checkpoint there is iter_0000002" in text

    for rank in (0, 1):
        rc, text = out[rank]["fail"]
        assert rc == 1 and "could not save checkpoint iter_0000004" in text, text
    assert "cannot allocate pinned host memory (injected)" in out[0]["fail"][1] + out[1]["fail"][1]
    failed = [r for r in read_jsonl(d / "failed.jsonl") if "lm_loss" in r and "elapsed_s" in r]
    stopped = failed[-1]["iteration"]  # once rank 0's files of iteration 4 were written and the ranks agreed
    assert [r["iteration"] for r in failed] == list(range(1, stopped + 1)) and 5 <= stopped <= 6
    assert read_latest(fail) == "iter_0000002" and not [n for n in os.listdir(fail) if n.startswith("iter_0000004")]
    (resumed_out, _) = run_distributed(run_mains, 2, ([("resumed", [
        "--config", six, "--set", f"training.exit_interval={stopped}", "--set",
        f"logging.metrics_file={d / 'resumed.jsonl'}"])],), timeout=600)
    rc, text = resumed_out["resumed"]
    assert rc == 0 and f"resumed from {fail}/iter_0000002" in text, text
    resumed = [r for r in read_jsonl(d / "resumed.jsonl") if "lm_loss" in r and "elapsed_s" in r]
    assert [r["iteration"] for r in resumed] == list(range(3, stopped + 1))
    for r in resumed:
        for key in ("lm_loss", "grad_norm", "lr"):
            assert r[key] == failed[r["iteration"] - 1][key], (r["iteration"], key)


def test_a_flipped_byte_is_refused_at_another_shape_and_from_every_copy(d):
    """One rank (dp 1): a changed optimizer shard refuses the conversion (no copy written); a universal copy
    reused after one of its fp32.pt changed is refused with the way to rebuild it; a changed universal folder,
    checkpoint.init_from and a weights-only checkpoint.load are refused naming the file."""
    ck = d / "ck"
    reshape = _flipped(ck, d / "reshape", f"iter_0000002/{OPTIM_1}")
    reuse = str(d / "reuse")
    shutil.copytree(ck, reuse)
    copy = os.path.join(f"{reuse}_universal", "iter_0000004")
    u = _flipped(d / "u", d / "u_flip", "zero/layers.0.dense.weight/fp32.pt")
    init = _flipped(ck, d / "init", f"iter_0000004/{SHARD}")
    w = _flipped(d / "w", d / "w_flip", SHARD)

    def case(name, **checkpoint):
        config = write_config(d / f"{name}.json", model=MODEL, parallel=dict(data_parallel_size=1),
                              training=dict(train_iters=6), checkpoint=checkpoint)
        return (name, ["--config", config])

    runs = [case("reshape", load=f"{reshape}/iter_0000002"),
            case("reuse_first", load=f"{reuse}/iter_0000004"),  # converts, then trains 5 and 6
            case("reuse_damaged", load=f"{reuse}/iter_0000004"),
            case("universal", load=u), case("init_from", init_from=init), case("weights_only", load=w)]
    out, = run_distributed(_one_rank_cases, 1, (runs, copy), timeout=900)
    rc, text = out["reshape"]
    assert rc == 2 and f"{reshape}/iter_0000002/{OPTIM_1} does not match its sha256" in text, text
    assert not os.path.exists(f"{reshape}_universal/iter_0000002")
    assert out["reuse_first"][0] == 0, out["reuse_first"][1]
    rc, text = out["reuse_damaged"]
    assert rc == 2 and f"{copy}/zero/layers.0.dense.weight/fp32.pt does not match its sha256" in text, text
    assert f"rebuild it: delete {copy}" in text
    for name, path in (("universal", f"{u}/zero/layers.0.dense.weight/fp32.pt"), ("init_from", f"{init}/iter_0000004/{SHARD}"),
                       ("weights_only", f"{w}/{SHARD}")):
        rc, text = out[name]
        assert rc == 2 and f"{path} does not match its sha256" in text and "Traceback" not in text, (name, text)


def _one_rank_cases(runs, copy):
    from gptpar.testing import flip_a_byte_inside_a_tensor as flip

    out = {}
    for name, argv in runs:
        if name == "reuse_damaged":
            flip(os.path.join(copy, "zero", "layers.0.dense.weight", "fp32.pt"))
        out.update(run_mains([(name, argv)]))
    return out


def test_every_tool_refuses_a_flipped_byte_naming_the_file(d, monkeypatch):
    import datasets

    from gptpar.tools import convert_checkpoint
    from gptpar.tools import eval_harness
    from gptpar.tools import generate

    ck = d / "ck"
    bad = _flipped(ck, d / "tools", f"iter_0000004/{SHARD}")
    named = f"{bad}/iter_0000004/{SHARD} does not match its sha256 in the manifest"
    w = _flipped(d / "w", d / "w_tools", SHARD)
    hf = str(d / "hf_flip")
    shutil.copytree(d / "hf", hf)
    with open(os.path.join(hf, "model.safetensors"), "r+b") as f:
        f.seek(os.path.getsize(f.name) - 100)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x5A]))
    generate_ids = ["--prompt-ids", "5,17,42", "--max-new-tokens", "2", "--greedy"]
    for load, name in ((bad, named), (w, f"{w}/{SHARD} does not match"), (hf, f"{hf}/model.safetensors does not match")):
        rc, text = _tool(generate, ["--load", load] + generate_ids)
        assert rc == 2 and name in text and "Traceback" not in text, text
    for to in ("hf", "gptpar", "universal"):
        rc, text = _tool(convert_checkpoint, ["--load", bad, "--to", to, "--output", str(d / f"out_{to}")])
        assert rc == 2 and named in text and "Traceback" not in text, (to, text)
        assert not os.path.exists(d / f"out_{to}") and not [n for n in os.listdir(d) if n.startswith(f"out_{to}.")]
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(d / "datasets"))
    rc, text = _tool(eval_harness, ["--load", bad, "--tokenizer", str(d / "tok"), "--tasks", "demo_python_ppl",
                                    "--include-path", os.path.join(ROOT, "tools", "eval_tasks"), "--limit", "1"])
    assert rc == 2 and named in text and "Traceback" not in text, text

    # asked by name not to verify: read, and said so
    rc, text = _tool(generate, ["--load", bad, "--no-verify"] + generate_ids)
    assert rc == 0 and f"not verifying the checksums of {bad}/iter_0000004 (--no-verify)" in text, text
    # a manifest deleted: gptpar's folder is refused as incomplete, not read unverified
    os.remove(os.path.join(w, "gptpar_manifest.json"))
    rc, text = _tool(generate, ["--load", w] + generate_ids)
    assert rc == 2 and f"{w} was written by gptpar" in text and "has no gptpar_manifest.json" in text, text
    os.remove(os.path.join(hf, "gptpar_manifest.json"))
    rc, text = _tool(generate, ["--load", hf] + generate_ids)
    assert rc == 2 and "its config.json is gptpar's" in text, text


def test_the_exports_carry_manifests_and_read_back_verified(d):
    """Every conversion's folder is complete by its manifest, of its kind, every file's sha256 recorded."""
    import hashlib

    for folder, kind in (("u", "universal"), ("w", "weights-only"), ("hf", "huggingface")):
        manifest = json.load(open(d / folder / "gptpar_manifest.json"))
        assert manifest["kind"] == kind
        on_disk = {os.path.relpath(os.path.join(root, n), d / folder) for root, _, names in os.walk(d / folder)
                   for n in names} - {"gptpar_manifest.json"}
        assert set(manifest["files"]) == on_disk
        for rel, record in manifest["files"].items():
            assert record["sha256"] == hashlib.sha256(open(d / folder / rel, "rb").read()).hexdigest(), rel


def test_tools_name_a_dangling_or_missing_latest_as_resume_does(d):
    """generate.py, eval_harness.py, convert_checkpoint.py and init_from given a save folder whose `latest` names a
    missing or an incomplete folder, or that has no `latest`: the messages a resume gives, naming the newest
    complete checkpoint (one line, exit 2)."""
    from gptpar.tools import convert_checkpoint
    from gptpar.tools import eval_harness
    from gptpar.tools import generate

    from gptpar.checkpoint.init_weights import check_weights_fit
    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.model.config import GPTConfig

    dangling, half, none = str(d / "dangling"), str(d / "half"), str(d / "none")
    for folder in (dangling, half, none):
        shutil.copytree(d / "ck", folder)
    open(os.path.join(dangling, "latest"), "w").write("iter_0000009\n")
    os.remove(os.path.join(half, "iter_0000004", "gptpar_manifest.json"))
    os.remove(os.path.join(none, "latest"))
    expected = {dangling: f"{dangling}/latest points at iter_0000009, but {dangling}/iter_0000009 does not exist: "
                          f"the newest complete checkpoint there is iter_0000004",
                half: f"{half}/latest points at iter_0000004, but {half}/iter_0000004 is incomplete (it has no "
                      "gptpar_manifest.json): the newest complete checkpoint there is iter_0000002",
                none: f"{none} holds checkpoints (iter_0000002, iter_0000004) but no `latest` pointer: point "
                      f"checkpoint.load at {none}/iter_0000004"}
    for folder, message in expected.items():
        for module, argv in ((generate, ["--load", folder, "--prompt-ids", "1,2"]),
                             (convert_checkpoint, ["--load", folder, "--to", "hf", "--output", str(d / "o")]),
                             (eval_harness, ["--load", folder, "--tokenizer", str(d / "tok"), "--tasks", "x"])):
            rc, text = _tool(module, argv)
            lines = [line for line in text.splitlines() if line.strip()]
            assert rc == 2 and len(lines) == 1 and message in lines[0], (folder, module.__name__, text)
        with pytest.raises(CheckpointError, match="the newest complete checkpoint|holds checkpoints"):
            check_weights_fit(folder, GPTConfig(**dict(json.load(open(d / "base.json"))["model"])))
