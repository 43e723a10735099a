#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: the incremental rebalancing search, run every window on every rank.

It takes the slowest rank and moves one of its movable shards to one of the
least loaded ranks, or swaps one with a cheaper shard there: the move whose
two ranks end lowest, each byte moved priced at ``byte_price`` seconds per
step (its move time over the policy's horizon: among cuts about as good the
fewer bytes win, and a move that does not pay for its bytes is not made),
never over a rank's memory, never two shards of a table on one rank, within
``move_budget`` bytes per rank; and again, until the slowest rank cannot be
cut. Ties go to the lowest index, so every rank gets the same moves from the
same statistics. Each move costs a few heap operations over the ranks and a
scan of one rank's shards against a handful of receivers.
"""

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from torchrec.distributed.resharding.rebalance.placement import ShardUnit

RECEIVERS: int = 8  # the least loaded ranks tried per move, and per swap
SWAP_RECEIVERS: int = 4


@dataclass(frozen=True)
class SearchResult:
    """
    What the search found.

    Args:
        moves (Tuple[Tuple[int, int], ...]): (unit index, destination rank)
            of every unit that ends on another rank than it started, by unit.
        loads (Tuple[float, ...]): per rank, the predicted load after.
        slowest_before (float): the slowest rank's load before.
        slowest_after (float): the same after the moves.
        lower_bound (float): no placement of these shards (none split) gets
            the slowest rank below this.
        mean_load (float): the mean rank load (what splitting shards could
            reach at best).
        rank_bytes (Tuple[int, ...]): per rank, bytes sent plus received.
        steps (int): moves and swaps made (a unit may move more than once).
    """

    moves: Tuple[Tuple[int, int], ...]
    loads: Tuple[float, ...]
    slowest_before: float
    slowest_after: float
    lower_bound: float
    mean_load: float
    rank_bytes: Tuple[int, ...]
    steps: int

    @property
    def gain(self) -> float:
        """1 - slowest after / slowest before (0 when nothing is loaded)."""
        if self.slowest_before <= 0:
            return 0.0
        return 1.0 - self.slowest_after / self.slowest_before

    @property
    def max_rank_bytes(self) -> int:
        return max(self.rank_bytes, default=0)


def lower_bound(
    loads: Sequence[float], units: Sequence[ShardUnit], costs: Sequence[float]
) -> float:
    """
    A bound no placement of the movable units reaches below: the mean load,
    the immovable part of any rank, and the costliest unit on the least
    loaded immovable part.
    """
    fixed = [float(v) for v in loads]
    for unit, cost in zip(units, costs):
        if unit.movable:
            fixed[unit.rank] -= cost
    world_size = max(len(loads), 1)
    mean = sum(loads) / world_size
    biggest = max((c for u, c in zip(units, costs) if u.movable), default=0.0)
    return max(mean, max(fixed, default=0.0), biggest + min(fixed, default=0.0))


class LoadHeaps:
    """
    Per rank loads with the slowest rank and the least loaded ones at hand
    (two heaps with lazy deletion), for the searches that cut the slowest
    rank step by step.

    Args:
        loads (Sequence[float]): per rank, its load.
    """

    def __init__(self, loads: Sequence[float]) -> None:
        self.load: List[float] = [float(v) for v in loads]
        self.high: List[Tuple[float, int]] = [(-v, r) for r, v in enumerate(self.load)]
        self.low: List[Tuple[float, int]] = [(v, r) for r, v in enumerate(self.load)]
        heapq.heapify(self.high)
        heapq.heapify(self.low)

    def slowest(self) -> int:
        """The rank with the largest load (the lowest index among equals)."""
        high, load = self.high, self.load
        while -high[0][0] != load[high[0][1]]:
            heapq.heappop(high)
        return high[0][1]

    def least_loaded(self, count: int, skip: int) -> List[int]:
        """Up to ``count`` ranks of the smallest loads, ``skip`` left out."""
        low, load = self.low, self.load
        out: List[int] = []
        kept: List[Tuple[float, int]] = []
        seen: Set[int] = set()
        while low and len(out) < count:
            value, rank = heapq.heappop(low)
            if value != load[rank] or rank in seen:
                continue
            seen.add(rank)
            kept.append((value, rank))
            if rank != skip:
                out.append(rank)
        for entry in kept:
            heapq.heappush(low, entry)
        return out

    def set_load(self, rank: int, value: float) -> None:
        """Sets a rank's load."""
        self.load[rank] = value
        heapq.heappush(self.high, (-value, rank))
        heapq.heappush(self.low, (value, rank))


