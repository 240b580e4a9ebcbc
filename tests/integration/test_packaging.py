"""Installing gptpar keeps the torch already there: on a GPU machine that is a CUDA build pip must not replace.
setup.py asks for the range gptpar supports (`torch>=2.11`); the exact CPU pin is the Makefile's. Checked offline
with pip itself: a scratch environment holding stand-in distributions (only their metadata) of torch 2.11.0 and
gptpar's other requirements, and `pip install --dry-run --no-index`, which must plan to install gptpar alone. No
index, no find-links, no pip config: nothing can be downloaded."""
import json
import os
import subprocess
import sys
import sysconfig
import venv

from gptpar.testing.runs import ROOT
from gptpar.training.engine.deepspeed_api import DEEPSPEED_VERSION
from gptpar.testing.deadline import stretched

# What the scratch environment holds, as installed distributions (metadata only): torch at the GPU image's
# version, the rest at any version their unpinned requirement takes (DeepSpeed at its pin).
INSTALLED = {"torch": "2.11.0", "deepspeed": DEEPSPEED_VERSION, "sentencepiece": "0.2.0", "numpy": "2.0.0",
             "tensorboard": "2.18.0", "tqdm": "4.66.0"}
BUILD_TOOLS = ("setuptools", "pkg_resources", "_distutils_hack")  # to read setup.py without build isolation


def _stand_in(site, name, version):
    info = os.path.join(site, f"{name}-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for file, text in (("INSTALLER", "pip\n"), ("RECORD", "")):
        with open(os.path.join(info, file), "w") as f:
            f.write(text)


def _scratch_environment(d):
    """A venv without pip whose site-packages hold the stand-ins, plus this interpreter's setuptools on a .pth
    (a folder of links to it alone: the real torch must stay invisible)."""
    env_dir = d / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = str(env_dir / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    for name, version in INSTALLED.items():
        _stand_in(site, name, version)
    tools, ours = d / "build_tools", sysconfig.get_paths()["purelib"]
    os.makedirs(tools)
    for entry in os.listdir(ours):
        if entry.split("-")[0] in BUILD_TOOLS:
            os.symlink(os.path.join(ours, entry), tools / entry)
    with open(os.path.join(site, "build_tools.pth"), "w") as f:
        f.write(f"{tools}\n")
    return python


def test_pip_keeps_an_installed_torch_2_11(tmp_path):
    python = _scratch_environment(tmp_path)
    project = tmp_path / "gptpar_src"  # setup.py and the package's top module: enough for pip to read it
    os.makedirs(project / "gptpar")
    (project / "gptpar" / "__init__.py").write_text("")
    with open(os.path.join(ROOT, "setup.py")) as f:
        (project / "setup.py").write_text(f.read())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no config file either: no index or find-links from anywhere
    p = subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--dry-run", "--no-index",
                        "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check", "--quiet",
                        "--report", "-", str(project)], capture_output=True, text=True, env=env, timeout=stretched(120))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert [item["metadata"]["name"] for item in report["install"]] == ["gptpar"], report["install"]
