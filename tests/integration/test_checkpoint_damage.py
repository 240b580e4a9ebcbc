"""Verify before parsing, and the manifest is the list.

A byte flipped at ten offsets spread over each kind of file (a training checkpoint's model states, a ZeRO shard, a
rank file; a universal copy's fp32.pt; an export's model.safetensors), two of them in the first and two in the last
200 bytes (the pickle, the zip's records, the safetensors header), is refused before the file is parsed: one line
naming the file, exit 2, no traceback, by the tools (in this process) and by a resume on 2 ranks (gptpar's
Checkpointer over a stand-in for DeepSpeed's reads; one real 2-rank job under gptpar.launch, without a restart). A
file the manifest does not list is never read, and the tools at tp 2 read each weight file only on the ranks that
need it. One tiny 2-rank checkpoint is trained per module and copied per case."""
import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from gptpar.testing import flip_byte_at, run_distributed, spread_offsets
from gptpar.testing.runs import ROOT, environ_kept, rank_env, run_mains, write_config

MODEL = dict(vocab_size=300)  # room for the byte-level tokenizer of the export
TAG = "iter_0000002"
STATES = "mp_rank_00_model_states.pt"
SHARD_1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK_0, RANK_1 = "gptpar_rank_00000.pt", "gptpar_rank_00001.pt"
FP32 = "zero/layers.0.dense.weight/fp32.pt"
GENERATE = ["--prompt-ids", "5,17,42", "--max-new-tokens", "3", "--greedy", "--print-ids"]


def _tool(module, argv):
    """(exit code, stdout + stderr) of a tool's main called here."""
    buf = io.StringIO()
    with environ_kept(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = module.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, buf.getvalue()


def _one_refusal(rc, text, path):
    """Exit 2, and what was printed is one line naming `path`, no traceback."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in text, text
    assert len(lines) == 1 and path in lines[0], text


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A 2-rank run (dp 2, ZeRO-1) saving iteration 2; its universal copy, its Hugging Face export (with a
    tokenizer) and a weights-only copy laid out at tp 2."""
    from gptpar.testing.tiny_tokenizer import train_hf_tokenizer
    from gptpar.tools import convert_checkpoint

    d = tmp_path_factory.mktemp("damage")
    base = write_config(d / "base.json", model=MODEL, training=dict(train_iters=2, lr_warmup_iters=1),
                        checkpoint=dict(save=str(d / "ck"), save_interval=2))
    out, _ = run_distributed(run_mains, 2, ([("base", ["--config", base])],), timeout=600)
    assert out["base"][0] == 0, out["base"][1]
    train_hf_tokenizer(d / "tok", vocab_size=MODEL["vocab_size"])
    for name, extra in (("u", ["--to", "universal"]), ("hf", ["--to", "hf", "--tokenizer", str(d / "tok")]),
                        ("w2", ["--to", "gptpar", "--tp", "2"])):
        rc, text = _tool(convert_checkpoint, ["--load", str(d / "ck")] + extra + ["--output", str(d / name)])
        assert rc == 0, text
    return d


# (kind, the folder it is in, its path there)
KINDS = (("states", "ck", f"{TAG}/{STATES}"), ("shard", "ck", f"{TAG}/{SHARD_1}"), ("rank", "ck", f"{TAG}/{RANK_0}"),
         ("rank1", "ck", f"{TAG}/{RANK_1}"), ("fp32", "u", FP32), ("safetensors", "hf", "model.safetensors"))


def _flipped_copies(d, kind):
    """[(offset, copied folder, damaged file)] for each of the spread offsets of file kind `kind`."""
    _, source, rel = next(k for k in KINDS if k[0] == kind)
    copies = []
    for offset in spread_offsets(os.path.getsize(d / source / rel)):
        folder = d / f"{kind}_{offset}"
        if not folder.exists():
            shutil.copytree(d / source, folder)
            flip_byte_at(str(folder / rel), offset)
        copies.append((offset, str(folder), str(folder / rel)))
    return copies


def test_a_flipped_byte_anywhere_is_one_refusal_of_every_tool_before_parsing(d, monkeypatch):
    """Ten offsets per file kind: generate.py reads the model states, a universal fp32.pt and an export's
    safetensors; convert_checkpoint.py --to universal the states, the ZeRO shards and rank 0's file; every one
    refuses in one line naming the damaged file. The other tools at the first and last offsets of the states."""
    import datasets

    from gptpar.tools import convert_checkpoint, eval_harness, generate

    for kind, readers in (("states", ("generate", "universal")), ("shard", ("universal",)), ("rank", ("universal",)),
                          ("fp32", ("generate",)), ("safetensors", ("generate",))):
        for offset, folder, path in _flipped_copies(d, kind):
            for reader in readers:
                if reader == "generate":
                    rc, text = _tool(generate, ["--load", folder] + GENERATE)
                else:
                    out = d / f"out_{kind}_{offset}"
                    rc, text = _tool(convert_checkpoint, ["--load", folder, "--to", "universal", "--output", str(out)])
                    assert not out.exists()
                _one_refusal(rc, text, path)
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(d / "datasets"))
    edges = _flipped_copies(d, "states")
    for offset, folder, path in (edges[0], edges[-1]):
        for to in ("hf", "gptpar"):
            rc, text = _tool(convert_checkpoint, ["--load", folder, "--to", to, "--output", str(d / f"o_{to}")])
            _one_refusal(rc, text, path)
            assert not (d / f"o_{to}").exists()
        rc, text = _tool(eval_harness, ["--load", folder, "--tokenizer", str(d / "tok"), "--tasks", "demo_python_ppl",
                                        "--include-path", os.path.join(ROOT, "tools", "eval_tasks"), "--limit", "1"])
        assert rc == 2 and path in text and "Traceback" not in text, text
    for offset, folder, path in _flipped_copies(d, "safetensors")[::9]:
        rc, text = _tool(convert_checkpoint, ["--from-hf", folder, "--to", "gptpar", "--output", str(d / "o_w")])
        _one_refusal(rc, text, path)


