"""The rule book ``docs/spec.md`` states every rule id the repository cites.

Docstrings, comments, test names and pages cite rules as ``SPEC Q14``, ``(Q14)``,
``(Q9-Q11)``, ``Q13/Q14``, ``# -- S7: torn tails`` or ``test_q14_...``.  Each such id
must have its paragraph in ``docs/spec.md``, led by the id in bold (``**Q14**``), so a
reader can look it up.  NumPy dtype strings such as ``"S8"`` or ``"<S16"`` are not
rules, and neither are the reliability invariants I1-I10 (docs/reliability.md).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "docs" / "spec.md"
NOT_SCANNED = {BOOK, Path(__file__).resolve()}  # the book itself, and the samples below
SCANNED = ("armdb", "tests", "docs", "asv_bench", "README.md")
SUFFIXES = {".py", ".pyx", ".pxd", ".pyi", ".md", ".ipynb"}
SKIPPED_DIRS = {"__pycache__", ".venv", "build", ".git", ".hypothesis", ".pytest_cache"}

# The families this book states (D, S, Q, T, C) are cited freely in prose, so any id
# of theirs counts, except one that a quote closes at once or that follows a byte-order
# mark: that is a NumPy dtype ("S8", '<S16', "|S4").  "S7's" is a citation.
_LOOSE = re.compile(r"(?<![\w<>|=])([DSQTC][1-9][0-9]?)(?![\w\"]|'(?!s\b))")
# The families not built yet (P processes, G PostgreSQL, R replication) share their
# letters with other names ("P1 + S" in performance.md), so only a plain citation
# counts: after "SPEC" or "rule(s)", or a parenthesis holding nothing but rule ids.
_ID = r"[DSQTCPGR][1-9][0-9]?"
_ID_LIST = rf"{_ID}(?:\s*(?:,|/|-|–|and)\s*{_ID})*"
_AFTER_WORD = re.compile(rf"\b(?:SPEC|[Rr]ules?)\s+({_ID_LIST})")
_PARENS = re.compile(rf"\(\s*({_ID_LIST})\s*\)")
_TEST_NAME = re.compile(r"\btest_([dsqtcpgr][1-9][0-9]?)_")
_RANGE = re.compile(r"\b([DSQTCPGR])([1-9][0-9]?)\s*(?:-|–|—)\s*\1([1-9][0-9]?)\b")
_DEFINED = re.compile(r"^\*\*([DSQTCPGR][1-9][0-9]?)\*\*", re.MULTILINE)


def cited_ids(text: str) -> set[str]:
    """Every rule id ``text`` cites; a range such as ``Q9-Q11`` cites each id in it."""
    ids = set(_LOOSE.findall(text))
    for m in _AFTER_WORD.finditer(text):
        ids.update(re.findall(_ID, m.group(1)))
    for m in _PARENS.finditer(text):
        ids.update(re.findall(_ID, m.group(1)))
    ids.update(name.upper() for name in _TEST_NAME.findall(text))
    for family, lo, hi in _RANGE.findall(text):
        if int(lo) < int(hi):
            ids.update(f"{family}{n}" for n in range(int(lo), int(hi) + 1))
    return ids


def _scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        top = ROOT / name
        if top.is_file():
            files.append(top)
            continue
        for path in sorted(top.rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and path.resolve() not in NOT_SCANNED:
                if not SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts):
                    files.append(path)
    return files


def _text(path: Path) -> str:
    """The text a reader sees; for a notebook its cells, not its outputs (base64 images)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return raw
    cells = json.loads(raw).get("cells", [])
    return "\n".join("".join(cell.get("source", [])) for cell in cells)


def _citations() -> dict[str, list[str]]:
    """Rule id -> the ``file:line`` places that cite it (a notebook's line within its cells)."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in _scanned_files():
        rel = path.relative_to(ROOT)
        for number, line in enumerate(_text(path).splitlines(), 1):
            for rule in cited_ids(line):
                where[rule].append(f"{rel}:{number}")
    return where


def _defined() -> list[str]:
    return _DEFINED.findall(BOOK.read_text(encoding="utf-8"))


def test_every_cited_rule_id_is_stated_in_the_book() -> None:
    where = _citations()
    assert {"D1", "S7", "Q14", "T2", "C1"} <= where.keys(), "the scanner no longer finds rule ids"
    missing = sorted(set(where) - set(_defined()))
    assert not missing, "rule ids cited but not stated in docs/spec.md (add a **ID** paragraph): " + "; ".join(
        f"{rule} at {', '.join(where[rule][:3])}" for rule in missing
    )


def test_each_rule_is_stated_once_and_no_family_has_a_gap() -> None:
    defined = _defined()
    twice = sorted({rule for rule in defined if defined.count(rule) > 1})
    assert not twice, f"stated more than once in docs/spec.md: {twice}"
    numbers: dict[str, set[int]] = defaultdict(set)
    for rule in defined:
        numbers[rule[0]].add(int(rule[1:]))
    assert set("DSQTC") <= numbers.keys()
    gaps = {family: sorted(set(range(1, max(ns) + 1)) - ns) for family, ns in numbers.items()}
    assert not any(gaps.values()), f"missing rules in docs/spec.md: {gaps}"


def test_the_scanner_reads_citations_and_skips_dtypes() -> None:
    assert cited_ids('FIXED = np.dtype([("n", "<u8"), ("tag", "S6")]); x = np.zeros(2, "S8")') == set()
    assert cited_ids("dtype='|S16' or '<S4' or \"S12\"") == set()
    assert cited_ids('"""T4: a commit touching an encrypted collection ..."""') == {"T4"}
    assert cited_ids("def test_q13_token_from_before_reopen_is_stale(tmp_path):") == {"Q13"}
    assert cited_ids("# -- lease (Q9-Q11) ------") == {"Q9", "Q10", "Q11"}
    assert cited_ids("the operations of Q29–Q36") == {f"Q{n}" for n in range(29, 37)}
    assert cited_ids('"""S4/D6: a fixed.data cut short"""') == {"S4", "D6"}
    assert cited_ids("counted as S7's own refusal") == {"S7"}
    assert cited_ids("open refuses it under S7, as SPEC D5 says") == {"S7", "D5"}
    # P, G and R only as plain citations: "P1 + S" is a variable of performance.md.
    assert cited_ids("at most (P1 + S) / P8 = 2.7x") == set()
    assert cited_ids("see SPEC P1 and the worker (P6, G2)") == {"P1", "P6", "G2"}
    assert cited_ids("Requires C standard >= C11") == {"C11"}  # why generated .c files are not read
