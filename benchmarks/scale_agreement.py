#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
How the store agreement's cost grows with the participants: N participants,
each a thread with its own client connection to one local ``TCPStore``, agree
on per-table facts of 1,000 tables merged by union.

Facts: of the 1,000 tables (the mix of the scale benchmark), 60% are row-wise
and 10% replicated, so every participant holds them; 20% are table-wise, on
one participant each; 10% column-wise, on 4 participants each. Per table a
participant reports what ``optimizer_state.TableFacts`` carries (the fields
that travel with its pieces and its learning rate), plus its optimizer step
count. The merge is their union (the lowest index's entry wins) and the
highest step count: a bounded size whatever N.

Measured per N, in one run (client connections are made before and not
timed):

* ``new``    ``agreement.agree_on_store``: each participant posts once, the
  coordinator merges and decides, each reads the decision once;
* ``today``  the protocol of ``exchange.agree_among`` (the fork before this
  change), replayed with the same key pattern on an explicit store: each
  participant posts its facts and reads every other participant's back (N^2
  gets). Only its store traffic is timed: each rank's own merge of the N
  facts it read (which it also did) is not. Run once, up to ``--today-max-n``
  (its bytes grow as N^2); above, the row says so and gives the bytes it
  would move (N^2 reads of the measured posts), marked "extrapolated".

``seconds`` is the wall time from the release of all participants to the
last one returning (median over repeats); ``store_bytes`` the bytes of the
values set and got through the store by all participants (one run); the
table prints bytes / N, which stays flat when the bytes grow linearly.

The threads share one Python interpreter, so work that real ranks do in
parallel (pickling their posts, unpickling the decision) is serialised here,
and a thousand threads waiting for the GIL wake every switch interval (5 ms
by default) to ask for it: at N = 1,024 that convoy, not the protocol, costs
most of the time (seconds of system time in futex calls). The runs therefore
use a switch interval of ``--switch-interval`` seconds (0.5: every
participant blocks on the store long before), restored afterwards; pass
0.005 to see Python's default. Real ranks share no GIL.

The rows also go to ``scale_agreement.json`` in ``--out-dir`` (default
``benchmarks/results/``, the options of ``common.py``; no plot). Example::

    python benchmarks/scale_agreement.py --sizes 64,256,1024 --repeats 3