class _DeepSpeedReads:
    """Stands in for DeepSpeed's engine at pp 1, ZeRO-1: `load_checkpoint` reads the model states and every dp
    rank's ZeRO shard of the folder through the engine's checkpoint engine, as DeepSpeed's does (each rank loads
    every shard of its model-parallel rank); `set_full_state` takes a universal copy's tensors."""

    def __init__(self, writer, model=None):
        self.writer, self.model = writer, model

    def load_checkpoint(self, directory, tag):
        folder = os.path.join(directory, tag)
        for name in sorted(os.listdir(folder)):
            if name.endswith(("model_states.pt", "optim_states.pt")):
                self.writer.load(os.path.join(folder, name), map_location="cpu")
        return folder, {}

    def named_parameters(self):
        return self.model.named_parameters()

    def set_full_state(self, param, fp32, states, step):
        pass


def _resumes(cases, intact):
    """On each of 2 gloo ranks: gptpar's Checkpointer.load of each (name, folder, universal) case; {name: the
    CheckpointError's message, or "resumed"}. `intact`: the undamaged checkpoint (the run's shape)."""
    import torch
    import torch.distributed as dist

    from gptpar.checkpoint.checkpointer import Checkpointer
    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.checkpoint.layout import LoadTarget
    from gptpar.checkpoint.writer import CheckpointWriter
    from gptpar.model.config import GPTConfig
    from gptpar.model.gpt import GPTModel

    rank = dist.get_rank()
    saved_shape = torch.load(os.path.join(intact, TAG, RANK_0), weights_only=False)["shape"]
    out = {}
    for name, folder, is_universal in cases:
        writer = CheckpointWriter(async_save=False, checksums=True)
        if is_universal:
            meta = json.load(open(os.path.join(folder, "gptpar_universal.json")))
            target = LoadTarget(os.path.dirname(folder), os.path.basename(folder), universal=folder)
            engine, shape = _DeepSpeedReads(writer, GPTModel(GPTConfig(**meta["model"]))), {}
        else:
            target = LoadTarget(folder, TAG)
            engine, shape = _DeepSpeedReads(writer), saved_shape
        checkpointer = Checkpointer(None, target, None, rank, 2, shape, "{}", log=lambda *a, **k: None,
                                    writer=writer, group=dist.group.WORLD)
        try:
            checkpointer.load(engine, None)
            out[name] = "resumed"
        except CheckpointError as e:
            out[name] = str(e)
    return out


