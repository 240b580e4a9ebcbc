"""DeepSpeed's CPU communication op (gptpar.training.engine.comm_op): built once, whatever path the venv is reached
by; a wait on a build lock is said within seconds, naming the lock.

The op's real build takes minutes on a busy 2-core machine, so these tests drive the mechanism with a stand-in
builder: its "build" copies a small compiled extension of the standard library (the real import path of a JIT-built
library is the same) and its wait is torch's own FileBaton on the folder's lock."""
import importlib.machinery
import os
import shutil
import sys
import threading
import time

import pytest
from torch.utils.file_baton import FileBaton

from gptpar import extensions_dir
from gptpar.training.engine import comm_op

# A compiled standard-library module: the library the stand-in's build "produces" (module name = its init function).
LIB_MODULE = "_bisect"


def compiled_library():
    mod = __import__(LIB_MODULE)
    path = getattr(mod, "__file__", "")
    if not path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        pytest.skip(f"{LIB_MODULE} is built into this Python, not a library file")
    return path


class StandInBuilder:
    """The part of DeepSpeed's OpBuilder that comm_op uses; `load` behaves as torch's JIT load does: wait while
    the folder's lock is held, else take it, "compile" (copy the library) and import it."""

    def __init__(self, src_root, library):
        self.name = self.NAME = LIB_MODULE
        self.src_root, self.library, self.builds = src_root, library, 0

    def sources(self):
        return ["op.cpp"]

    def include_paths(self):
        return ["includes"]

    def cxx_args(self):
        return ["-O2", "-fopenmp"]

    def deepspeed_src_path(self, code_path):
        return os.path.join(self.src_root, code_path)

    def load(self, verbose=False):
        folder = comm_op.build_dir(self.name)
        baton = FileBaton(os.path.join(folder, "lock"))
        if baton.try_acquire():
            try:
                self.builds += 1
                out = comm_op.library_path(folder, self.name)  # a new file, as the linker writes one:
                shutil.copy(self.library, out + ".tmp")         # never over a library a process has loaded
                os.replace(out + ".tmp", out)
            finally:
                baton.release()
        else:
            baton.wait()
        return comm_op.import_library(folder, self.name)


@pytest.fixture
def builder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    src = tmp_path / "deepspeed" / "csrc"
    (src / "includes").mkdir(parents=True)
    (src / "op.cpp").write_text("// the op\n")
    (src / "includes" / "op.h").write_text("// its header\n")
    return StandInBuilder(str(src), compiled_library())


def test_three_starts_build_once(builder):
    """Three starts in a row: the first builds, the next two import the stamped library (no lock, no ninja)."""
    modules = [comm_op.load(builder, {}) for _ in range(3)]
    assert builder.builds == 1
    assert all(m.bisect_left([1, 2, 3], 2) == 1 for m in modules)


def test_a_changed_source_builds_again(builder):
    comm_op.load(builder, {})
    with open(os.path.join(builder.src_root, "includes", "op.h"), "a") as f:
        f.write("// changed\n")
    comm_op.load(builder, {})
    comm_op.load(builder, {})
    assert builder.builds == 2


def test_the_build_key_ignores_the_path_the_venv_is_reached_by(builder, tmp_path):
    """The alternating rebuilds: one venv reached by two paths gave ninja two command lines. The stamp's key is
    taken from real paths and file contents, so both paths find the same library up to date."""
    link = tmp_path / "linked"
    os.symlink(os.path.dirname(builder.src_root), link)
    through_link = StandInBuilder(str(link / "csrc"), builder.library)
    assert through_link.deepspeed_src_path("op.cpp") != builder.deepspeed_src_path("op.cpp")
    assert comm_op.build_key(through_link) == comm_op.build_key(builder)
    comm_op.load(builder, {})
    comm_op.load(through_link, {})
    assert builder.builds + through_link.builds == 1


def test_a_stale_lock_is_named_within_seconds(builder):
    """A lock left by a killed build: the start says so within seconds, naming the lock, that nobody builds and how
    to clear it; removing the lock lets it go on."""
    folder = comm_op.build_dir(builder.name)
    lock = os.path.join(folder, "lock")
    open(lock, "w").close()
    lines, result = [], {}
    start = time.monotonic()
    t = threading.Thread(target=lambda: result.setdefault("m", comm_op.load(builder, {}, first_notice=0.5,
                                                                            say=lines.append)), daemon=True)
    t.start()
    while not lines and time.monotonic() - start < 30:
        time.sleep(0.1)
    waited = time.monotonic() - start
    assert lines, "no line within 30 s while waiting on a stale lock"
    assert waited < 30 and t.is_alive()
    assert lock in lines[0] and "no process on this machine is building there" in lines[0]
    assert f"rm {lock}" in lines[0]
    os.unlink(lock)
    t.join(timeout=30)
    assert not t.is_alive()


def test_a_stale_lock_beside_a_stamped_library_is_named_not_waited_on(builder):
    comm_op.load(builder, {})
    lock = os.path.join(comm_op.build_dir(builder.name), "lock")
    open(lock, "w").close()
    lines = []
    module = comm_op.load(builder, {}, say=lines.append)
    assert module.bisect_left([1, 2], 2) == 1 and builder.builds == 1
    assert len(lines) == 1 and lock in lines[0] and "stale" in lines[0]


def test_the_default_extensions_folder_is_the_venvs(monkeypatch, tmp_path):
    """Unset: TORCH_EXTENSIONS_DIR becomes <venv real path>/torch_extensions; set: kept; outside a venv: unset."""
    venv = tmp_path / "venv"
    venv.mkdir()
    os.symlink(venv, tmp_path / "link")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "link"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    extensions_dir.use_default_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(venv / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    extensions_dir.use_default_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    extensions_dir.use_default_extensions_dir()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_deepspeed_takes_the_op_gptpar_loaded(monkeypatch):
    """DeepSpeed's own `build_shm_op` (at init_distributed) returns what gptpar put in its loaded-ops cache."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    from gptpar.training.engine import deepspeed_api

    if get_accelerator()._name != "cpu":
        pytest.skip("DeepSpeed's CPU accelerator only")
    sentinel = object()
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setattr(comm_op, "load", lambda b, loaded: loaded.__setitem__(b.name, sentinel))
    deepspeed_api.load_comm_op()
    assert get_accelerator().create_op_builder("ShareMemCommBuilder").load() is sentinel
