#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The agreement before any data moves, in O(1) store round trips per participant.

Every participant of a transaction (the ranks of a module's group, or the
union of the old and new groups of a move) posts the digest of its request,
its validation error (if any) and its local facts to the job's key-value store
once. The first participant, the coordinator, waits (bounded) until every
participant posted, reads all posts with one ``multi_get``, validates them,
merges the facts and posts one decision: go ahead with the merged facts, or
the error every participant raises. Everyone reads that decision once. So a
participant's traffic does not grow with the number of participants (the
coordinator's one ``multi_get`` aside), and the bytes through the store grow
linearly with it when the merge reduces the facts to a bounded size.

The guarantees:

* the same outcome on every participant: the same :class:`Agreement`, or the
  same error type with the same message;
* every wait is bounded by the timeout (plus a grace of at most a tenth of it,
  see :func:`_grace`): a participant that never comes (the coordinator
  included) makes every caller raise :class:`ReshardAbortedError` naming the
  missing global ranks;
* a participant that missed an attempt (it was decided without it) joins the
  others at the next one, and the keys of older attempts are deleted;
* nobody returns before every participant has read the decision, and the
  coordinator returns last: after the others told the store they are done
  with it. The coordinator is the lowest global rank, so the job store's
  host (rank 0) whenever it takes part: when it returns (and its process
  may exit, taking the store with it), nobody still waits on the store.

No process group is used, so a participant that never comes leaves every
group usable.

Keys, under a prefix derived from the participants' global ranks::

    current                 the attempt open now (a counter)
    post/<index>            (attempt, digest, error, facts) of one participant,
                            overwritten at its next attempt, deleted once the
                            decision is read
    <attempt>/arrived       how many participants posted
    <attempt>/present       the indices that posted ("3,0,7,")
    <attempt>/all_arrived   set by the last participant to post
    <attempt>/decision      the decision (go, error or aborted)
    <attempt>/read          how many participants read the decision
    <attempt>/all_read      set by the last one to read it
    <attempt>/left          how many of the others are done with the store
    <attempt>/all_left      set by the last of them