class _Search(LoadHeaps):
    """The search's mutable state; ``run`` does the work."""

    def __init__(
        self,
        loads: Sequence[float],
        units: Sequence[ShardUnit],
        costs: Sequence[float],
        capacity: Sequence[float],
        byte_price: float,
        move_budget: Optional[int],
        min_cut: float,
    ) -> None:
        super().__init__(loads)
        world_size = len(loads)
        self.units = units
        self.costs = costs
        self.capacity = capacity
        self.byte_price = byte_price
        self.move_budget = move_budget
        self.min_cut = min_cut
        self.used: List[int] = [0] * world_size
        self.on: List[List[int]] = [[] for _ in range(world_size)]
        self.where: List[int] = [u.rank for u in units]
        self.holders: Dict[int, Dict[int, int]] = {}
        self.traffic: List[int] = [0] * world_size
        for i, unit in enumerate(units):
            self.used[unit.rank] += unit.nbytes
            ranks = self.holders.setdefault(unit.table, {})
            ranks[unit.rank] = ranks.get(unit.rank, 0) + 1
            if unit.movable and costs[i] > 0:
                self.on[unit.rank].append(i)

    def fits(self, i: int, dst: int, freed: int = 0) -> bool:
        unit = self.units[i]
        if self.holders[unit.table].get(dst):
            return False
        return self.used[dst] + unit.nbytes - freed <= self.capacity[dst]

    def traffic_delta(self, i: int, dst: int) -> Dict[int, int]:
        """Change of each rank's bytes sent plus received if unit i goes to dst."""
        unit = self.units[i]
        origin, now, nbytes = unit.rank, self.where[i], unit.nbytes
        delta: Dict[int, int] = {}
        if now != origin:
            delta[origin] = delta.get(origin, 0) - nbytes
            delta[now] = delta.get(now, 0) - nbytes
        if dst != origin:
            delta[origin] = delta.get(origin, 0) + nbytes
            delta[dst] = delta.get(dst, 0) + nbytes
        return delta

    def within_budget(self, *deltas: Dict[int, int]) -> bool:
        if self.move_budget is None:
            return True
        total: Dict[int, int] = {}
        for delta in deltas:
            for rank, value in delta.items():
                total[rank] = total.get(rank, 0) + value
        return all(
            self.traffic[r] + v <= self.move_budget for r, v in total.items() if v > 0
        )

    def moved_bytes(self, i: int, dst: int) -> int:
        """Bytes the plan moves more (or less) if unit i goes to dst."""
        unit = self.units[i]
        before = unit.nbytes if self.where[i] != unit.rank else 0
        after = unit.nbytes if dst != unit.rank else 0
        return after - before

    def place(self, i: int, dst: int) -> None:
        unit, src = self.units[i], self.where[i]
        for rank, value in self.traffic_delta(i, dst).items():
            self.traffic[rank] += value
        self.on[src].remove(i)
        self.on[dst].append(i)
        holders = self.holders[unit.table]
        holders[src] -= 1
        holders[dst] = holders.get(dst, 0) + 1
        self.used[src] -= unit.nbytes
        self.used[dst] += unit.nbytes
        self.where[i] = dst

    def best_move(
        self, s: int, receivers: Sequence[int]
    ) -> Optional[Tuple[float, int, int, int]]:
        """(score, unit, receiver, -1) of the best single move off rank s."""
        top = self.load[s]
        ceiling = top * (1.0 - self.min_cut)
        load, price = self.load, self.byte_price
        best: Optional[Tuple[float, int, int, int]] = None
        for i in self.on[s]:
            cost = self.costs[i]
            if top - cost >= ceiling:
                continue
            for d in receivers:  # least loaded first
                after = load[d] + cost
                if after >= ceiling:
                    break
                pair = after if after > top - cost else top - cost
                score = pair + price * self.moved_bytes(i, d) if price else pair
                if score >= ceiling or (best is not None and (score, i, d) >= best[:3]):
                    continue
                if not self.fits(i, d):
                    continue
                if self.move_budget is not None and not self.within_budget(
                    self.traffic_delta(i, d)
                ):
                    continue
                best = (score, i, d, -1)
        return best

    def best_swap(
        self, s: int, receivers: Sequence[int]
    ) -> Optional[Tuple[float, int, int, int]]:
        """(score, unit, receiver, its unit) of the best swap off rank s."""
        top = self.load[s]
        ceiling = top * (1.0 - self.min_cut)
        best: Optional[Tuple[float, int, int, int]] = None
        for d in receivers[:SWAP_RECEIVERS]:
            for i in self.on[s]:
                unit = self.units[i]
                for j in self.on[d]:
                    other = self.units[j]
                    cut = self.costs[i] - self.costs[j]
                    if cut <= 0 or self.load[d] + cut >= ceiling:
                        continue
                    if other.table == unit.table:
                        continue
                    if not (
                        self.fits(i, d, freed=other.nbytes)
                        and self.fits(j, s, freed=unit.nbytes)
                    ):
                        continue
                    pair = max(top - cut, self.load[d] + cut)
                    moved = self.moved_bytes(i, d) + self.moved_bytes(j, s)
                    score = pair + self.byte_price * moved
                    if score >= ceiling or not self.within_budget(
                        self.traffic_delta(i, d), self.traffic_delta(j, s)
                    ):
                        continue
                    candidate = (score, i, d, j)
                    if best is None or candidate < best:
                        best = candidate
        return best

    def run(self, floor: float, max_steps: int) -> int:
        steps = 0
        while steps < max_steps:
            s = self.slowest()
            if self.load[s] <= floor:
                break
            receivers = self.least_loaded(RECEIVERS, s)
            best = self.best_move(s, receivers) or self.best_swap(s, receivers)
            if best is None:
                break
            _, i, d, j = best
            cost_i = self.costs[i]
            cost_j = self.costs[j] if j >= 0 else 0.0
            self.place(i, d)
            if j >= 0:
                self.place(j, s)
            self.set_load(s, self.load[s] - cost_i + cost_j)
            self.set_load(d, self.load[d] + cost_i - cost_j)
            steps += 1
        return steps


