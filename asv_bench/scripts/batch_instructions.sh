#!/bin/sh
# Instructions per job of a batched cycle (push_many → lease_batch → ack_many), counted
# by callgrind in the main thread: (Ir(N batches) - Ir(0)) / (N * size), so the interpreter's start-up and
# the Db's open cancel out.  Queues at the defaults a user gets (Db.open, no config), as
# `python -m armdb bench --only batch` runs them.
#
# Usage: asv_bench/scripts/batch_instructions.sh [var|fixed] [SIZE] [N] [TREE]
set -eu
kind=${1:-var}
size=${2:-64}
n=${3:-100}
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${4:-$here}
py=${PYTHON:-$here/.venv/bin/python}
prog='
import sys, tempfile
import numpy as np
from armdb import Db, _bench as B
kind, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = B.BenchVar if kind == "var" else B.BenchFixed
if kind == "var":
    payloads = [B.body(i) for i in range(size)]
else:
    payloads = np.zeros(size, dtype=spec.dtype)
with tempfile.TemporaryDirectory() as d:
    db = Db.open(d)
    q = db.open_queue(spec)
    for _ in range(3 + n):
        q.push_many(payloads)
        q.ack_many(q.lease_batch(size))
    db.shutdown()
'
ir() {
    # The main thread's count only: the Db's flusher thread wakes on a wall-clock timer,
    # so its share grows with how slowly valgrind runs (the host's load), by several
    # thousand instructions per job (docs/performance.md).
    out=$(mktemp -d)
    # From the temporary folder: \`python -c\` puts the working folder first on sys.path,
    # which would shadow TREE's armdb with the one of the folder the script runs from.
    (cd "$out" && PYTHONPATH=$tree valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg" \
        "$py" -c "$prog" "$kind" "$size" "$1" >/dev/null 2>&1)
    awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01"
    rm -rf "$out"
}
a=$(ir 0)
b=$(ir "$n")
echo "$kind batch of $size, $tree: $(( (b - a) / (n * size) )) instructions per job"
