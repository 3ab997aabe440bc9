#!/bin/sh
# Instructions per queue cycle, counted by callgrind in the main thread: (Ir(N) - Ir(0)) / N, so that the
# interpreter's start-up cancels out.  Wall-clock A/B runs on a shared 2-core host move
# by 30% or more within minutes; this count moves by 1-2k (docs/performance.md).
#
# Usage: asv_bench/scripts/cycle_instructions.sh [var|fixed] [N] [TREE]
#   TREE: the checkout whose armdb to import (default: this one); build it first.
# Needs valgrind.  Queues at the defaults a user gets (Db.open, no config), as the default
# rows of `python -m armdb bench` run them; TUNED=1 runs the tuned rows' configuration,
# DURABLE=1 the durable rows' (armdb._bench.open_armdb(durable=True): every write of the
# header store synced before it returns; its msync, a system call, is not counted).
# OPS=push counts the push alone, OPS=push+lease a push and its lease (the default, the
# whole cycle, adds the ack): the differences are each operation's share.  OPS=none counts
# the script's own share: the loop and making each payload (make(i), as a user makes one).
set -eu
kind=${1:-var}
n=${2:-6000}
here=$(cd "$(dirname "$0")/../.." && pwd)
tree=${3:-$here}
py=${PYTHON:-$here/.venv/bin/python}
prog='
import os, sys, tempfile
from armdb import _bench as B

def run(q, n, make, ops):
    # In a function, as a user (and the bench, armdb._bench.queue_cycle_rate) runs it: at
    # the top level of `python -c`, every name read would be a dict lookup, about 2,000
    # instructions per cycle that are the script, not armdb.  Each payload is made as it
    # is pushed, as the bench does: a list of them made up front made the interpreter
    # run a full garbage collection of the whole heap in the N run only, which added
    # about 5,000 instructions per cycle at N=3000 (and a different amount at any other N).
    if ops == "none":
        for i in range(n):
            make(i)
    elif ops == "push":
        for i in range(n):
            q.push(make(i))
    elif ops == "push+lease":
        for i in range(n):
            q.push(make(i))
            (lease,) = q.lease(1)
    else:
        for i in range(n):
            q.push(make(i))
            (lease,) = q.lease(1)
            q.ack(lease.token)

kind, n = sys.argv[1], int(sys.argv[2])
spec = B.BenchVar if kind == "var" else B.BenchFixed
make = B.body if kind == "var" else B._fixed_payload
with tempfile.TemporaryDirectory() as d:
    db, q = B.open_armdb(d, spec, tuned=os.environ.get("TUNED") == "1", durable=os.environ.get("DURABLE") == "1")
    run(q, n, make, os.environ.get("OPS", "cycle"))
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
        "$py" -c "$prog" "$kind" "$1" >/dev/null 2>&1)
    awk '/^(summary|totals):/ {print $2; exit}' "$out/cg-01"
    rm -rf "$out"
}
a=$(ir 0)
b=$(ir "$n")
echo "$kind ${OPS:-cycle}, $tree: $(( (b - a) / n )) instructions"
