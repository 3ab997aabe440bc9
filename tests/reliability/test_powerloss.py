"""Harness (b): simulated power loss that drops, tears and reorders unsynced writes
(docs/reliability.md, (b)).

Each workload runs once, in process, on :class:`~tests.reliability.faultfs.RecordingFS`;
its acknowledgements (``begin``/``done`` of every operation) go into the same trace
as the I/O.  :class:`~tests.reliability.faultfs.CrashModel` then cuts the trace at
every persistence point and event boundary (every record, for the B3 set) and
builds crash images with the variants ``drop_all``, ``keep_all``, ``zero_extend``,
``prefix``, ``subset`` and ``reorder``.  Every distinct image is materialised,
reopened with the real file system and checked:

* opening raises nothing (an ``armdb.errors`` class counts as an unrecoverable crash
  state, anything else as an untyped exception: both are violations);
* durable worlds (SPEC S5/S9 ``sync_interval=0``, T3 ``.durable()``): the state equals
  the state after every operation that had returned, optionally plus the one in
  flight (I1, I2, I8);
* other worlds (I10): every row and map entry equals its value after some operation
  between the last completed close (the last point where everything was synced) and
  the crash; an item every such state holds is present (no hole in what was synced);
  nothing is resurrected from before that point.  A state whose items are each
  plausible but that equals no prefix of the history is counted as ``not_prefix``
  and reported, not failed: SPEC T3 makes non-durable commits atomic only against a
  process crash;
* always: no header without its body (I4, Q15), no phantom or wrong payload (I3),
  ``armdb.check`` clean after the reopen (I9);
* open never refuses a state: since synced marks and synced-before flags (SPEC S7,
  since turn 2), a bad record with valid ones after it that reordered page write-back
  left in an unsynced tail is cut by open itself.  A refusal whose message says the
  mark or a flag proves damage is counted as ``refused_s7``; as this harness injects
  no damage (every variant is a power cut), each one is also a violation, and so is
  any other ``CorruptionError`` at open.

Every bug the generator found also has a deterministic regression test at the end
of this module (``test_s4_*``, ``test_d5_*``, ``test_t2_*``, ``test_s8_*``,
``test_q15_*``, ``test_d3_*``), built by hand from the crash state that exposed it.

Sizes: ``ARMDB_CRASH_STATES`` (CI default 10,000) distinct crash states are shared by
the scripted, random and strict-directory tests; the B3 tests are exhaustive on their
own (about 13,000 more states).  The ``slow`` test runs ``ARMDB_CRASH_STATES_NIGHTLY``
(default 200,000), the B3 set on five worlds with seven operations included.  The
scratch directories live on a RAM file system when there is one (``$ARMDB_SCRATCH``,
else ``/dev/shm``): every reopen fsyncs, which costs milliseconds on a disk.  One
summary line ``RELIABILITY powerloss ...`` is printed and appended to
``$ARMDB_RELIABILITY_REPORT``.  Failing images are kept under
``$TMPDIR/armdb-fail-powerloss-*`` with a ``NOTES`` file naming the cut, the variant,
the damage and the allowed states.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import armdb
from armdb import _fs, bitcask
from armdb.errors import ArmdbError, CorruptionError

from .bcd_workloads import Session, World, describe_state, fast_tmpdir, judge, quiesce
from .faultfs import CrashModel, Image, RecordingFS, cut_points
from .journal import quiet_armdb_log, report_line

ROOT = Path(__file__).resolve().parents[2]
# What S7 refuses in the Bitcask data files and the log as proven damage: a bad record
# below the synced mark, or followed by a record flagged synced-before.  A power cut
# cannot leave either, so each one here is a violation too; any other CorruptionError
# at open is a violation in every world (a bare "refused" once hid a hole that the log
# replay left below a FixedStore mark).
_S7_REFUSAL = re.compile(r"which a completed sync covered|appended after a sync had covered it")
CI_STATES = int(os.environ.get("ARMDB_CRASH_STATES", "10000"))
NIGHTLY_STATES = int(os.environ.get("ARMDB_CRASH_STATES_NIGHTLY", "200000"))  # the slow test
KEEP_FAILURES = 24  # failing images kept per session (the first ones)
_SAVED = [0]


# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------


@dataclass
class Recording:
    name: str
    world: World
    ops: list[str]
    rec: RecordingFS
    states: list[Any]  # states[j]: after j operations returned (states[0]: before any)
    ev_done: list[int] = field(default_factory=list)  # trace index just after each "done"
    problems: list[str] = field(default_factory=list)


def record(name: str, world: World, ops: list[str], root: str, *, close: bool = False) -> Recording:
    """Run ``open`` + ``ops`` (+ ``close``) on a RecordingFS rooted at ``root``.

    ``root/db`` may already hold a database (the B3 base); it is part of the base
    image, all durable.
    """
    os.makedirs(os.path.join(root, "db"), exist_ok=True)
    rec = RecordingFS(root)
    sess = Session(world, os.path.join(root, "db"))
    states: list[Any] = []
    all_ops = ["open", *ops] + (["close"] if close else [])
    with _fs.use(rec):
        for i, op in enumerate(all_ops):
            rec.mark("begin", i)
            if op == "open":
                sess.open()
            elif op == "close":
                sess.close()
            else:
                sess.run(op)
            if op != "close":
                st = sess.capture()
            rec.mark("done", i)
            if not states:
                states.append(st)  # before the first open: the same (empty or base) state
            states.append(st)
            if op in ("reopen", "close"):
                rec.mark("barrier", i)
        rec.recording = False
        if sess.db is not None:
            problems = rec.verify_shadow()
            sess.close()
        else:
            problems = rec.verify_shadow()
    r = Recording(name, world, all_ops, rec, states, problems=problems)
    return r


def allowed_at(r: Recording, k: int) -> tuple[int, int]:
    """The range ``[lo, hi]`` of state indexes a crash after ``k`` trace records may show."""
    done = 0
    inflight = False
    barrier_done = 0
    for rec in r.rec.trace[:k]:
        if rec[0] != "ev":
            continue
        if rec[1] == "begin":
            inflight = True
        elif rec[1] == "done":
            done += 1
            inflight = False
        elif rec[1] == "barrier":
            barrier_done = done
    hi = done + (1 if inflight else 0)
    lo = done if r.world.durable else barrier_done
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Verification of one crash image
# ---------------------------------------------------------------------------------------------


@dataclass
class Tally:
    states: int = 0
    generated: int = 0
    violations: Counter = field(default_factory=Counter)
    untyped: int = 0
    examples: list[str] = field(default_factory=list)
    by_variant: Counter = field(default_factory=Counter)
    signatures: Counter = field(default_factory=Counter)
    not_prefix: int = 0
    refused_s7: int = 0  # refusals where the synced mark or a flag proved damage (violations too)
    sig_example: dict = field(default_factory=dict)
    sig_variants: dict = field(default_factory=dict)
    saved: int = 0

    def merge(self, o: Tally) -> None:
        self.states += o.states
        self.generated += o.generated
        self.violations.update(o.violations)
        self.untyped += o.untyped
        self.not_prefix += o.not_prefix
        self.refused_s7 += o.refused_s7
        self.examples += o.examples
        self.by_variant.update(o.by_variant)
        self.signatures.update(o.signatures)
        for k, v in o.sig_example.items():
            self.sig_example.setdefault(k, v)
        for k, c in o.sig_variants.items():
            self.sig_variants.setdefault(k, Counter()).update(c)

    @property
    def total_violations(self) -> int:
        return sum(self.violations.values())


class Verifier:
    def __init__(self, r: Recording, scratch: str, tally: Tally) -> None:
        self.r = r
        self.scratch = scratch
        self.tally = tally
        self.cache: dict[tuple[bytes, int, int], tuple[str, str]] = {}
        self.n = 0

    def verify(self, img: Image, lo: int, hi: int) -> None:
        self.tally.generated += 1
        key = (img.digest(), lo, hi)
        if key in self.cache:
            return
        self.n += 1
        d = os.path.join(self.scratch, f"s{self.n}")
        shutil.rmtree(d, ignore_errors=True)  # never merge into another image's files
        img.materialize(d)
        try:
            outcome = self._reopen(os.path.join(d, "db"), lo, hi)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        self.cache[key] = outcome
        self._judge(img, outcome, lo, hi)

    def _judge(self, img: Image, outcome: tuple[str, str], lo: int, hi: int) -> None:
        self.tally.states += 1
        self.tally.by_variant[img.variant] += 1
        if outcome[0] == "refused_s7":
            # SPEC S7: open refuses a bad record that the synced mark or a synced-before
            # flag proves was synced.  No variant here damages synced bytes, so such a
            # proof is wrong: counted, and failed like any other refusal.
            self.tally.refused_s7 += 1
        if outcome[0] != "ok":
            self.tally.violations[outcome[0]] += 1
            if outcome[0] == "untyped_exception":
                self.tally.untyped += 1
            msg = (
                f"[{self.r.name}] cut {img.cut}/{len(self.r.rec.trace)} variant {img.variant}: "
                f"{outcome[0]}: {outcome[1]} | allowed states {lo}..{hi} | ops {self.r.ops} | "
                f"damage {img.notes[:4]}"
            )
            if len(self.tally.examples) < 40:
                self.tally.examples.append(msg)
            sig = signature(outcome)
            self.tally.signatures[sig] += 1
            self.tally.sig_example.setdefault(sig, msg)
            self.tally.sig_variants.setdefault(sig, Counter())[img.variant] += 1
            if _SAVED[0] < KEEP_FAILURES:
                _SAVED[0] += 1
                keep = tempfile.mkdtemp(prefix=f"armdb-fail-powerloss-{self.r.name}-")
                img.materialize(os.path.join(keep, "image"))
                with open(os.path.join(keep, "NOTES"), "w") as f:
                    f.write(msg + "\n")
                    f.writelines(
                        f"allowed state {j}: {describe_state(self.r.states[j])}\n" for j in range(lo, hi + 1)
                    )

    def _reopen(self, path: str, lo: int, hi: int) -> tuple[str, str]:
        world = self.r.world
        sess = Session(world, path)
        try:
            sess.open()
        except CorruptionError as e:
            if _S7_REFUSAL.search(str(e)):
                return "refused_s7", f"{type(e).__name__}: {e}"
            return "open_raised", f"{type(e).__name__}: {e}"
        except ArmdbError as e:
            return "open_raised", f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - exactly what the harness looks for
            return "untyped_exception", f"open: {type(e).__name__}: {e}"
        try:
            try:
                got = sess.capture()
            except ArmdbError as e:
                return "read_raised", f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001
                return "untyped_exception", f"read: {type(e).__name__}: {e}"
        finally:
            try:
                sess.close()
            except Exception as e:  # noqa: BLE001
                return "close_raised", f"{type(e).__name__}: {e}"
        cls, detail = judge(got, self.r.states, lo, hi, exact=self.r.world.durable)
        if cls != "ok":
            return cls, f"{detail}; got {describe_state(got)}"
        if got not in self.r.states[lo : hi + 1]:
            self.tally.not_prefix += 1  # I10 in the strict sense: reported, not failed (T3)
        rep = armdb.check(path)
        if not rep.ok:
            return "check_findings", "; ".join(rep.findings[:3])
        return "ok", ""


# ---------------------------------------------------------------------------------------------
# Driving the generator
# ---------------------------------------------------------------------------------------------


def explore(
    r: Recording,
    budget: int,
    *,
    seed: int,
    ns_mode: str = "journal",
    exhaustive: bool = False,
    scratch: str,
    variants_fixed: tuple[str, ...] = ("drop_all", "keep_all", "zero_extend"),
    variants_random: tuple[str, ...] = ("prefix", "subset", "reorder"),
    max_rounds: int = 64,
) -> Tally:
    """Check up to ``budget`` distinct crash states of one recording.

    Round 0 applies the deterministic variants at every cut; later rounds apply the
    random variants at every cut that has unsynced data, until the budget is spent or a
    whole round finds no new distinct image.  When the budget cannot cover every cut,
    each round visits an evenly spread random sample of the cuts, so the end of a long
    trace is checked as often as its beginning.
    """
    tally = Tally()
    v = Verifier(r, scratch, tally)
    rng = random.Random(seed)
    trace = r.rec.trace
    cuts = cut_points(trace, exhaustive=exhaustive)
    ranges = {k: allowed_at(r, k) for k in cuts}
    rounds = [variants_fixed] + [variants_random] * max_rounds
    per_round = max(1, budget // 4)
    for rnd, variants in enumerate(rounds):
        if not variants:
            continue
        before = tally.states
        want = max(1, per_round // len(variants))
        chosen = cuts if len(cuts) <= want else sorted(rng.sample(cuts, want))
        model = CrashModel(r.rec, ns_mode=ns_mode)
        for k in chosen:
            model.advance(k)
            if rnd > 0 and model.pending_count() == 0:
                continue  # nothing unsynced: the random variants equal keep_all
            lo, hi = ranges[k]
            for variant in variants:
                v.verify(model.image(variant, rng), lo, hi)
                if tally.states >= budget:
                    return tally
        if rnd > 0 and tally.states == before and len(chosen) == len(cuts):
            break  # saturated: no new distinct image in a whole round
        if rnd > 3 * max_rounds // 4 and tally.states == before:
            break
    return tally


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

FIXED_D = World(queues=(("fq", False),), durable=True)
VAR_D = World(queues=(("vq", True),), durable=True)
VAR_ENC_D = World(queues=(("vq", True),), durable=True, encrypted=True)
FIXED_ND = World(queues=(("fq", False),), durable=False)
VAR_ND = World(queues=(("vq", True),), durable=False)
MAP_D = World(queues=(), maps=("m",), durable=True, value_size=6000)
MAP_ND = World(queues=(), maps=("m",), durable=False, value_size=6000)
OUTBOX_D = World(queues=(("vq", True),), maps=("m",), durable=True)
OUTBOX_ND = World(queues=(("vq", True),), maps=("m",), durable=False)
VAR_BIG_D = World(queues=(("vq", True),), durable=True, payload_size=5000)
TWO_SHARDS_D = World(queues=(("fq", False), ("vq", True)), durable=True, shards=2)
# Outbox commits of ~1.6 KB log records against a 4096-byte checkpoint size: a checkpoint
# (new log file, store syncs, old file removed) runs after every third commit, mid-script.
CKPT_D = World(queues=(("vq", True),), maps=("m",), durable=True, value_size=1500, checkpoint_bytes=4096)
CKPT_ND = World(queues=(("vq", True),), maps=("m",), durable=False, value_size=1500, checkpoint_bytes=4096)


def _queue_script(q: str) -> list[str]:
    return [
        f"push:{q}",
        f"push:{q}",
        f"push:{q}",
        f"lease:{q}",
        f"ack:{q}",
        f"lease:{q}",
        f"nack:{q}",
        f"lease:{q}",
        f"dead:{q}",
        f"push:{q}",
        "reopen",
        f"lease:{q}",
        f"ack:{q}",
        f"tx:{q}",
        f"lease:{q}",
        f"tx:{q}",
    ]


def _map_script() -> list[str]:
    return ["put:m"] * 12 + ["del:m", "put:m", "del:m"] + ["put:m"] * 12 + ["reopen"] + ["put:m"] * 6


def _big_var_script() -> list[str]:
    ops = ["push:vq"] * 16
    for _ in range(6):
        ops += ["lease:vq", "ack:vq"]
    ops += ["push:vq"] * 8 + ["lease:vq", "ack:vq", "lease:vq", "nack:vq"]
    return ops


def _many_rows_script(q: str) -> list[str]:
    """More rows than one grow step (64): slots straddle sectors and pages, the file grows."""
    ops = [f"push:{q}"] * 70
    for _ in range(12):
        ops += [f"lease:{q}", f"lease:{q}", f"nack:{q}", f"ack:{q}"]
    return ops


OUTBOX_SCRIPT = ["outbox:vq:m", "outbox:vq:m", "lease:vq", "ack:vq", "outbox:vq:m", "lease:vq", "tx:vq", "outbox:vq:m"]

SCRIPTED: dict[str, tuple[World, list[str]]] = {
    "many_rows_fixed_durable": (FIXED_D, _many_rows_script("fq")),
    "many_rows_var_durable": (VAR_D, _many_rows_script("vq")),
    "many_rows_fixed_default": (FIXED_ND, _many_rows_script("fq")),
    "fixed_durable": (FIXED_D, _queue_script("fq")),
    "var_durable": (VAR_D, _queue_script("vq")),
    "var_encrypted_durable": (VAR_ENC_D, _queue_script("vq")),
    "fixed_default": (FIXED_ND, _queue_script("fq")),
    "var_default": (VAR_ND, _queue_script("vq")),
    "map_rotation_durable": (MAP_D, _map_script()),
    "map_rotation_default": (MAP_ND, _map_script()),
    "outbox_durable": (OUTBOX_D, OUTBOX_SCRIPT),
    "outbox_default": (OUTBOX_ND, OUTBOX_SCRIPT),
    "checkpoint_durable": (CKPT_D, OUTBOX_SCRIPT),
    "checkpoint_default": (CKPT_ND, OUTBOX_SCRIPT),
    "var_payload_rotation_durable": (VAR_BIG_D, _big_var_script()),
    "two_shards_durable": (
        TWO_SHARDS_D,
        [
            "push:fq",
            "push:vq",
            "push:fq",
            "push:vq",
            "lease:fq",
            "lease:vq",
            "ack:fq",
            "ack:vq",
            "push:vq",
            "lease:vq",
            "nack:vq",
        ],
    ),
}


def _random_ops(rng: random.Random, world: World, n: int) -> list[str]:
    choices: list[tuple[str, int]] = []
    for q, _var in world.queues:
        choices += [
            (f"push:{q}", 30),
            (f"lease:{q}", 25),
            (f"ack:{q}", 15),
            (f"nack:{q}", 6),
            (f"dead:{q}", 3),
            (f"tx:{q}", 6),
        ]
        for m in world.maps:
            choices.append((f"outbox:{q}:{m}", 6))
    for m in world.maps:
        choices += [(f"put:{m}", 20), (f"del:{m}", 5)]
    choices.append(("reopen", 3))
    ops, weights = zip(*choices)
    return rng.choices(list(ops), weights=list(weights), k=n)


RANDOM_WORLDS = [VAR_D, FIXED_D, VAR_ND, OUTBOX_D, FIXED_ND, VAR_ENC_D]

B3_SET_CI = ("push", "lease", "ack", "nack", "tx", "reopen")
B3_SET_NIGHTLY = ("push", "lease", "ack", "nack", "dead", "tx", "reopen")
B3_BASE_OPS = ["push", "push", "lease"]  # the base image: two rows, one leased (then closed)


def b3_sequences(opset: tuple[str, ...]) -> list[tuple[str, ...]]:
    seqs: list[tuple[str, ...]] = []
    for n in (1, 2, 3):
        seqs += list(itertools.product(opset, repeat=n))
    return seqs


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

_TOTAL = Tally()


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest):
    t0 = time.monotonic()
    with quiet_armdb_log():
        yield
    v = _TOTAL
    line = (
        f"RELIABILITY powerloss states={v.states} faults=0 mutations=0 violations={v.total_violations} "
        f"untyped_exceptions={v.untyped} fd_leaks=0 generated={v.generated} "
        f"not_prefix={v.not_prefix} refused_s7={v.refused_s7} by_class={dict(v.violations) or '{}'} seconds={time.monotonic() - t0:.0f}"
    )
    report_line(line, request)



def signature(outcome: tuple[str, str]) -> str:
    """A violation with paths, numbers and keys blanked, to group equal failures."""
    text = re.sub(r"/\S+/(db/)?", "", outcome[1].split(" | ")[0].split("; got")[0])
    text = re.sub(r"b'[^']*'|\d+", "#", text)
    return f"{outcome[0]}: {text[:160]}"


def _finish(t: Tally, what: str) -> None:
    _TOTAL.merge(t)
    if t.total_violations:
        lines = "\n".join(
            f"  {n} x {sig}\n      variants {dict(t.sig_variants[sig])}\n      e.g. {t.sig_example[sig][:700]}"
            for sig, n in t.signatures.most_common(12)
        )
        pytest.fail(
            f"{what}: {t.total_violations} violation(s) in {t.states} crash states "
            f"({dict(t.violations)}), grouped:\n{lines}\n(failing images kept under "
            f"{tempfile.gettempdir()}/armdb-fail-powerloss-*)",
            pytrace=False,
        )


def _share(total: int, frac: float, parts: int) -> int:
    return max(20, int(total * frac / parts))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tmp_path() -> Any:
    from pathlib import Path

    d = fast_tmpdir("armdb-pl-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run_scripted(name: str, budget: int, tmp_path: Any, seed: int, ns_mode: str = "journal") -> Tally:
    world, ops = SCRIPTED[name]
    r = record(name, world, ops, str(tmp_path / "rec"))
    assert not r.problems, f"recorder missed mutations (a call bypassed armdb._fs?): {r.problems}"
    return explore(r, budget, seed=seed, ns_mode=ns_mode, scratch=str(tmp_path / "scratch"))


@pytest.mark.parametrize("name", sorted(SCRIPTED))
def test_powerloss_scripted(name: str, tmp_path: Any) -> None:
    """I1/I2/I3/I4/I8/I9/I10 on every crash state of one scripted workload (docs/reliability.md, (b))."""
    t = _run_scripted(name, _share(CI_STATES, 0.45, len(SCRIPTED)), tmp_path, seed=zlib.crc32(name.encode()))
    _finish(t, f"power loss, workload {name}")


# (world, op set) pairs of the CI B3 run; the nightly run uses every world with B3_SET_NIGHTLY.
B3_CI = {
    "var_durable": ("push", "lease", "ack", "nack", "tx", "reopen"),
    "fixed_durable": ("push", "lease", "nack", "ack"),
    "var_default": ("push", "lease", "ack", "tx"),
}


@pytest.mark.parametrize("world_name", sorted(B3_CI))
def test_powerloss_b3_exhaustive(world_name: str, tmp_path: Any) -> None:
    """B3 (CrashMonkey/ACE): every sequence of <= 3 ops of a small set, cut at every trace
    record (every crash point), variants drop_all, keep_all, prefix and subset."""
    t = _b3(
        world_name,
        B3_CI[world_name],
        200 * 400,
        tmp_path,
        variants=("drop_all", "keep_all", "prefix", "subset"),
    )
    _finish(t, f"power loss, B3 set {B3_CI[world_name]} on {world_name}")


B3_WORLDS = {
    "var_durable": VAR_D,
    "fixed_durable": FIXED_D,
    "var_default": VAR_ND,
    "fixed_default": FIXED_ND,
    "var_encrypted_durable": VAR_ENC_D,
}


def _b3(
    world_name: str, opset: tuple[str, ...], budget: int, tmp_path: Any, *, variants: tuple[str, ...]
) -> Tally:
    world = B3_WORLDS[world_name]
    q = world.queues[0][0]
    base = str(tmp_path / "base")
    os.makedirs(os.path.join(base, "db"))
    s = Session(world, os.path.join(base, "db")).open()
    for op in B3_BASE_OPS:
        s.run(f"{op}:{q}")
    pushes = s.pushes
    s.close()
    seqs = b3_sequences(opset)
    per_seq = max(50, budget // len(seqs))
    total = Tally()
    for i, seq in enumerate(seqs):
        root = str(tmp_path / f"r{i}")
        shutil.copytree(base, root)
        ops = [f"{op}:{q}" if op != "reopen" else "reopen" for op in seq]
        name = f"b3-{world_name}-{'.'.join(seq)}"
        r = _record_from_base(name, world, ops, root, pushes)
        assert not r.problems, r.problems
        t = explore(
            r,
            per_seq,
            seed=i,
            exhaustive=True,
            scratch=str(tmp_path / "scratch"),
            variants_fixed=variants,
            variants_random=(),
            max_rounds=0,
        )
        total.merge(t)
        shutil.rmtree(root, ignore_errors=True)
    return total


def _record_from_base(name: str, world: World, ops: list[str], root: str, pushes: int) -> Recording:
    """Like :func:`record`, with the push counter continuing after the base's pushes.

    A lease held in the base is gone after the reopen (tokens do not survive it); the
    workload leases again when it needs a token.
    """
    orig = Session.open

    def open_keep(self: Session) -> Session:
        out = orig(self)
        self.pushes = max(self.pushes, pushes)
        return out

    Session.open = open_keep  # type: ignore[method-assign]
    try:
        return record(name, world, ops, root)
    finally:
        Session.open = orig  # type: ignore[method-assign]


def test_powerloss_random_workloads(tmp_path: Any) -> None:
    """Seeded random workloads over every world (durable, default, encrypted, outbox)."""
    rng = random.Random(4242)
    n = 6
    budget = _share(CI_STATES, 0.15, n)
    total = Tally()
    for i in range(n):
        world = RANDOM_WORLDS[i % len(RANDOM_WORLDS)]
        ops = _random_ops(rng, world, 24)
        r = record(f"random{i}", world, ops, str(tmp_path / f"rec{i}"))
        assert not r.problems, r.problems
        total.merge(explore(r, budget, seed=i, scratch=str(tmp_path / "scratch")))
    _finish(total, "power loss, random workloads")


@pytest.mark.parametrize("name", ["var_durable", "fixed_durable", "map_rotation_durable", "outbox_durable"])
def test_powerloss_strict_directories(name: str, tmp_path: Any) -> None:
    """POSIX-strict directory model: a create, mkdir or rename is durable only once its
    directory is fsynced (ALICE, RocksDB ``DeleteFilesCreatedAfterLastDirSync``)."""
    t = _run_scripted(name, _share(CI_STATES, 0.05, 4), tmp_path, seed=7, ns_mode="strict")
    _finish(t, f"power loss with strict directory semantics, workload {name}")


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_powerloss_nightly(tmp_path: Any) -> None:
    """Nightly size: every scripted workload, the full B3 set on every world, random workloads."""
    total = Tally()
    names = sorted(SCRIPTED)
    for i, name in enumerate(names):
        total.merge(_run_scripted(name, int(NIGHTLY_STATES * 0.3 / len(names)), tmp_path / f"s{i}", seed=i))
    for wn in B3_WORLDS:
        total.merge(
            _b3(
                wn,
                B3_SET_NIGHTLY,
                int(NIGHTLY_STATES * 0.5 / len(B3_WORLDS)),
                tmp_path / f"b3{wn}",
                variants=("drop_all", "keep_all", "prefix", "subset", "reorder", "zero_extend"),
            )
        )
    rng = random.Random(99)
    for i in range(40):
        world = RANDOM_WORLDS[i % len(RANDOM_WORLDS)]
        r = record(f"nrandom{i}", world, _random_ops(rng, world, 60), str(tmp_path / f"nr{i}"))
        total.merge(explore(r, int(NIGHTLY_STATES * 0.2 / 40), seed=i, scratch=str(tmp_path / "scratch")))
    _finish(total, "power loss, nightly")


# ---------------------------------------------------------------------------------------------
# Regressions: one deterministic crash state per bug the generator found (kept forever)
# ---------------------------------------------------------------------------------------------

_CLOCK_MS = 1_700_000_000_000


def _qcfg(*, durable: bool = True, grow_step: int = 64) -> armdb.QueueConfig:
    interval = 0 if durable else 3600
    return (
        armdb.QueueConfig.balanced()
        .header_config(armdb.FixedConfig.balanced().grow_step(grow_step).sync_interval(interval).build())
        .payload_config(armdb.Config.balanced().sync_interval(interval).build())
        .build()
    )


def _read(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _write(p: str, data: bytes) -> None:
    with open(p, "wb") as f:
        f.write(data)


def test_s4_torn_slot_update_keeps_its_row(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """S4/I1: a durable row whose in-place update (a lease) is torn by power loss must
    survive, as the old or the new row.  The tear is at byte granularity, inside slot 9
    (row 10): its first 24 bytes are the lease's, the rest the row before it (slots no
    longer straddle sectors, so only a disk that tears inside a sector does this; the
    durable promise holds even then), and nothing else the lease wrote after its
    in-place copy began reached the disk."""
    d = str(tmp_path / "db")
    q_spec = armdb.queue("vq", payload=bytes, var=True)
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    q = db.open_queue(q_spec, _qcfg())
    for i in range(1, 13):
        q.push(b"job%d" % i, delay=0 if i == 10 else 3600)  # only row 10 (slot 9) is due
    db.shutdown()
    sdir = os.path.join(d, "collections", "vq", "shard-000")
    path = os.path.join(sdir, "fixed.data")
    before = _read(path)
    # Any other file of the shard (a redo or undo record, if the store keeps one) as it
    # was before the lease: its pages are written back independently of the slot's, so
    # without an msync between the two stores the record may not have reached the disk.
    others = {f: _read(os.path.join(sdir, f)) for f in os.listdir(sdir) if f != "fixed.data"}
    # A store that syncs such a record before the in-place copy makes that record
    # durable: take the other files as they are when the copy begins (the failpoint
    # between the two).
    from armdb import _fail

    orig_point = _fail.point

    def at_copy(name: str) -> None:
        if name == "fixed.after_redo_sync":
            others.update({f: _read(os.path.join(sdir, f)) for f in os.listdir(sdir) if f != "fixed.data"})
        orig_point(name)

    monkeypatch.setattr(_fail, "point", at_copy)
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    q = db.open_queue(q_spec, _qcfg())
    (lease,) = q.lease(1)
    assert lease.id == 10
    db.shutdown()
    after = _read(path)
    slot_size = struct.unpack_from("<I", before, 12)[0]
    cut = 4096 + 9 * slot_size + 24
    assert before[cut - 24 : cut] != after[cut - 24 : cut], "the lease must change the slot's first bytes"
    _write(path, before[:4096] + after[4096:cut] + before[cut:])
    for f, data in others.items():
        _write(os.path.join(sdir, f), data)
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    try:
        q = db.open_queue(q_spec, _qcfg())
        ids = sorted(int(x) for x in q.snapshot()["id"])
    finally:
        db.shutdown()
    assert 10 in ids, f"row 10 was pushed durably and is gone after a torn lease update: {ids}"


def test_d5_log_file_created_just_before_power_loss_opens(tmp_path: Any) -> None:
    """D5/T2: every open starts a new log file (header pwrite, then fsync).  Power loss
    before the fsync can leave the file with its size but zero content; it holds no
    commit, so the next open must succeed (it skips a shorter file already)."""
    d = str(tmp_path / "db")
    armdb.Db.open(d).close()
    logs = sorted(n for n in os.listdir(os.path.join(d, "txlog")) if n.endswith(".log"))  # not synced.mark
    _write(os.path.join(d, "txlog", f"{int(logs[-1][:8]) + 1:08d}.log"), bytes(32))
    armdb.Db.open(d).close()


def test_d5_log_file_with_torn_header_opens(tmp_path: Any) -> None:
    """D5/T2: as above, with only the first 16 bytes of the header on disk."""
    d = str(tmp_path / "db")
    armdb.Db.open(d).close()
    logs = sorted(n for n in os.listdir(os.path.join(d, "txlog")) if n.endswith(".log"))  # not synced.mark
    head = _read(os.path.join(d, "txlog", logs[-1]))[:16]
    _write(os.path.join(d, "txlog", f"{int(logs[-1][:8]) + 1:08d}.log"), head + bytes(16))
    armdb.Db.open(d).close()


def test_d5_fixed_data_created_just_before_power_loss_opens(tmp_path: Any) -> None:
    """D5/S11: a new shard file is written as header pwrite + ftruncate(4096) + fsync.
    Power loss before the fsync leaves 4096 zero bytes (size before content); the shard
    holds no row yet, so opening the queue must succeed."""
    d = str(tmp_path / "db")
    spec = armdb.queue("fq", payload=np.dtype("<u8"))
    db = armdb.Db.open(d)
    db.open_queue(spec)
    db.close()
    path = os.path.join(d, "collections", "fq", "shard-000", "fixed.data")
    _write(path, bytes(4096))
    db = armdb.Db.open(d)
    try:
        db.open_queue(spec)
    finally:
        db.close()


def test_d5_fixed_redo_created_just_before_power_loss_opens(tmp_path: Any) -> None:
    """D5/S4: the per-shard redo file is created like fixed.data (header pwrite +
    ftruncate + fsync); power loss before the fsync leaves it zero-filled.  It holds no
    record yet, so opening the queue must succeed."""
    d = str(tmp_path / "db")
    spec = armdb.queue("fq", payload=np.dtype("<u8"))
    db = armdb.Db.open(d)
    db.open_queue(spec)
    db.close()
    sdir = os.path.join(d, "collections", "fq", "shard-000")
    extra = [f for f in os.listdir(sdir) if f != "fixed.data"]
    assert extra == ["fixed.redo"], extra  # the side file this test zeroes
    for f in extra:
        p = os.path.join(sdir, f)
        _write(p, bytes(len(_read(p))))
    db = armdb.Db.open(d)
    try:
        db.open_queue(spec)
    finally:
        db.close()


def test_s7_hint_file_with_a_garbage_header_is_ignored(tmp_path: Any) -> None:
    """S7: hint files are caches that are never synced, so after a power loss one can hold
    anything (test6.c "garbage" sectors).  A damaged hint is documented as ignored (the
    data file is scanned instead); a garbage header must not make the open fail with
    FormatError("unknown magic")."""
    d = str(tmp_path / "db")
    cfg = armdb.Config.balanced().max_file_size(64 * 1024).build()
    db = armdb.Db.open(d)
    m = db.open_map("m", cfg)
    for i in range(12):
        m.put(b"k%d" % i, b"v" * 6000)  # rotation writes 00000001.hint
    db.close()
    sdir = os.path.join(d, "collections", "m", "shard-000")
    hints = [f for f in os.listdir(sdir) if f.endswith(".hint")]
    assert hints
    p = os.path.join(sdir, hints[0])
    raw = _read(p)
    _write(p, bytes(random.Random(1).getrandbits(8) for _ in range(512)) + raw[512:])
    db = armdb.Db.open(d)
    try:
        assert db.open_map("m", cfg).get(b"k0") == b"v" * 6000
    finally:
        db.close()


def _crash_leaving_logged_commit(d: str, *, encrypted: bool) -> None:
    """A child pushes two rows, leases one and acks it (a var ack is one log commit),
    and exits right after the log append (``txlog.after_append``)."""
    code = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
from tests.reliability.bcd_workloads import Session, World
s = Session(World(queues=(("vq", True),), durable=True, encrypted={encrypted!r}), {d!r}).open()
s.run("push:vq"); s.run("push:vq"); s.run("lease:vq"); s.run("ack:vq")
"""
    env = dict(os.environ, ARMDB_FAILPOINT="txlog.after_append", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 86, r.stderr


def test_t2_encrypted_replay_does_not_keep_log_files_forever(tmp_path: Any) -> None:
    """T2/T4: rows owed to an encrypted collection keep their log file until the
    collection is opened with its key; once it was (and the Db closed), the old files
    must go.  Today every open replays the record again and adds one more file."""
    d = str(tmp_path / "db")
    _crash_leaving_logged_commit(d, encrypted=True)
    world = World(queues=(("vq", True),), durable=True, encrypted=True)
    counts = []
    for _ in range(3):
        s = Session(world, d).open()
        s.close()
        counts.append(len([n for n in os.listdir(os.path.join(d, "txlog")) if n.endswith(".log")]))
    assert counts[-1] <= 1, f"log files after each open+close: {counts}"


def test_t2_torn_tail_in_a_retained_log_file_reopens(tmp_path: Any) -> None:
    """T2/I9: the crash also tore the next append (a partial record after the logged
    commit).  The first open drops the torn tail, but the retained file keeps it; the
    second open then finds it in a file that is no longer the last one and refuses."""
    d = str(tmp_path / "db")
    _crash_leaving_logged_commit(d, encrypted=True)
    logp = os.path.join(d, "txlog", "00000001.log")
    raw = _read(logp)
    _write(logp, raw + raw[32:72])  # the first 40 bytes of another record: a torn append
    world = World(queues=(("vq", True),), durable=True, encrypted=True)
    for i in range(2):
        s = Session(world, d).open()
        s.close()
        rep = armdb.check(d)
        assert rep.ok, f"after open {i + 1}: {rep.findings}"


def test_t2_superseded_log_file_with_unsynced_tail_opens(tmp_path: Any) -> None:
    """T2: a checkpoint syncs the stores, creates the next log file (fsync + directory
    fsync) and only then unlinks the old one.  Power loss before the unlink is durable
    leaves the old file, whose non-durable commits never reached the disk (zeros), next
    to the new one.  Its records were already applied and synced: the open must not
    call it corruption."""
    d = str(tmp_path / "db")
    s = Session(World(queues=(("vq", True),), durable=False), d).open()
    s.run("push:vq")
    s.run("lease:vq")
    s.run("ack:vq")  # one non-durable log commit in 00000001.log
    log1 = _read(os.path.join(d, "txlog", "00000001.log"))
    s.close()  # checkpoint: 00000002.log created, 00000001.log unlinked
    assert len(log1) > 32
    _write(os.path.join(d, "txlog", "00000001.log"), log1[:32] + bytes(len(log1) - 32))
    Session(World(queues=(("vq", True),), durable=False), d).open().close()


def test_s8_compaction_never_deletes_the_only_synced_copy(tmp_path: Any) -> None:
    """S8/I1: compaction drops a record superseded by a newer one and deletes its input
    file.  If the newer record still sat unsynced in the active file (default
    sync_interval), a power loss right after the compaction would lose the key.  So the
    active file must be synced after the newer record's append and before any input
    file is unlinked."""
    d = str(tmp_path / "db")
    cfg = armdb.Config.balanced().max_file_size(64 * 1024).sync_interval(3600).build()
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    m = db.open_map("m", cfg)
    v = b"x" * 6000  # ~6 KiB records: ten per 64 KiB file
    for i in range(10):
        m.put(b"k%d" % i, v)  # file 1: k0..k9
    for i in range(1, 4):
        m.put(b"k%d" % i, v)  # rotation (file 1 fdatasynced); file 2: k1..k3
    for i in range(7):
        m.put(b"f%d" % i, v)  # file 2 full
    events: list[tuple[str, Any]] = []

    class Watch(_fs.RealFS):
        def pwrite(self, fd: int, data: Any, offset: int) -> None:
            # (a write into the file's mark area records a sync that completed: not an append)
            if offset >= bitcask.DATA_START:
                events.append(("pwrite", fd))
            super().pwrite(fd, data, offset)

        def fdatasync(self, fd: int) -> None:
            events.append(("fdatasync", fd))
            super().fdatasync(fd)

        def unlink(self, path: str) -> None:
            events.append(("unlink", path))
            super().unlink(path)

    with _fs.use(Watch()):
        m.put(b"k4", b"NEW" * 2000)  # rotation; k4 goes to file 3; file 1 is compacted
    active_fd = m.store._shards[0].active.fd
    db.close()
    unlinks = [i for i, e in enumerate(events) if e[0] == "unlink" and str(e[1]).endswith(".data")]
    assert unlinks, "the scenario no longer compacts file 1"
    appends = [i for i, e in enumerate(events[: unlinks[0]]) if e == ("pwrite", active_fd)]
    assert appends, "k4 was not appended to the active file before the compaction"
    synced_after = [e for e in events[appends[-1] + 1 : unlinks[0]] if e == ("fdatasync", active_fd)]
    assert synced_after, "an input file was deleted while k4 (its successor) was still unsynced"


def test_q15_power_loss_never_leaves_a_header_without_its_body(tmp_path: Any) -> None:
    """Q15/I4 in the default (non-durable) mode: the body append and the header store are
    written back independently, so a power loss can keep the header page and lose the
    body.  Then every lease that reaches the row raises FormatError ("row has no body").
    The design text promises an orphan body at worst, never a header without its body."""
    d = str(tmp_path / "db")
    spec = armdb.queue("vq", payload=bytes, var=True)
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    q = db.open_queue(spec, _qcfg(durable=False))
    db.shutdown()
    data = os.path.join(d, "collections", "vq.payload", "shard-000", "00000001.data")
    body_before = _read(data)  # its mark area included
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    q = db.open_queue(spec, _qcfg(durable=False))
    quiesce(db)
    q.push(b"hello")
    fixed = _read(os.path.join(d, "collections", "vq", "shard-000", "fixed.data"))  # the page cache
    db.shutdown()
    # Power loss: the header page was written back, the body append was not (nor the
    # synced mark that the clean shutdown wrote after syncing it: the state is the one a
    # power cut before that shutdown leaves).
    _write(data, body_before)
    _write(os.path.join(d, "collections", "vq", "shard-000", "fixed.data"), fixed)
    db = armdb.Db.open(d, clock=lambda: _CLOCK_MS)
    try:
        q = db.open_queue(spec, _qcfg(durable=False))
        got = q.lease(1)
    finally:
        db.shutdown()
    assert got == [] or got[0].payload == b"hello"


def test_d3_every_new_directory_entry_is_fsynced(tmp_path: Any) -> None:
    """D3/I1 under POSIX directory semantics (ALICE, RocksDB DeleteFilesCreatedAfterLastDirSync):
    a durable push must not depend on directory entries nobody fsynced.  Every mkdir and
    file creation under the database made before the push returned must be followed by
    an fsync of its parent directory before the push returns."""
    root = str(tmp_path / "rec")
    r = record("dirs", VAR_D, ["push:vq"], root)
    trace = r.rec.trace
    done = max(i for i, t in enumerate(trace) if t[:2] == ("ev", "done"))
    missing = []
    for i, t in enumerate(trace[:done]):
        if t[0] in ("mkdir", "create", "rename"):
            path = t[2] if t[0] == "rename" else t[1]
            if os.path.basename(path) == "LOCK" or path.endswith(".tmp"):
                continue
            parent = os.path.dirname(path) or "."
            if not any(u[0] == "dsync" and u[1] == parent for u in trace[i + 1 : done]):
                if path in {p for u in trace[i + 1 : done] if u[0] in ("unlink", "rename") for p in [u[1]]}:
                    continue  # removed or renamed away again before the push returned
                missing.append(f"{t[0]} {path}")
    assert not missing, f"directory entries never made durable before a durable push returned: {missing}"
