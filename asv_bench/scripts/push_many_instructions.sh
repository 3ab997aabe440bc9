#!/bin/sh
# Instructions per job of a var queue's push_many(SIZE) of 100-byte dicts into a growing
# queue (the bench row push_many/var-100B-1000), counted by callgrind in the main thread
# with collection switched on around the push_many calls only (CALLGRIND_TOGGLE_COLLECT
# from a tiny C helper built here, as batch_phase_instructions.sh does).  The Db's
# flusher thread (the 50 ms syncs) is not counted; the system calls' time is not an
# instruction count either: `strace -c -f` of the same loop shows them.
#
# Usage: asv_bench/scripts/push_many_instructions.sh [SIZE] [N] [TREE]
# Needs valgrind, its callgrind.h and a C compiler.  PYTHONHASHSEED=0 (set here).
set -eu
size=${1:-1000}
n=${2:-200}  # the full bench row pushes 200 batches: the body cache (2,000 KiB) evicts from the 24th on
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${3:-$here}
py=${PYTHON:-$here/.venv/bin/python}
out=$(mktemp -d)
printf '#include <valgrind/callgrind.h>\nvoid cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n' > "$out/t.c"
cc -O2 -shared -fPIC -o "$out/libcgt.so" "$out/t.c"
prog='
import ctypes, sys, tempfile
from armdb import Db, _bench as B
size, n, lib = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t = ctypes.CDLL(lib).cg_toggle
payloads = [B.body(i) for i in range(size)]
with tempfile.TemporaryDirectory() as d:
    db = Db.open(d)
    q = db.open_queue(B.BenchVar)
    q.push_many(payloads)  # warm-up, as the bench row
    for _ in range(n):
        t()
        q.push_many(payloads)
        t()
    db.shutdown()
'
# From the temporary folder: `python -c` puts the working folder first on sys.path.
(cd "$out" && PYTHONHASHSEED=0 PYTHONPATH=$tree valgrind --tool=callgrind --collect-atstart=no --separate-threads=yes \
    --callgrind-out-file="$out/cg" "$py" -c "$prog" "$size" "$n" "$out/libcgt.so" >/dev/null 2>&1)
total=$(awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01")
rm -rf "$out"
echo "var push_many($size), $tree: $(( total / (n * size) )) instructions per job"
