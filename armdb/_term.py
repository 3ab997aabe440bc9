"""Text output for the command line and the benchmark runner: a progress bar on stderr
and aligned plain-text tables.  Shared by ``armdb.cli`` and ``armdb._bench``; the one
module besides them that writes to a terminal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["ProgressBar", "format_table"]


class ProgressBar:
    """A one-line progress bar redrawn in place with ``\\r`` (at most ten times a second).

    Parameters
    ----------
    total : int
        The count that means "finished".
    label : str
        Printed before the bar.
    stream : TextIO, optional
        Where to draw; stderr by default, so that stdout stays clean for results.
    """

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._last_draw = 0.0
        self._last_len = 0

    def update(self, done: int, extra: str = "", *, force: bool = False) -> None:
        """Redraw with ``done`` of ``total`` finished and an optional note."""
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        frac = min(1.0, done / self.total)
        filled = round(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"{self.label} [{bar}] {done}/{self.total} {frac:4.0%}"
        if extra:
            line += f"  {extra}"
        pad = max(0, self._last_len - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self._last_len = len(line)

    def close(self, done: int | None = None, extra: str = "") -> None:
        """Draw the final state and end the line."""
        if done is not None:
            self.update(done, extra, force=True)
        self.stream.write("\n")
        self.stream.flush()


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[bool] | None = None) -> str:
    """Rows as an aligned plain-text table (numbers with thousands separators).

    ``right[i]`` right-aligns column ``i``; by default every column but the first is
    right-aligned.
    """
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in header]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    if right is None:
        right = [i > 0 for i in range(len(header))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in cells]
    return "\n".join(out)


def _cell(v: object) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.2f}"
    return str(v)