def test_a_flipped_byte_anywhere_ends_a_resume_on_both_ranks_naming_the_file(d):
    """2 ranks, ten offsets of the model states, rank 1's ZeRO shard and rank files, and of a universal copy's
    fp32.pt: both ranks refuse with the same line naming the file, before either parses it (rank 0 loads rank
    1's shard and the reverse); the intact checkpoint and copy resume."""
    cases = [("intact", str(d / "ck"), False), ("intact_universal", str(d / "u"), True)]
    expected = {}
    for kind in ("states", "shard", "rank", "rank1", "fp32"):
        for offset, folder, path in _flipped_copies(d, kind):
            cases.append((f"{kind}_{offset}", folder, kind == "fp32"))
            expected[f"{kind}_{offset}"] = path
    out = run_distributed(_resumes, 2, (cases, str(d / "ck")), timeout=600)
    for rank in (0, 1):
        assert out[rank]["intact"] == out[rank]["intact_universal"] == "resumed", out[rank]
        for name, path in expected.items():
            text = out[rank][name]
            assert path in text and "\n" not in text and text == out[1 - rank][name], (rank, name, text)
            assert "does not match its sha256" in text or "is not a whole torch file" in text, (rank, name, text)


def test_a_damaged_rank_1_shard_ends_a_launched_job_with_exit_2_and_no_restart(d):
    """The real resume under gptpar.launch --max-restarts 1: rank 1's ZeRO shard flipped inside its pickle (the
    first bytes of its data.pkl record, a class name it imports): exit 2, the refusal naming the file, no restart,
    no traceback (before, the unpickler's error ended the ranks with exit 1, which --max-restarts retried)."""
    import zipfile

    folder = str(d / "launch_ck")
    path = os.path.join(folder, TAG, SHARD_1)
    if not os.path.exists(folder):
        shutil.copytree(d / "ck", folder)
        with zipfile.ZipFile(path) as z:
            record = next(info for info in z.infolist() if info.filename.endswith("data.pkl"))
        with open(path, "rb") as f:
            f.seek(record.header_offset + 26)
            name_length, extra_length = struct.unpack("<HH", f.read(4))
        flip_byte_at(path, record.header_offset + 30 + name_length + extra_length + 60)  # a class name it imports
    config = write_config(d / "launch.json", model=MODEL, training=dict(train_iters=4, lr_warmup_iters=1),
                          checkpoint=dict(load=folder, save=folder))
    p = subprocess.run([sys.executable, "-m", "gptpar.launch", "--nproc_per_node", "2", "--max-restarts", "1",
                        "pretrain_gpt.py", "--config", config], cwd=ROOT, env=rank_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)
    assert p.returncode == 2, p.stdout
    refusals = [line for line in p.stdout.splitlines() if line.startswith("pretrain_gpt.py: ")]
    assert refusals and all(f"{path} does not match its sha256" in line for line in refusals), p.stdout
    assert "Traceback" not in p.stdout and "restarting" not in p.stdout and "ChildFailedError" not in p.stdout


