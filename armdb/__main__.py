"""``python -m armdb``: the command line (SPEC C1-C3); see :mod:`armdb.cli`."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
