#!/bin/sh
# Instructions per durable push (the bench row push/durable: armdb._bench.open_armdb(...,
# durable=True), a fixed queue whose header store has sync_interval(0), so every push
# msyncs its page), counted by callgrind in the main thread: (Ir(N + 200) - Ir(200)) / N,
# as cycle_instructions.sh counts a cycle.  The msync is a system call: not counted.
#
# Usage: asv_bench/scripts/durable_push_instructions.sh [N] [TREE]   (run it from a temporary folder)
set -eu
n=${1:-2000}
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${2:-$here}
py=${PYTHON:-$here/.venv/bin/python}
prog='
import sys, tempfile
from armdb import _bench as B

def run(q, n):
    # In a function, as the bench runs it (module-level names would be dict lookups).
    for i in range(n):
        q.push(B._fixed_payload(i))

with tempfile.TemporaryDirectory() as d:
    db, q = B.open_armdb(d, B.BenchFixed, durable=True)
    run(q, int(sys.argv[1]))
    db.shutdown()
'
ir() {
    out=$(mktemp -d)
    (cd "$out" && PYTHONPATH=$tree valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg" \
        "$py" -c "$prog" "$1" >/dev/null 2>&1)
    awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01"
    rm -rf "$out"
}
a=$(ir 200)
b=$(ir $((n + 200)))
echo "durable push, $tree: $(( (b - a) / n )) instructions"