def _tp2_generate(cases):
    """On each of 2 gloo ranks: generate.py --tp 2 for each (name, argv); {name: (exit code, output, the weight
    files this rank hashed and loaded, in order)}."""
    import torch

    from gptpar.checkpoint import manifest
    from gptpar.tools import generate

    out = {}
    real_digest, real_load = manifest.file_digest, torch.load
    for name, argv in cases:
        read = []

        def digest(path):
            read.append(("hashed", os.path.basename(path)))
            return real_digest(path)

        def load(path, *a, **k):
            read.append(("loaded", os.path.basename(path)))
            return real_load(path, *a, **k)

        manifest.file_digest, torch.load = digest, load
        try:
            rc, text = _tool(generate, argv + ["--tp", "2"])
        finally:
            manifest.file_digest, torch.load = real_digest, real_load
        out[name] = (rc, text, [r for r in read if r[1].endswith("model_states.pt")])
    return out


def test_generate_at_tp_2_reads_each_file_once_on_the_ranks_that_need_it(d):
    """A checkpoint laid out at tp 2: rank r hashes and loads mp_rank_0r only, once, and prints the ids tp 1 does
    (which reads both); at tp 1 layout both ranks need the one file. rank 1's file flipped in its header: rank 1
    refuses it and rank 0, which never reads it, ends with the same line."""
    from gptpar.tools import generate

    w2 = str(d / "w2")
    rc, reference = _tool(generate, ["--load", w2] + GENERATE)
    assert rc == 0, reference
    ids = [line for line in reference.splitlines() if line.startswith("ids: ")]
    bad = str(d / "w2_flip")
    if not os.path.exists(bad):
        shutil.copytree(w2, bad)
        flip_byte_at(os.path.join(bad, "mp_rank_01_model_states.pt"), 100)
    out = run_distributed(_tp2_generate, 2, ([("w2", ["--load", w2] + GENERATE),
                                              ("ck", ["--load", str(d / "ck")] + GENERATE),
                                              ("flip", ["--load", bad] + GENERATE)],), timeout=600)
    for rank in (0, 1):
        rc, text, read = out[rank]["w2"]
        assert rc == 0, text
        mine = f"mp_rank_0{rank}_model_states.pt"
        assert read == [("hashed", mine), ("loaded", mine)], (rank, read)
        rc, text, read = out[rank]["ck"]
        assert rc == 0 and read == [("hashed", STATES), ("loaded", STATES)], (rank, read, text)
        rc, text, _ = out[rank]["flip"]
        _one_refusal(rc, text, f"{bad}/mp_rank_01_model_states.pt")
    assert [line for line in out[0]["w2"][1].splitlines() if line.startswith("ids: ")] == ids
    assert [line for line in out[0]["ck"][1].splitlines() if line.startswith("ids: ")] == ids


