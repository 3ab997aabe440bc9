"""The reliability figures table printed at the end of every test run (issue: CI prints it).

Every harness appends one ``RELIABILITY <harness> key=value ...`` line to the file named
by ``$ARMDB_RELIABILITY_REPORT`` (``tests/conftest.py`` points it at a temporary file
when it is unset).  :func:`table` turns the lines of this run into one markdown row per
harness: its size against its CI target (``TARGETS`` below), and the sum of its
violation counters.
"""

from __future__ import annotations

import re

# Counters whose only passing value is 0, wherever a harness reports them.
VIOLATION_KEYS = (
    "violations", "lost", "resurrected", "unexpected", "wrong_payload", "headers_without_body",
    "conservation", "stale_accepted", "lease_overlaps", "overlaps", "attempt_regressions",
    "tx_atomicity", "check_failures", "child_errors", "untyped_exceptions", "fd_leaks",
    "canary_hits", "nonce_repeats", "state_changes",
    # d2-mutation (structure-aware mutation)
    "signals", "hangs", "memory", "file_size", "outside_writes", "check_ok_on_refused", "silent_loss",
    "unwritable", "harness_errors",
    # h-bad-frames (attacks on the server)
    "unwarned",
)

# harness -> (what is measured, [(key, minimum)], the CI target in words, as the table prints it)
TARGETS: dict[str, tuple[str, list[tuple[str, float]], str]] = {
    "killloop": ("kills (min hits per phase)", [("kills", 200), ("min_phase", 20)], ">= 200, every phase >= 20"),
    "failpoints": ("points hit / registered", [("coverage", 100)], "100% of registered points"),
    "powerloss": ("crash states", [("states", 10_000)], ">= 10,000"),
    "faults": ("faults injected", [("faults", 1)], "every k of every workload"),
    "mutation": ("mutated files", [("mutations", 20_000)], ">= 20,000"),
    "d2-mutation": ("crafted files (fields)", [("crafted", 20_000), ("fields", 133)],
                    ">= 20,000, every field of every kind"),
    "e-model": ("examples (steps)", [("examples", 600), ("machines", 3)], "200 examples x 50 steps per machine, 3 machines"),
    "threads": ("jobs (seeds)", [("jobs", 120_000), ("seeds", 3)], "8P x 8C x 40k jobs x 3 seeds"),
    "g-encryption": ("seals (cases)", [("seals", 100_000)], "all cases; 0 hits, 0 repeats in 1e5"),
    "h-bad-input": ("rows", [("rows", 80)], ">= 80 rows"),
    "h-bad-frames": ("frames and attacks on the server", [("rows", 25)], ">= 25 rows, every attack of issue 18"),
    "full-disk": ("children on a full tmpfs", [("runs", 2)], "fixed + var queue and a map, 0 signals"),
    "close-race": ("rounds (in children)", [("rounds", 200)],
                   "200 rounds x 8 threads, 0 signals, only DbClosed"),
}
SECOND = {"close-race": "child_rounds",
          "d2-mutation": "fields", "killloop": "min_phase", "failpoints": "points", "e-model": "steps", "threads": "seeds",
          "g-encryption": "cases"}


def _num(v: str) -> float | None:
    m = re.match(r"^-?\d+(\.\d+)?", v)
    return float(m.group(0)) if m else None


def parse(line: str) -> tuple[str, dict[str, str]]:
    parts = line.split()
    name = re.sub(r"-(nightly|ci)$", "", parts[1])
    fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    return name, fields


def table(lines: list[str]) -> tuple[str, bool]:
    """The markdown table of this run's lines, and whether every row passes."""
    out = ["| harness | measured | size | CI target | violations | ok |", "|---|---|---:|---|---:|---|"]
    all_ok = True
    for line in lines:
        name, f = parse(line)
        what, mins, target = TARGETS.get(name, ("-", [], "-"))
        bad = sum(int(_num(f[k]) or 0) for k in VIOLATION_KEYS if k in f)
        size_ok = all((_num(f.get(k, "")) or 0) >= lo for k, lo in mins)
        first = f.get(mins[0][0], "?") if mins else "-"
        size = first + (f" ({f[SECOND[name]]})" if name in SECOND and SECOND[name] in f else "")
        ok = bad == 0 and size_ok
        all_ok &= ok
        out.append(f"| {name} | {what} | {size} | {target} | {bad} | {'yes' if ok else 'NO'} |")
    return "\n".join(out), all_ok
