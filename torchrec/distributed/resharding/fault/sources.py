#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: where a lost rank's shards come back from, best first.

* **replica**: a data-parallel table lives whole on every survivor: nothing
  of it is lost;
* **snapshot**: a buddy holds the lost rank's shards as of its last
  snapshot (``snapshot``): the updates since that step are lost;
* **checkpoint**: the last checkpoint (``checkpoint``) holds every shard as
  of its step: only the lost pieces are read, each by the survivor that
  will hold it, and the updates since its step are lost.

Every survivor states what it holds (:class:`SourceFacts`); the coordinator
picks, for every lost shard, the best source (:func:`choose_sources`) or
names the tables no source covers (:class:`UnrecoverableLossError`, raised
by every survivor). The recovery then sees each lost shard as pieces on the
survivors that hold their bytes (:func:`recovery_old_layouts`): the engine
moves them like any shard.
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.resharding.fault.options import (
    CHECKPOINT,
    REPLICA,
    SNAPSHOT,
    UnrecoverableLossError,
)
from torchrec.distributed.resharding.fault.recovery_plan import LostShard, RecoveryPlan
from torchrec.distributed.resharding.fields import Field, piece_cost
from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.whole_plan import plan_layouts, TableShape
from torchrec.distributed.types import ShardingPlan

# a table's fields, by table key, as picklable pairs
FieldsByTable = Tuple[Tuple[str, Tuple[Field, ...]], ...]


@dataclass(frozen=True)
class SnapshotOffer:
    """
    A buddy's snapshot of another rank's shards.

    Args:
        of_rank (int): the global rank whose shards it holds.
        step (int): the step it was taken after.
        plan (int): digest of the model's plan it was taken under.
        shards (Tuple[Tuple[str, Rect], ...]): (table key, shard) held.
        fields (FieldsByTable): the fields each table's shards carry.
    """

    of_rank: int
    step: int
    plan: int
    shards: Tuple[Tuple[str, Rect], ...]
    fields: FieldsByTable = ()


@dataclass(frozen=True)
class CheckpointRecord:
    """
    A checkpoint every rank saved (``checkpoint.save_checkpoint``).

    Args:
        checkpoint_id (str): where it is (DCP's checkpoint id).
        step (int): the step it was taken after.
        shards (Tuple[Tuple[str, Rect], ...]): every saved shard, every rank's.
        fields (FieldsByTable): the fields each table's shards carry.
    """

    checkpoint_id: str
    step: int
    shards: Tuple[Tuple[str, Rect], ...]
    fields: FieldsByTable = ()


@dataclass(frozen=True)
class SourceFacts:
    """
    What a survivor states before its lost peers' shards are restored.

    Args:
        step (int): the steps it completed.
        plan (int): digest of its model's plan.
        snapshots (Tuple[SnapshotOffer, ...]): snapshots it holds.
        checkpoint (Optional[CheckpointRecord]): the last checkpoint it saved.
    """

    step: int
    plan: int
    snapshots: Tuple[SnapshotOffer, ...] = ()
    checkpoint: Optional[CheckpointRecord] = None


@dataclass(frozen=True)
class SourcePiece:
    """
    A piece of a lost shard and where its bytes are at the recovery.

    Args:
        key (str): the table, "module path:table".
        rect (Rect): the piece, in table coordinates.
        shard (Rect): the lost shard it is a piece of.
        kind (str): "snapshot" or "checkpoint".
        holder (int): the global rank that holds its bytes (the buddy, or
            the survivor that reads it from the checkpoint and keeps it).
        origin (Rect): the source's shard it is cut from (the snapshot's
            shard, the checkpoint's saved shard).
        step (int): the step its bytes are from.
    """

    key: str
    rect: Rect
    shard: Rect
    kind: str
    holder: int
    origin: Rect
    step: int


