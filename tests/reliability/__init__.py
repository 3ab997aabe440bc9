"""Reliability harnesses for armdb (docs/reliability.md: failure model, invariants, harnesses, figures).

Shared pieces:

* ``journal``  -- the append-only journal of intents and completions that worker
  children write (one file per child), the job payload format, the summary line.
* ``checker``  -- Jepsen ``total-queue`` counts plus the lease, attempt, payload and
  transaction checks, computed from the journal and the reopened database.
* ``adapter``  -- the only place that maps harness verbs to the armdb API.
* ``workload`` -- the code the worker children run.
"""