def _unlisted(d, source, rel, name):
    """A copy of `source` with `rel` removed from its manifest and a byte of it flipped inside a tensor."""
    folder = d / name
    if not folder.exists():
        shutil.copytree(d / source, folder)
        manifest = folder / rel.split("/")[0] / "gptpar_manifest.json" if rel.startswith("iter_") else \
            folder / "gptpar_manifest.json"
        data = json.load(open(manifest))
        del data["files"][os.path.relpath(folder / rel, manifest.parent)]
        json.dump(data, open(manifest, "w"))
        flip_byte_at(str(folder / rel), os.path.getsize(folder / rel) // 2)
    return str(folder), str(folder / rel)


def test_a_file_the_manifest_does_not_list_is_refused_by_name_and_never_read(d, monkeypatch):
    """Model states removed from the manifest and flipped: refused as "not listed in the manifest" (not missing)
    by a resume's preflight and by every tool; an export's model.safetensors likewise by generate.py; a file
    nobody needs beside them is named in one line; an empty manifest and one of an unknown version are refused
    saying so."""
    import datasets

    from gptpar.checkpoint.exceptions import CheckpointError
    from gptpar.checkpoint.layout import LoadTarget
    from gptpar.checkpoint.manifest import open_folder
    from gptpar.checkpoint.resume import open_checkpoint
    from gptpar.tools import convert_checkpoint, eval_harness, generate

    folder, path = _unlisted(d, "ck", f"{TAG}/{STATES}", "unlisted")
    said = f"{path} is not listed in the manifest"
    with pytest.raises(CheckpointError, match="not listed in the manifest") as e:
        open_checkpoint(LoadTarget(folder, TAG), 2, print)
    assert path in str(e.value) and "missing" not in str(e.value)
    rc, text = _tool(generate, ["--load", folder] + GENERATE)
    _one_refusal(rc, text, said)
    for to in ("hf", "gptpar", "universal"):
        rc, text = _tool(convert_checkpoint, ["--load", folder, "--to", to, "--output", str(d / f"u_{to}")])
        assert rc == 2 and said in text and "Traceback" not in text, (to, text)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(d / "datasets"))
    rc, text = _tool(eval_harness, ["--load", folder, "--tokenizer", str(d / "tok"), "--tasks", "demo_python_ppl",
                                    "--include-path", os.path.join(ROOT, "tools", "eval_tasks"), "--limit", "1"])
    assert rc == 2 and said in text and "Traceback" not in text, text
    hf, weights = _unlisted(d, "hf", "model.safetensors", "unlisted_hf")
    rc, text = _tool(generate, ["--load", hf] + GENERATE)
    _one_refusal(rc, text, f"{weights} is not listed in the manifest")

    extra = d / "extra"
    shutil.copytree(d / "ck" / TAG, extra)
    (extra / "notes.txt").write_text("not part of the checkpoint")
    lines = []
    open_folder(str(extra), "fix", lines.append)
    assert lines == [f"{extra} holds 1 file(s) its manifest does not list (gptpar reads only listed files): "
                     "notes.txt"]
    manifest = extra / "gptpar_manifest.json"
    data = json.load(open(manifest))
    for change, message in (({"files": {}}, "lists no files"),
                            ({"version": 99}, "is of manifest version 99; this gptpar reads versions 2, 3")):
        json.dump(dict(data, **change), open(manifest, "w"))
        with pytest.raises(CheckpointError, match=message):
            open_folder(str(extra), "fix", lines.append)
        assert "checksums=false" not in " ".join(lines[1:])


def test_an_export_is_refused_unless_it_loads_back(d, monkeypatch):
    """--to hf with a tokenizer of more ids than the model has rows: one line, exit 2, before the weights are
    read, nothing written; an export whose files transformers reads back as another model (its config changed
    after saving) is refused and not published."""
    import transformers

    from gptpar.testing.tiny_tokenizer import train_hf_tokenizer
    from gptpar.tools import convert_checkpoint

    big = d / "tok_big"
    if not big.exists():
        train_hf_tokenizer(big, vocab_size=500)
    out = d / "hf_big"
    rc, text = _tool(convert_checkpoint, ["--load", str(d / "ck"), "--to", "hf", "--tokenizer", str(big),
                                          "--output", str(out)])
    _one_refusal(rc, text, f"--tokenizer {big}: the tokenizer has 500 tokens but the model's model.vocab_size "
                           "is 300")
    assert not out.exists()

    real = transformers.PreTrainedModel.save_pretrained

    def save_then_change(self, folder, *args, **kwargs):
        real(self, folder, *args, **kwargs)
        config = json.load(open(os.path.join(folder, "config.json")))
        json.dump(dict(config, layer_norm_epsilon=0.5), open(os.path.join(folder, "config.json"), "w"))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save_then_change)
    out = d / "hf_changed"
    rc, text = _tool(convert_checkpoint, ["--load", str(d / "ck"), "--to", "hf", "--output", str(out)])
    assert rc == 2 and f"the export to {out} does not load back with transformers: its forward pass differs" in text
    assert not out.exists() and not [n for n in os.listdir(d) if n.startswith("hf_changed.")], text
