"""Cross-references in README.md and docs/*.md: every Markdown link to a file of the repository names one that exists,
and every `#anchor` (in the same page or another) names a heading there, slugged as GitHub slugs headings."""
import os
import re

from gptpar.testing import ROOT

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages(root):
    """README.md and docs/*.md under `root`, relative to it."""
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(root, "docs"))
                                  if f.endswith(".md"))


def prose(path):
    """The page at `path` without its fenced code blocks (a `](` inside code is no link)."""
    with open(path, encoding="utf-8") as f:
        return FENCE.sub("", f.read())


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    """The anchors of the headings of the page at `path`; a repeated heading gets -1, -2, ... as on GitHub."""
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose(path), re.M):
        s = slug(m.group(1))
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(root):
    """'page: target (why)' for every link of `root`'s pages that does not resolve."""
    broken = []
    for doc in pages(root):
        for target in LINK.findall(prose(os.path.join(root, doc))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(os.path.join(root, full)):
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and full.endswith(".md") and anchor not in anchors(os.path.join(root, full)):
                broken.append(f"{doc}: {target} (no heading with that anchor in {full})")
    return broken


def test_every_cross_reference_resolves():
    assert broken_links(ROOT) == []


def test_the_check_sees_a_broken_anchor_and_a_missing_file(tmp_path):
    """The check itself: a link to a heading that is not there and one to a file that is not there are found; a
    link inside a code block is no link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n")
    (tmp_path / "README.md").write_text("# Top\n\n## A section\n\n[ok](#a-section) [gone](#no-such) [f](docs/x.md)\n"
                                        "[there](docs/a.md#its-part) [not](docs/a.md#other)\n"
                                        "```\n[in code](#not-a-link)\n```\n")
    assert sorted(broken_links(str(tmp_path))) == [
        "README.md: #no-such (no heading with that anchor in README.md)",
        "README.md: docs/a.md#other (no heading with that anchor in docs/a.md)",
        "README.md: docs/x.md (no such file)"]