"""

import hashlib
import logging
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed import constants
from torchrec.distributed.resharding.plan import ReshardAbortedError, ReshardError

Merge = Callable[[List[Any]], Any]

_GO = "go"
_ERROR = "error"
_ABORTED = "aborted"

logger: logging.Logger = logging.getLogger(__name__)

_FLAG = b"1"

# Keys of one attempt that every participant shares (``post/<index>`` is not
# one of them: it belongs to its participant).
_SHARED_KEYS: Tuple[str, ...] = (
    "arrived",
    "present",
    "all_arrived",
    "decision",
    "read",
    "all_read",
    "left",
    "all_left",
)


@dataclass(frozen=True)
class Agreement:
    """
    What every participant agreed on before any data moved.

    Args:
        transaction (str): a name for this transaction, the same on every
            participant, never used again by the same participants; usable as
            a process-group name.
        merged (Any): the merged facts (``merge``'s result), the same on
            every participant.
    """

    transaction: str
    merged: Any


def rendezvous_prefix(participants: Sequence[int]) -> str:
    """
    Args:
        participants (Sequence[int]): the participants' global ranks, in the
            order that numbers them.

    Returns:
        str: the store prefix of every agreement among these participants.
    """
    text = ",".join(str(r) for r in participants)
    return "torchrec_agreement/" + hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class _Attempt:
    """The store keys of one attempt of the participants' rendezvous."""

    prefix: str
    number: int

    def key(self, name: str) -> str:
        return f"{self.prefix}/{self.number}/{name}"

    def post(self, index: int) -> str:
        return f"{self.prefix}/post/{index}"

    @property
    def transaction(self) -> str:
        return f"{self.prefix}/{self.number}/exchange"


def _open_attempt(store: dist.Store, prefix: str) -> _Attempt:
    # The attempt open now. Attempts decided without this participant (aborted
    # while it was away) are skipped, so it joins the others at the next one.
    while True:
        number = int(store.add(f"{prefix}/current", 0))
        attempt = _Attempt(prefix, number)
        if not store.check([attempt.key("decision")]):
            return attempt
        _close_attempt(store, attempt)


def _close_attempt(store: dist.Store, attempt: _Attempt) -> None:
    store.compare_set(
        f"{attempt.prefix}/current", str(attempt.number), str(attempt.number + 1)
    )


def _delete_attempt_before_last(store: dist.Store, attempt: _Attempt) -> None:
    # Every participant was done with attempt n - 2 before attempt n - 1 was
    # decided (it was decided with all of them, or after a whole timeout),
    # and attempt n is only opened once n - 1 is decided.
    if attempt.number < 2:
        return
    old = _Attempt(attempt.prefix, attempt.number - 2)
    for name in _SHARED_KEYS:
        store.delete_key(old.key(name))


def _encode_post(attempt: int, digest: int, error: Optional[str], facts: Any) -> bytes:
    try:
        return pickle.dumps((attempt, digest, error, facts))
    except Exception as e:  # the others must learn why, not time out
        reason = f"its facts cannot be pickled ({type(e).__name__}: {e})"
        return pickle.dumps((attempt, digest, error or reason, None))


def _post(
    store: dist.Store,
    attempt: _Attempt,
    index: int,
    size: int,
    digest: int,
    error: Optional[str],
    facts: Any,
) -> None:
    store.set(attempt.post(index), _encode_post(attempt.number, digest, error, facts))
    store.append(attempt.key("present"), f"{index},")
    arrived = int(store.add(attempt.key("arrived"), 1))
    if arrived == 1:
        _delete_attempt_before_last(store, attempt)
    if arrived == size:
        store.set(attempt.key("all_arrived"), _FLAG)


def _propose(store: dist.Store, attempt: _Attempt, proposal: bytes) -> bytes:
    # The first decision posted wins; whoever posted it closes the attempt
    # (the others skip a decided attempt when they open the next one).
    decision = store.compare_set(attempt.key("decision"), "", proposal)
    if decision == proposal:
        _close_attempt(store, attempt)
    return decision


def _decide_aborted(
    store: dist.Store,
    attempt: _Attempt,
    participants: Sequence[int],
    timeout: timedelta,
) -> bytes:
    # Called by a participant whose wait timed out: it proposes an abort that
    # names who has not posted.
    present = {
        int(i) for i in store.get(attempt.key("present")).decode().split(",") if i
    }
    missing = [rank for i, rank in enumerate(participants) if i not in present]
    if missing:
        message = (
            f"ranks {missing} did not join the reshard within {timeout}; "
            "nothing moved and the module is unchanged"
        )
    else:
        message = (
            f"every rank joined the reshard but the coordinator (rank "
            f"{participants[0]}) posted no decision within {timeout}; nothing "
            "moved and the module is unchanged"
        )
    return _propose(store, attempt, pickle.dumps((_ABORTED, message)))


def _grace(timeout: timedelta) -> timedelta:
    """
    How much longer than the coordinator a participant waits for the decision
    (index 1 once, the others twice): the coordinator decides an abort when
    its own wait times out, so the others receive that decision instead of
    timing out themselves. A store whose many clients time out at once is
    slow to answer them all (seconds, for a TCPStore and tens of clients);
    staggered, at most two do, and only when the coordinator itself is gone.
    """
    return min(timedelta(seconds=1), timeout / 10)


def _await_decision(
    store: dist.Store,
    attempt: _Attempt,
    participants: Sequence[int],
    timeout: timedelta,
    wait: timedelta,
) -> bytes:
    try:
        store.wait([attempt.key("decision")], wait)
    except dist.DistStoreError:
        return _decide_aborted(store, attempt, participants, timeout)
    return store.get(attempt.key("decision"))


def _different_requests(digests: Sequence[int]) -> Optional[str]:
    if len(set(digests)) == 1:
        return None
    groups: Dict[int, List[int]] = {}
    for index, digest in enumerate(digests):
        groups.setdefault(digest, []).append(index)
    return (
        "ranks passed different resharding requests (every rank must pass the "
        f"same delta); ranks grouped by request: {sorted(groups.values())}"
    )


def _validate_and_merge(
    posts: Sequence[Tuple[int, int, Optional[str], Any]],
    attempt: _Attempt,
    merge: Optional[Merge],
) -> Tuple[str, Any, Optional[BaseException]]:
    """
    The coordinator's decision on every participant's post: (kind, payload,
    the exception behind an error, if any).
    """
    if any(post[0] != attempt.number for post in posts):
        # A participant already moved on: this attempt was decided without
        # the coordinator, whose decision will not be taken.
        return _ABORTED, "the participants moved on to a later attempt", None
    different = _different_requests([post[1] for post in posts])
    if different is not None:
        return _ERROR, different, None
    for index, (_, _, error, _) in enumerate(posts):
        if error is not None:
            return _ERROR, f"{error} (reported by rank {index})", None
    facts = [post[3] for post in posts]
    if merge is None:
        return _GO, facts, None
    try:
        return _GO, merge(facts), None
    except ReshardError as e:
        return _ERROR, str(e), e
    except Exception as e:  # every participant must hear of it, not time out
        return _ERROR, f"merging the ranks' facts failed ({type(e).__name__}: {e})", e


def _coordinate(
    store: dist.Store,
    attempt: _Attempt,
    participants: Sequence[int],
    timeout: timedelta,
    merge: Optional[Merge],
) -> Tuple[bytes, Optional[BaseException]]:
    try:
        store.wait([attempt.key("all_arrived")], timeout)
    except dist.DistStoreError:
        return _decide_aborted(store, attempt, participants, timeout), None
    blobs = store.multi_get([attempt.post(i) for i in range(len(participants))])
    try:
        posts = [pickle.loads(blob) for blob in blobs]
    except Exception as e:  # every participant must hear of it, not time out
        message = f"the ranks' facts cannot be read ({type(e).__name__}: {e})"
        kind, payload, cause = _ERROR, message, e
    else:
        kind, payload, cause = _validate_and_merge(posts, attempt, merge)
    try:
        proposal = pickle.dumps((kind, payload))
    except Exception as e:
        message = f"the merged facts cannot be pickled ({type(e).__name__}: {e})"
        proposal, cause = pickle.dumps((_ERROR, message)), e
    decision = _propose(store, attempt, proposal)
    return decision, cause if decision == proposal else None


def _wait_until_all_read(
    store: dist.Store, attempt: _Attempt, index: int, size: int, timeout: timedelta
) -> None:
    # Nobody returns (and may exit, taking the store's host with it) before
    # every participant has read the decision.
    if int(store.add(attempt.key("read"), 1)) >= size:
        store.set(attempt.key("all_read"), _FLAG)
    else:
        try:
            store.wait([attempt.key("all_read")], timeout)
        except dist.DistStoreError as e:
            raise ReshardAbortedError(
                "a rank left the reshard while the ranks agreed; nothing moved and "
                "the module is unchanged"
            ) from e
    if index == 0:
        _wait_until_the_others_left(store, attempt, size, timeout)
    elif int(store.add(attempt.key("left"), 1)) >= size - 1:
        store.set(attempt.key("all_left"), _FLAG)


def _wait_until_the_others_left(
    store: dist.Store, attempt: _Attempt, size: int, timeout: timedelta
) -> None:
    # The coordinator is the job store's host whenever it takes part: had it
    # returned first, a participant still waiting for "all_read" could lose
    # the store's reply when the host's process exits (seen in CI: "Failed to
    # recv, got 0 bytes"). Every participant has read the decision already, so
    # one that never says it is done changes no outcome: go on with it.
    if size < 2:
        return
    try:
        store.wait([attempt.key("all_left")], timeout)
    except dist.DistStoreError:
        logger.warning(
            "reshard agreement %s: not every participant said it was done with "
            "the store within %s; going on (every participant read the decision)",
            attempt.transaction,
            timeout,
        )


def agree_on_store(
    store: dist.Store,
    index: int,
    participants: Sequence[int],
    digest: int,
    error: Optional[str],
    facts: Any,
    timeout: timedelta,
    merge: Optional[Merge] = None,
) -> Agreement:
    """
    Makes every participant agree to go ahead with the same merged facts, or
    every participant raise the same error, through ``store`` alone. Every
    participant calls it with the same ``participants`` and its own ``index``.

    Each caller makes O(1) store round trips of bounded size (the
    coordinator, ``index`` 0, also reads every post with one ``multi_get``).

    Args:
        store (dist.Store): the job's key-value store, or any object with its
            methods (``set``, ``get``, ``add``, ``append``, ``check``,
            ``wait``, ``compare_set``, ``delete_key``, ``multi_get``).
        index (int): this participant's position in ``participants``.
        participants (Sequence[int]): the participants' global ranks, in the
            order that numbers them; error messages name them by position
            ("reported by rank <index>", "ranks grouped by request") and
            missing ones by global rank.
        digest (int): digest of this participant's request.
        error (Optional[str]): this participant's validation error, if any.
        facts (Any): picklable facts this participant contributes.
        timeout (timedelta): how long any wait may take.
        merge (Optional[Merge]): called by the coordinator alone with every
            participant's facts, by index; returns the merged facts or raises
            :class:`ReshardError`, whose message becomes every participant's
            error. Default: the list of every participant's facts (whose size
            grows with the participants; pass a merge that reduces them to
            keep the store's bytes linear).

    Returns:
        Agreement: the transaction's name and the merged facts.

    Raises:
        ReshardAbortedError: on every participant that called, when some
            participant did not join within the timeout (naming its global
            rank), or left before every participant read the decision;
            nothing has moved.
        ReshardError: on every participant, with the same message, if the
            digests differ, any participant reported an error (the lowest
            index's) or ``merge`` raised.
    """
    participants = list(participants)
    size = len(participants)
    if not 0 <= index < size:
        raise ValueError(f"index {index} is not a position in {size} participants")
    attempt = _open_attempt(store, rendezvous_prefix(participants))
    _post(store, attempt, index, size, digest, error, facts)
    cause: Optional[BaseException] = None
    if index == 0:
        decision, cause = _coordinate(store, attempt, participants, timeout, merge)
    else:
        wait = timeout + _grace(timeout) * min(index, 2)
        decision = _await_decision(store, attempt, participants, timeout, wait)
    kind, payload = pickle.loads(decision)
    if kind == _ABORTED:
        # Posts stay: the coordinator may still be reading them. The next
        # attempt overwrites them.
        raise ReshardAbortedError(payload)
    store.delete_key(attempt.post(index))
    _wait_until_all_read(store, attempt, index, size, timeout)
    if kind == _ERROR:
        raise ReshardError(payload) from cause
    return Agreement(attempt.transaction, payload)


def agree_among_ranks(
    global_ranks: Sequence[int],
    digest: int,
    error: Optional[str],
    facts: Any,
    timeout: Optional[timedelta] = None,
    merge: Optional[Merge] = None,
) -> Agreement:
    """
    :func:`agree_on_store` among any ranks of the job, on the default process
    group's store, as this process's global rank (which must be one of
    ``global_ranks``). No process group over the ranks needs to exist.

    Args:
        global_ranks (Sequence[int]): the participants, in the order that
            numbers them.
        digest (int): digest of this rank's request.
        error (Optional[str]): this rank's validation error, if any.
        facts (Any): picklable facts this rank contributes.
        timeout (Optional[timedelta]): how long any wait may take (default:
            the default process group's backend's timeout).
        merge (Optional[Merge]): see :func:`agree_on_store`.

    Returns:
        Agreement: see :func:`agree_on_store`.

    Raises:
        ReshardAbortedError: see :func:`agree_on_store`.
        ReshardError: see :func:`agree_on_store`.
    """
    return agree_on_store(
        job_store(),
        list(global_ranks).index(dist.get_rank()),
        global_ranks,
        digest,
        error,
        facts,
        timeout or default_timeout(),
        merge,
    )


def job_store() -> dist.Store:
    """The store of the job's default process group, which every rank has."""
    world = dist.group.WORLD
    assert world is not None, "live resharding needs an initialised process group"
    return world.get_group_store()


def default_timeout() -> timedelta:
    """The library's default timeout of the default process group's backend."""
    if dist.get_backend() == dist.Backend.NCCL:
        return constants.default_pg_nccl_timeout or constants.default_pg_timeout
    return constants.default_pg_timeout