def search_moves(
    loads: Sequence[float],
    units: Sequence[ShardUnit],
    costs: Sequence[float],
    capacity: Sequence[float],
    byte_price: float = 0.0,
    move_budget: Optional[int] = None,
    min_cut: float = 0.005,
    max_steps: Optional[int] = None,
) -> SearchResult:
    """
    Moves and swaps of movable units that cut the slowest rank's load.

    Args:
        loads (Sequence[float]): per rank, its load now (seconds per step).
        units (Sequence[ShardUnit]): every shard (``Placement.units``).
        costs (Sequence[float]): per unit, its share of its rank's load.
        capacity (Sequence[float]): per rank, the most bytes it may hold
            (a rank already over it may only give).
        byte_price (float): seconds per step one byte moved costs.
        move_budget (Optional[int]): the most bytes a rank may send plus
            receive (None: no limit).
        min_cut (float): the least relative cut of the slowest rank a step
            must make.
        max_steps (Optional[int]): the most moves and swaps (default: 4 per
            unit plus the ranks).

    Returns:
        SearchResult: the net moves and the loads after them.
    """
    if not (len(units) == len(costs)):
        raise ValueError(f"{len(units)} units but {len(costs)} costs")
    if not (len(loads) == len(capacity)):
        raise ValueError(f"{len(loads)} loads but {len(capacity)} capacities")
    bound = lower_bound(loads, units, costs)
    before = max(loads, default=0.0)
    search = _Search(loads, units, costs, capacity, byte_price, move_budget, min_cut)
    steps = 0
    if loads and before > 0:
        limit = max_steps if max_steps is not None else 4 * len(units) + len(loads)
        steps = search.run(bound * (1.0 + 1e-9), limit)
    moves = tuple(
        (i, rank) for i, rank in enumerate(search.where) if rank != units[i].rank
    )
    return SearchResult(
        moves=moves,
        loads=tuple(search.load),
        slowest_before=before,
        slowest_after=max(search.load, default=0.0),
        lower_bound=bound,
        mean_load=sum(loads) / max(len(loads), 1),
        rank_bytes=tuple(search.traffic),
        steps=steps,
    )
