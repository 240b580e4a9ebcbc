"""docs/config.md is the generator's output, and it documents every key of every section."""
import importlib.util
import os
from dataclasses import fields

from gptpar.config import SECTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", os.path.join(ROOT, "tools", "gen_config_docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_docs_match_generator():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        committed = f.read()
    assert committed == load_generator().render(), "docs/config.md is stale: run python tools/gen_config_docs.py"


def test_every_key_is_documented():
    text = load_generator().render()
    for name, cls in SECTIONS.items():
        assert f"## `{name}`" in text
        for f in fields(cls):
            assert f"| `{f.name}` |" in text, f"{name}.{f.name} missing from docs/config.md"
