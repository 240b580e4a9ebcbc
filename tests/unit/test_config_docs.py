"""docs/config.md is the generator's output, and it documents every key of every section."""
import os
from dataclasses import fields

from gptpar.config import SECTIONS
from gptpar.tools import gen_config_docs
from gptpar.testing.runs import ROOT


def test_committed_docs_match_generator():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        committed = f.read()
    assert committed == gen_config_docs.render(), "docs/config.md is stale: run python tools/gen_config_docs.py"


def test_every_key_is_documented():
    text = gen_config_docs.render()
    for name, cls in SECTIONS.items():
        assert f"## `{name}`" in text
        for f in fields(cls):
            assert f"| `{f.name}` |" in text, f"{name}.{f.name} missing from docs/config.md"