@dataclass(frozen=True)
class AgreedSources:
    """
    The sources of a recovery, the same on every survivor.

    Args:
        survivors (Tuple[int, ...]): global ranks, ascending.
        lost_ranks (Tuple[int, ...]): global ranks lost.
        failure_step (int): the most steps a survivor completed.
        pieces (Tuple[SourcePiece, ...]): every lost shard's pieces.
        replicated (Tuple[str, ...]): the data-parallel tables (replicas).
        fields (FieldsByTable): the fields of the tables of ``pieces``.
        checkpoint (Optional[CheckpointRecord]): the checkpoint read from.
        replica_bytes (int): bytes of the lost ranks' replicas (nothing
            moves for them: the survivors hold the same).
        uncovered (Tuple[str, ...]): the tables a lost shard of which no
            source covers (then the job stops: :meth:`check_covered`).
        sources (Tuple[str, ...]): the configured sources.
    """

    survivors: Tuple[int, ...]
    lost_ranks: Tuple[int, ...]
    failure_step: int
    pieces: Tuple[SourcePiece, ...]
    replicated: Tuple[str, ...]
    fields: FieldsByTable = ()
    checkpoint: Optional[CheckpointRecord] = None
    replica_bytes: int = 0
    uncovered: Tuple[str, ...] = ()
    sources: Tuple[str, ...] = ()

    def check_covered(self) -> None:
        """
        Raises:
            UnrecoverableLossError: naming the tables no source covers (the
                same on every survivor).
        """
        if not self.uncovered:
            return
        raise UnrecoverableLossError(
            f"ranks {list(self.lost_ranks)} held the only copy of shards of tables "
            f"{list(self.uncovered)}, which no configured source "
            f"({', '.join(self.sources) or 'none'}) covers: the job stops (nothing "
            "is re-initialised; the survivors' state can be saved, and the job "
            "restarted from a checkpoint)",
            self.uncovered,
        )

    def held_by(self, rank: int) -> List[SourcePiece]:
        """The pieces whose bytes ``rank`` provides."""
        return [p for p in self.pieces if p.holder == rank]

    def fields_of(self, key: str) -> Tuple[Field, ...]:
        return dict(self.fields).get(key, ())

    def bytes_by_source(self) -> Dict[str, int]:
        """Bytes restored from each source (a replica's: covered in place)."""
        out = {REPLICA: self.replica_bytes} if self.replicated else {}
        for p in self.pieces:
            cost = piece_cost(self.fields_of(p.key))
            nbytes = (
                p.rect.numel * cost.per_element
                + p.rect.rows * cost.per_row
                + cost.per_piece
            )
            out[p.kind] = out.get(p.kind, 0) + nbytes
        return out

    def steps_lost(self) -> Dict[str, int]:
        """Steps of updates each source used loses."""
        out = {REPLICA: 0} if self.replicated else {}
        for p in self.pieces:
            out[p.kind] = max(out.get(p.kind, 0), self.failure_step - p.step)
        return out

    def text(self) -> str:
        """Canonical text (for the recovery's request digest)."""
        return repr((self.survivors, self.lost_ranks, self.pieces))


def _snapshot_index(
    facts: Sequence[SourceFacts], survivors: Sequence[int], plan: int
) -> Dict[Tuple[int, str, Rect], Tuple[int, SnapshotOffer]]:
    """(lost rank, table, shard) -> (holder, the newest offer), current plan."""
    index: Dict[Tuple[int, str, Rect], Tuple[int, SnapshotOffer]] = {}
    for holder, rank_facts in zip(survivors, facts):
        for offer in rank_facts.snapshots:
            if offer.plan != plan:
                continue  # taken under another plan: its shards are others
            for key, rect in offer.shards:
                best = index.get((offer.of_rank, key, rect))
                if best is None or best[1].step < offer.step:
                    index[(offer.of_rank, key, rect)] = (holder, offer)
    return index


def _newest_checkpoint(facts: Sequence[SourceFacts]) -> Optional[CheckpointRecord]:
    records = [f.checkpoint for f in facts if f.checkpoint is not None]
    return max(records, key=lambda r: r.step) if records else None


def _checkpoint_pieces(
    lost: LostShard,
    new_layout: TableLayout,
    record: CheckpointRecord,
) -> Optional[List[SourcePiece]]:
    """
    The pieces of a lost shard read from a checkpoint, each by the survivor
    that holds it under the new plan; None when the checkpoint misses a part.
    """
    saved = [rect for key, rect in record.shards if key == lost.key]
    pieces: List[SourcePiece] = []
    for shard in new_layout.shards:
        wanted = lost.rect.intersect(shard.rect)
        if wanted is None:
            continue
        for origin in saved:
            piece = wanted.intersect(origin)
            if piece is not None:
                pieces.append(
                    SourcePiece(
                        lost.key,
                        piece,
                        lost.rect,
                        CHECKPOINT,
                        shard.rank,
                        origin,
                        record.step,
                    )
                )
    if sum(p.rect.numel for p in pieces) != lost.rect.numel:
        return None
    return pieces


