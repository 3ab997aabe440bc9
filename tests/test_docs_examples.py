"""Every ```python block of the user guide runs as it is written.

Each block is executed on its own, as a fresh module, in an empty temporary working
directory (examples use relative paths such as ``data/``).  A block that is only a
fragment (it needs context the page gives in prose) is fenced as
```python-fragment and skipped; shell sessions are ```sh.  Any other fence language
fails the suite, so that a typo cannot silently skip an example.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from .conftest import ROOT

DOCS = ROOT / "docs"
# The user guide pages; reference pages (format.md, performance.md, ...) are tested elsewhere.
GUIDE_PAGES = ["guide.md", "concepts.md", "transactions_guide.md", "encryption.md", "tuning.md", "operations.md"]
RUN = {"python"}
SKIP = {"python-fragment", "sh", "text", ""}

_FENCE = re.compile(r"^```([A-Za-z0-9_-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, int, str, str]]:
    """(page, line of the opening fence, language, code) for every fenced block."""
    out = []
    for page in GUIDE_PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((page, line, m.group(1), m.group(2)))
    return out


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if b[2] in RUN]


def test_docs_fences_known() -> None:
    unknown = [f"{page}:{line} ```{lang}" for page, line, lang, _ in BLOCKS if lang not in RUN | SKIP]
    assert not unknown, f"unknown fence languages (use python, python-fragment or sh): {unknown}"
    for page in GUIDE_PAGES:
        assert any(b[0] == page for b in RUNNABLE), f"{page} has no runnable example"


@pytest.mark.parametrize(
    ("page", "line", "code"),
    [(page, line, code) for page, line, _, code in RUNNABLE],
    ids=[f"{page}:{line}" for page, line, _, _ in RUNNABLE],
)
def test_docs_examples_run(page: str, line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"_docs_example_{page.removesuffix('.md')}_{line}"
    module = types.ModuleType(name)
    module.__file__ = str(DOCS / page)
    # Pad with newlines so that a traceback's line numbers are those of the page.
    compiled = compile("\n" * line + code, str(DOCS / page), "exec")
    sys.modules[name] = module  # dataclasses and typing look the module up by name
    try:
        exec(compiled, module.__dict__)  # noqa: S102 - running the documentation is the point
    finally:
        del sys.modules[name]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub-style anchors of a page's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_docs_links_resolve() -> None:
    """Relative links between the guide pages point at files and headings that exist."""
    broken = []
    for page in GUIDE_PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        text = _FENCE.sub("", text)
        for target in _LINK.findall(text):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            path = (DOCS / page).parent / file if file else DOCS / page
            if not path.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, broken
