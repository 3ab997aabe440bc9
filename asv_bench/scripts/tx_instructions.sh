#!/bin/sh
# Instructions per 2-row db.tx() commit (a map put and a fixed-queue push, the workload of
# armdb._bench.armdb_tx_commit: 8 shards each, stores without fsync), counted by callgrind
# in the main thread: (Ir(N) - Ir(0)) / N, as cycle_instructions.sh counts a cycle.
#
# Usage: asv_bench/scripts/tx_instructions.sh [N] [TREE]   (run it from a temporary folder)
#   DUR=1 makes every commit durable (its fdatasync is a system call: not counted).
set -eu
n=${1:-3000}
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${2:-$here}
py=${PYTHON:-$here/.venv/bin/python}
prog='
import os, sys, tempfile
from armdb import _bench as B
from armdb import Db, Config, FixedConfig, QueueConfig

def run(db, m, q, n, durable):
    # In a function, as the bench runs it (module-level names would be dict lookups).
    for i in range(n):
        tx = db.tx().put(m, i, "effect").push(q, B._fixed_payload(i))
        if durable:
            tx.durable()
        tx.commit()

n = int(sys.argv[1])
with tempfile.TemporaryDirectory() as d:
    db = Db.open(d)
    m = db.open_map("effects", Config.balanced().shard_count(8).enable_fsync(False).build())
    header = FixedConfig.balanced().shard_count(8).grow_step(16_384).enable_fsync(False).build()
    q = db.open_queue(B.BenchFixed, QueueConfig.balanced().header_config(header).build())
    run(db, m, q, 20, False)  # warm: the first commit opens the log, draws the first blocks
    run(db, m, q, n, os.environ.get("DUR") == "1")
    db.shutdown()
'
ir() {
    out=$(mktemp -d)
    (cd "$out" && PYTHONPATH=$tree valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg" \
        "$py" -c "$prog" "$1" >/dev/null 2>&1)
    awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01"
    rm -rf "$out"
}
a=$(ir 0)
b=$(ir "$n")
echo "tx 2-row commit, $tree: $(( (b - a) / n )) instructions"