"""

import contextlib
import gc
import hashlib
import pickle
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist
from common import benchmark_parser, MiB, save_results
from torchrec.distributed.resharding.agreement import agree_on_store
from torchrec.distributed.resharding.plan import ReshardAbortedError, ReshardError
from torchrec.distributed.test_utils.store_participants import (
    CountingStore,
    local_store_clients,
    Outcome,
    run_participants,
    StoreTraffic,
)

TABLES = 1000
TIMEOUT = timedelta(seconds=300)
BOUND = timedelta(seconds=900)
TODAY_MAX_N = 256
SWITCH_INTERVAL_S = 0.5
FIELDS: Tuple[Tuple[str, str, str], ...] = (
    ("weight", "rect", "torch.float32"),
    ("momentum1", "rows", "torch.float32"),
)


def held_tables(index: int, size: int, tables: int = TABLES) -> List[int]:
    """
    Args:
        index (int): a participant.
        size (int): the participants.
        tables (int): the tables of the model.

    Returns:
        List[int]: the tables participant ``index`` holds shards of.
    """
    held = []
    for t in range(tables):
        kind = t % 10
        if kind < 6 or kind == 9:  # row-wise, replicated: everywhere
            held.append(t)
        elif kind < 8:  # table-wise: one participant
            if t % size == index:
                held.append(t)
        elif index in {(4 * t + k) % size for k in range(4)}:  # column-wise
            held.append(t)
    return held


def local_facts(index: int, size: int, tables: int = TABLES) -> Dict[str, Any]:
    """
    Args:
        index (int): a participant.
        size (int): the participants.
        tables (int): the tables of the model.

    Returns:
        Dict[str, Any]: what it reports: per held table its fields and
        learning rate, and its optimizer step count.
    """
    return {
        "fields": {f"table_{t}": FIELDS for t in held_tables(index, size, tables)},
        "learning_rates": {
            f"table_{t}": 0.01 + t * 1e-6 for t in held_tables(index, size, tables)
        },
        "optimizer_iter": 1000 + index % 3,
    }


def union(all_facts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """
    Args:
        all_facts (List[Dict[str, Any]]): every participant's facts, by index.

    Returns:
        Dict[str, Any]: their union (the lowest index's entry wins) and the
        highest step count.
    """
    fields: Dict[str, Any] = {}
    rates: Dict[str, float] = {}
    for facts in all_facts:
        for name, value in facts["fields"].items():
            fields.setdefault(name, value)
        for name, rate in facts["learning_rates"].items():
            rates.setdefault(name, rate)
    return {
        "fields": fields,
        "learning_rates": rates,
        "optimizer_iter": max(f["optimizer_iter"] for f in all_facts),
    }


# ----------------------------------------------------------------- today ----


def _today_prefix(participants: Sequence[int]) -> str:
    text = ",".join(str(r) for r in participants)
    return "torchrec_reshard/" + hashlib.sha1(text.encode()).hexdigest()[:16]


def _today_open_attempt(store: Any, prefix: str) -> int:
    while True:
        attempt = int(store.add(f"{prefix}/current", 0))
        if not store.check([f"{prefix}/{attempt}/state"]):
            return attempt
        store.compare_set(f"{prefix}/current", str(attempt), str(attempt + 1))


def agree_today(
    store: Any,
    index: int,
    participants: Sequence[int],
    digest: int,
    error: Optional[str],
    facts: Any,
    timeout: timedelta,
) -> List[Any]:
    """
    The store protocol of ``exchange.agree_among`` before this change (same
    keys, same calls, same order), with the store and the participant's index
    given instead of taken from the default process group. For comparison
    only.

    Args:
        store (Any): the store.
        index (int): this participant's position in ``participants``.
        participants (Sequence[int]): global ranks.
        digest (int): digest of the request.
        error (Optional[str]): validation error.
        facts (Any): picklable facts.
        timeout (timedelta): bound of every wait.

    Returns:
        List[Any]: every participant's facts, by index.
    """
    size = len(participants)
    prefix = _today_prefix(participants)
    attempt = _today_open_attempt(store, prefix)
    here = f"{prefix}/{attempt}"
    if attempt > 1:
        store.delete_key(f"{prefix}/{attempt - 2}/rank{index}")
    store.set(f"{here}/rank{index}", pickle.dumps((digest, error, facts)))
    if int(store.add(f"{here}/arrived", 1)) >= size:
        decision = store.compare_set(f"{here}/state", "", b"go")
    else:
        try:
            store.wait([f"{here}/state"], timeout)
            decision = store.get(f"{here}/state")
        except dist.DistStoreError:
            decision = store.compare_set(f"{here}/state", "", b"aborted")
    store.compare_set(f"{prefix}/current", str(attempt), str(attempt + 1))
    if decision != b"go":
        raise ReshardAbortedError("a participant did not join")
    gathered = [pickle.loads(store.get(f"{here}/rank{r}")) for r in range(size)]
    if int(store.add(f"{here}/read", 1)) >= size:
        store.set(f"{here}/all_read", b"go")
    else:
        store.wait([f"{here}/all_read"], timeout)
    if len({g[0] for g in gathered}) != 1:
        raise ReshardError("different requests")
    return [g[2] for g in gathered]


# ------------------------------------------------------------- measuring ----


def _run(
    protocol: str,
    clients: Sequence[dist.TCPStore],
    participants: Sequence[int],
    facts: Sequence[Any],
) -> Tuple[float, List[StoreTraffic], Dict[int, Outcome]]:
    traffic = [StoreTraffic() for _ in participants]
    stores = [CountingStore(c, t) for c, t in zip(clients, traffic)]

    def call(i: int) -> Any:
        if protocol == "new":
            return agree_on_store(
                stores[i], i, participants, 7, None, facts[i], TIMEOUT, union
            )
        return agree_today(stores[i], i, participants, 7, None, facts[i], TIMEOUT)

    gc.collect()
    outcomes = run_participants(range(len(participants)), call, BOUND)
    failed = {i: o.error for i, o in outcomes.items() if o.error is not None}
    if failed:
        raise RuntimeError(f"the {protocol} agreement failed: {failed}")
    wall = max(o.finished for o in outcomes.values()) - min(
        o.started for o in outcomes.values()
    )
    return wall, traffic, outcomes


def _summary(
    prefix: str, walls: List[float], traffic: List[StoreTraffic]
) -> Dict[str, float]:
    return {
        f"{prefix}seconds": statistics.median(walls),
        f"{prefix}seconds_min": min(walls),
        f"{prefix}store_bytes": float(sum(t.bytes for t in traffic)),
        f"{prefix}coordinator_bytes": float(traffic[0].bytes),
        f"{prefix}max_participant_bytes": float(max(t.bytes for t in traffic[1:])),
        f"{prefix}max_round_trips": float(max(t.calls for t in traffic)),
        f"{prefix}round_trips": float(sum(t.calls for t in traffic)),
    }


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def measure_agreement(
    n: int,
    repeats: int = 1,
    today_max_n: int = TODAY_MAX_N,
    switch_interval: float = SWITCH_INTERVAL_S,
) -> Dict[str, float]:
    """
    Agreement of ``n`` thread participants on one local ``TCPStore``.

    Args:
        n (int): participants (at least 2).
        repeats (int): agreements in a row (attempts of the same
            participants); seconds are their median and minimum.
        today_max_n (int): also replay today's protocol (once) when ``n`` is
            at most this (its bytes grow as n^2).
        switch_interval (float): the interpreter's switch interval during
            the runs (see the module's docstring).

    Returns:
        Dict[str, float]: ``seconds``, ``seconds_min``, ``store_bytes`` (one
        agreement, all participants), ``coordinator_bytes``,
        ``max_participant_bytes`` (the largest of the others),
        ``max_round_trips`` (store calls of the busiest participant),
        ``round_trips`` (all); the same prefixed ``today_`` when today's
        protocol ran, ``today_measured`` 1.0 or 0.0, and when it did not,
        ``today_store_bytes`` extrapolated (n^2 reads of the posts measured
        for the new protocol) with ``today_seconds`` NaN.
    """
    if n < 2:
        raise ValueError("at least 2 participants")
    facts = [local_facts(i, n) for i in range(n)]
    expected = union(facts)
    participants = list(range(n))
    result: Dict[str, float] = {"n": float(n), "switch_interval": switch_interval}
    with (
        local_store_clients(n, TIMEOUT) as (_, clients),
        _switch_interval(switch_interval),
    ):
        walls, traffic = [], []
        for _ in range(repeats):
            wall, traffic, outcomes = _run("new", clients, participants, facts)
            walls.append(wall)
            if any(o.value.merged != expected for o in outcomes.values()):
                raise AssertionError("a participant got other merged facts")
        result.update(_summary("", walls, traffic))
        post_bytes = sum(len(pickle.dumps((0, 7, None, f))) for f in facts)
        if n <= today_max_n:
            # once: a reference, and the costliest run by far
            wall, today_traffic, outcomes = _run("today", clients, participants, facts)
            if any(o.value != facts for o in outcomes.values()):
                raise AssertionError("today's protocol gathered other facts")
            result.update(_summary("today_", [wall], today_traffic))
            result["today_measured"] = 1.0
        else:
            result["today_measured"] = 0.0
            result["today_seconds"] = float("nan")
            # every participant writes its post and reads all n of them
            result["today_store_bytes"] = float(post_bytes + n * post_bytes)
            result["today_round_trips"] = float(n * n)
    return result


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:9.2f}"


def print_table(rows: List[Dict[str, float]]) -> None:
    """Prints the measured rows as a table."""
    print(
        f"{'N':>5} | {'new s':>7} {'MiB':>9} {'KiB/N':>7} {'max rt':>6} | "
        f"{'today s':>8} {'MiB':>9} {'KiB/N':>8} {'max rt':>6} | "
        f"{'bytes today/new':>15}"
    )
    for r in rows:
        n = int(r["n"])
        measured = r["today_measured"] == 1.0
        today_s = f"{r['today_seconds']:8.2f}" if measured else f"{'not run':>8}"
        today_rt = f"{r['today_max_round_trips']:6.0f}" if measured else f"{'':>6}"
        mark = "" if measured else " (extrapolated)"
        print(
            f"{n:5d} | {r['seconds']:7.3f} {_mib(r['store_bytes'])} "
            f"{r['store_bytes'] / n / 1024:7.1f} {r['max_round_trips']:6.0f} | "
            f"{today_s} {_mib(r['today_store_bytes'])} "
            f"{r['today_store_bytes'] / n / 1024:8.1f} {today_rt} | "
            f"{r['today_store_bytes'] / r['store_bytes']:15.1f}{mark}"
        )


def main() -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--today-max-n", type=int, default=TODAY_MAX_N)
    parser.add_argument("--switch-interval", type=float, default=SWITCH_INTERVAL_S)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"store agreement, {TABLES} tables, threads on one local TCPStore; "
        f"{platform.node()}, {platform.processor() or platform.machine()}, "
        f"switch interval {args.switch_interval} s, load average {load} at start"
    )
    rows = []
    for n in sizes:
        start = time.perf_counter()
        rows.append(
            measure_agreement(n, args.repeats, args.today_max_n, args.switch_interval)
        )
        print(f"  N={n}: done in {time.perf_counter() - start:.1f} s", flush=True)
    print()
    print_table(rows)
    print(
        "\nnew: agreement.agree_on_store; today: exchange.agree_among's protocol "
        "replayed on an explicit store (store traffic only). s = median wall "
        "time of one agreement (connections made before), MiB = values set + "
        "got through the store, KiB/N = that per participant (flat = linear "
        "in N), max rt = store round trips of the busiest participant."
    )
    # no plot: the table is the result
    save_results(args.out_dir, "scale_agreement", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
