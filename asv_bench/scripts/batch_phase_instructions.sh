#!/bin/sh
# Instructions per job of ONE call of the batched var cycle (push_many → lease_batch →
# ack_many), counted by callgrind in the main thread with collection switched on around
# that call only (CALLGRIND_TOGGLE_COLLECT from a tiny C helper built here), so each
# call's share is measured directly, not as a difference of runs whose queues differ
# (a push-only run grows the queue and the cyclic GC's work with it).  The ack's share
# includes freeing the batch the lease handed out.  PHASE=all counts the three.
#
# Usage: asv_bench/scripts/batch_phase_instructions.sh push|lease|ack|all [SIZE] [N] [TREE]
# Needs valgrind, its callgrind.h and a C compiler.  PYTHONHASHSEED=0 (set here): the
# hash seed alone moves a run by a few hundred instructions a job.
set -eu
phase=${1:-ack}
size=${2:-64}
n=${3:-60}
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${4:-$here}
py=${PYTHON:-$here/.venv/bin/python}
out=$(mktemp -d)
printf '#include <valgrind/callgrind.h>\nvoid cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n' > "$out/t.c"
cc -O2 -shared -fPIC -o "$out/libcgt.so" "$out/t.c"
prog='
import ctypes, sys, tempfile
from armdb import Db, _bench as B
phase, size, n, lib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t = ctypes.CDLL(lib).cg_toggle

def run(q, payloads, n, phase, t):
    for _ in range(n):
        if phase in ("push", "all"): t()
        q.push_many(payloads)
        if phase == "push": t()
        if phase == "lease": t()
        b = q.lease_batch(size)
        if phase == "lease": t()
        if phase == "ack": t()
        q.ack_many(b)
        del b
        if phase in ("ack", "all"): t()

payloads = [B.body(i) for i in range(size)]
with tempfile.TemporaryDirectory() as d:
    db = Db.open(d)
    q = db.open_queue(B.BenchVar)
    run(q, payloads, 3, "none", t)
    run(q, payloads, n, phase, t)
    db.shutdown()
'
# From the temporary folder: `python -c` puts the working folder first on sys.path.
(cd "$out" && PYTHONHASHSEED=0 PYTHONPATH=$tree valgrind --tool=callgrind --collect-atstart=no --separate-threads=yes \
    --callgrind-out-file="$out/cg" "$py" -c "$prog" "$phase" "$size" "$n" "$out/libcgt.so" >/dev/null 2>&1)
total=$(awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01")
rm -rf "$out"
echo "var batch of $size, $phase, $tree: $(( total / (n * size) )) instructions per job"