def choose_sources(
    recovery: RecoveryPlan,
    facts: Sequence[SourceFacts],
    sources: Sequence[str],
    plan: int,
    replica_bytes: int = 0,
) -> AgreedSources:
    """
    Run by the coordinator: the best source of every lost shard.

    Args:
        recovery (RecoveryPlan): the plan on the survivors.
        facts (Sequence[SourceFacts]): every survivor's facts, by position.
        sources (Sequence[str]): the configured sources.
        plan (int): digest of the model's plan (snapshots must be of it).
        replica_bytes (int): bytes of the lost ranks' replicas.

    Returns:
        AgreedSources: the sources, the same for everyone, with the tables
        no source covers (:meth:`AgreedSources.check_covered`).
    """
    survivors = recovery.survivors
    snapshots = _snapshot_index(facts, survivors, plan) if SNAPSHOT in sources else {}
    record = _newest_checkpoint(facts) if CHECKPOINT in sources else None
    pieces: List[SourcePiece] = []
    fields: Dict[str, Tuple[Field, ...]] = {}
    uncovered: List[str] = []
    for lost in recovery.lost:
        found = snapshots.get((lost.rank, lost.key, lost.rect))
        if found is not None:
            holder, offer = found
            pieces.append(
                SourcePiece(
                    lost.key,
                    lost.rect,
                    lost.rect,
                    SNAPSHOT,
                    holder,
                    lost.rect,
                    offer.step,
                )
            )
            fields.setdefault(lost.key, dict(offer.fields)[lost.key])
            continue
        restored = (
            _checkpoint_pieces(lost, recovery.new_layouts[lost.key], record)
            if record is not None
            else None
        )
        if restored is not None and record is not None:
            pieces += restored
            fields.setdefault(lost.key, dict(record.fields)[lost.key])
            continue
        uncovered.append(lost.key)
    return AgreedSources(
        survivors=survivors,
        lost_ranks=recovery.lost_ranks,
        failure_step=max((f.step for f in facts), default=0),
        pieces=tuple(pieces),
        replicated=recovery.replicated,
        fields=tuple(sorted(fields.items())),
        checkpoint=record if any(p.kind == CHECKPOINT for p in pieces) else None,
        replica_bytes=replica_bytes,
        uncovered=tuple(sorted(set(uncovered))),
        sources=tuple(sources),
    )


def recovery_old_layouts(
    old_plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    old_ranks: Sequence[int],
    participants: Sequence[int],
    sources: AgreedSources,
) -> Dict[str, TableLayout]:
    """
    Every table's layout before the recovery, in the recovery's ranks
    (positions in ``participants``): the survivors' shards where they are,
    each lost shard as its source pieces on their holders, a data-parallel
    table on every survivor.

    Args:
        old_plan (ShardingPlan): the model's plan on its old group.
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        old_ranks (Sequence[int]): the global rank of each old group rank.
        participants (Sequence[int]): the survivors, ascending.
        sources (AgreedSources): the agreed sources.

    Returns:
        Dict[str, TableLayout]: "path:table" -> layout.
    """
    position = {g: i for i, g in enumerate(participants)}
    pieces: Dict[Tuple[str, Rect], List[SourcePiece]] = {}
    for piece in sources.pieces:
        pieces.setdefault((piece.key, piece.shard), []).append(piece)
    out: Dict[str, TableLayout] = {}
    for key, layout in plan_layouts(old_plan, tables, list(old_ranks)).items():
        shards: List[PlacedShard] = []
        for s in layout.shards:
            if s.rank in position:
                shards.append(PlacedShard(position[s.rank], s.rect))
            elif not layout.replicated:
                shards += [
                    PlacedShard(position[p.holder], p.rect)
                    for p in pieces[(key, s.rect)]
                ]
        out[key] = TableLayout(
            layout.rows, layout.cols, tuple(shards), layout.replicated
        )
    return out
