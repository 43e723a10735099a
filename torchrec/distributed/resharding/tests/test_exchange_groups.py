#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The exchange group as NCCL needs it, in one process (a one-rank job, whose
group's backend records what the runner asks of it): a success shuts a
transaction's group down, a failure aborts it and never shuts it down; kept
groups (``ExchangeGroups``) connect once and serve the next transactions of
the same ranks, until a failure aborts and replaces them, at most
``max_groups`` of them (the least recently used evicted by abort), their
connects measured and budgeted, kept by the env on the default path; a
coalesced round calls the backend as torch binds it (a real gloo backend,
recorded and passed through, refuses coalescing); the device is normalised
once and
synchronised before the exchange touches kernel memory and before the commit,
with the devices of the state it reads (a move between CPU and GPU ranks
exchanges on the host yet reads CUDA kernels).
"""

import contextlib
import dataclasses
import unittest
from datetime import timedelta
from typing import Any, Iterator, List, Tuple
from unittest import mock

import torch
from torchrec.distributed.resharding import exchange_group
from torchrec.distributed.resharding.device_memory import (
    NCCL_COMMUNICATOR_BYTES,
    NCCL_PEER_BYTES,
)
from torchrec.distributed.resharding.devices import (
    normalized_device,
    synchronize_device,
)
from torchrec.distributed.resharding.elastic import state_devices
from torchrec.distributed.resharding.exchange_group import (
    _pair_order,
    ExchangeGroup,
    Message,
    open_exchange_group,
)
from torchrec.distributed.resharding.exchange_groups import (
    ExchangeGroups,
    keep_exchange_groups,
    kept_exchange_groups,
    same_kept_group,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardAbortedError
from torchrec.distributed.resharding.runner import communicator_budget, run_transaction
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.transaction_doubles import (
    CopyParticipant,
    env_keeping,
    RecordingBackend,
    RecordingGroups,
)
from torchrec.distributed.types import ShardingEnv


@contextlib.contextmanager
def _recording_groups(calls: List[str]) -> Iterator[None]:
    """
    A one-rank process group, the runner's exchange groups a double that
    records what the transaction does with them.

    Args:
        calls (List[str]): where the double records.

    Returns:
        Iterator[None]: while both last.
    """
    with single_rank_process_group():
        with mock.patch(
            "torchrec.distributed.resharding.runner.ExchangeGroups",
            return_value=RecordingGroups(calls),
        ):
            yield


TIMEOUT = timedelta(seconds=30)
CUDA0 = torch.device("cuda", 0)


class FailureSemanticsTest(unittest.TestCase):
    def test_a_success_shuts_the_transactions_group_down(self) -> None:
        calls: List[str] = []
        with _recording_groups(calls):
            report = run_transaction(CopyParticipant(calls))
        self.assertEqual(calls, ["build", "connect", "slots", "commit", "shutdown"])
        self.assertGreater(report.connect_seconds, 0.0)

    def test_a_failure_aborts_the_group_and_never_shuts_it_down(self) -> None:
        calls: List[str] = []
        with _recording_groups(calls):
            with self.assertRaisesRegex(ReshardAbortedError, "injected"):
                run_transaction(CopyParticipant(calls, fail=True))
        self.assertEqual(
            calls, ["build", "connect", "slots", "abort", "participant abort"]
        )


class KeptGroupsTest(unittest.TestCase):
    def test_one_connection_serves_every_transaction_of_the_ranks(self) -> None:
        with _one_rank_kept_groups() as (calls, groups):
            env = env_keeping(groups)
            first = CopyParticipant(calls, owner=env)
            a = run_transaction(first)
            b = run_transaction(CopyParticipant(calls, owner=env))
            self.assertTrue(torch.equal(first.new, first.old))
            self.assertEqual(groups.connected, 1)
            self.assertEqual(a.exchange_group, b.exchange_group)
            self.assertEqual(b.connect_seconds, 0.0)
            self.assertEqual(calls.count("shutdown") + calls.count("abort"), 0)
        # a kept group's members may be gone: closing aborts it
        self.assertEqual(calls.count("abort"), 1)
        self.assertEqual(calls.count("shutdown"), 0)

    def test_a_failure_replaces_the_kept_group(self) -> None:
        with _one_rank_kept_groups() as (calls, groups):
            env = env_keeping(groups)
            a = run_transaction(CopyParticipant(calls, owner=env))
            with self.assertRaises(ReshardAbortedError):
                run_transaction(CopyParticipant(calls, fail=True, owner=env))
            self.assertEqual(calls.count("abort"), 1)
            c = run_transaction(CopyParticipant(calls, owner=env))
            self.assertEqual(groups.connected, 2)
            self.assertNotEqual(a.exchange_group, c.exchange_group)
        self.assertEqual(calls.count("shutdown"), 0)
        self.assertEqual(calls.count("abort"), 2)

    def test_the_deprecated_option_still_names_the_groups(self) -> None:
        calls: List[str] = []
        groups = RecordingGroups(calls)
        with self.assertWarnsRegex(DeprecationWarning, "keep_exchange_groups"):
            options = ReshardOptions(exchange_groups=groups)
        with single_rank_process_group() as pg:
            env = ShardingEnv.from_process_group(pg)
            run_transaction(CopyParticipant(calls, owner=env), options)
            self.assertEqual(groups.connected, 1)
            self.assertEqual(kept_exchange_groups(env).connected, 0)
            groups.close()

    def test_groups_kept_anew_close_the_envs_former_ones(self) -> None:
        calls: List[str] = []
        first, second = RecordingGroups(calls), RecordingGroups(calls)
        with single_rank_process_group() as pg:
            env = ShardingEnv.from_process_group(pg)
            self.assertIs(keep_exchange_groups(env, first), first)
            run_transaction(CopyParticipant(calls, owner=env))
            self.assertEqual(calls.count("abort"), 0)
            keep_exchange_groups(env, second)
            self.assertIs(kept_exchange_groups(env), second)
            # the former groups are closed, which aborts their kept group
            self.assertEqual(calls.count("abort"), 1)
            self.assertEqual(first.kept_name([0], torch.device("cpu")), "")
            run_transaction(CopyParticipant(calls, owner=env))
            self.assertEqual((first.connected, second.connected), (1, 1))
            second.close()

    def test_a_new_timeout_reaches_the_kept_backend(self) -> None:
        calls: List[str] = []
        groups = RecordingGroups(calls)
        with single_rank_process_group():
            env = env_keeping(groups)
            for seconds in (30, 40):
                options = ReshardOptions(exchange_timeout=timedelta(seconds=seconds))
                run_transaction(CopyParticipant(calls, owner=env), options)
            groups.close()
        self.assertIn("set_timeout 40", calls)
        self.assertEqual(groups.connected, 1)

    def test_kept_groups_are_least_recently_used_and_evicted_by_abort(
        self,
    ) -> None:
        calls: List[str] = []
        groups = RecordingGroups(calls, max_groups=2, one_rank=True)
        cpu = torch.device("cpu")
        with single_rank_process_group():
            a = groups.open([0, 1], "a", TIMEOUT, cpu)
            groups.open([0, 2], "b", TIMEOUT, cpu)
            # a is used again: b is now the least recently used
            self.assertIs(groups.open([0, 1], "a2", TIMEOUT, cpu, reuse="a"), a)
            groups.open([0, 3], "c", TIMEOUT, cpu)
            self.assertEqual(calls.count("abort"), 1)
            self.assertEqual(groups.kept_name([0, 2], cpu), "")
            self.assertEqual(groups.kept_name([0, 1], cpu), "a")
            self.assertEqual(groups.kept_name([0, 3], cpu), "c")
            self.assertEqual((groups.connected, groups.evicted), (3, 1))
            groups.close()
        self.assertEqual(calls.count("abort"), 3)
        with self.assertRaises(ValueError):
            ExchangeGroups(max_groups=0)

    def test_a_connects_memory_is_measured_and_budgets_the_next(self) -> None:
        calls: List[str] = []
        groups = RecordingGroups(
            calls, one_rank=True, device=CUDA0, communicator_bytes=1234
        )
        with single_rank_process_group():
            # no group kept, nothing measured: the margin, and every peer new
            self.assertEqual(
                communicator_budget(groups, [0, 1, 2], CUDA0, [1, 2]),
                NCCL_COMMUNICATOR_BYTES + 2 * NCCL_PEER_BYTES,
            )
            groups.open([0, 1, 2], "a", TIMEOUT, CUDA0)
            self.assertEqual(groups.communicator_bytes, 1234)
            self.assertEqual(groups.measured_bytes(3, CUDA0), 1234)
            # kept: only the peers it never exchanged with
            self.assertEqual(
                communicator_budget(groups, [0, 1, 2], CUDA0, [1, 2]),
                2 * NCCL_PEER_BYTES,
            )
            groups.note_peers([0, 1, 2], CUDA0, [1])
            self.assertEqual(groups.new_peers([0, 1, 2], CUDA0, [1, 2]), 1)
            # other members of the same size: the measured connect
            self.assertEqual(communicator_budget(groups, [0, 2, 1], CUDA0, []), 1234)
            self.assertEqual(
                communicator_budget(groups, [0, 1, 2], torch.device("cpu"), [1]), 0
            )
            groups.close()

    def test_the_measured_connect_is_the_free_memory_it_took(self) -> None:
        with (
            single_rank_process_group(),
            mock.patch.object(
                exchange_group, "free_device_bytes", side_effect=[1000, 600]
            ),
        ):
            group = open_exchange_group([0], "measured", TIMEOUT)
            self.assertEqual(group.communicator_bytes, 400)
            group.close()

    def test_the_default_path_keeps_its_groups_in_the_env(self) -> None:
        calls: List[str] = []
        with single_rank_process_group() as pg:
            env = ShardingEnv.from_process_group(pg)
            a = run_transaction(CopyParticipant(calls, owner=env))
            b = run_transaction(CopyParticipant(calls, owner=env))
            kept = kept_exchange_groups(env)
            self.assertIs(kept_exchange_groups(env), kept)
            self.assertEqual(kept.connected, 1)
            self.assertEqual(a.exchange_group, b.exchange_group)
            self.assertEqual(b.connect_seconds, 0.0)
            self.assertEqual(kept.kept_name([0], torch.device("cpu")), a.exchange_group)
            # another env keeps its own
            other = ShardingEnv.from_process_group(pg)
            c = run_transaction(CopyParticipant(calls, owner=other))
            self.assertNotEqual(c.exchange_group, a.exchange_group)
            kept.close()
            kept_exchange_groups(other).close()

    def test_ranks_reuse_a_group_only_when_all_kept_it(self) -> None:
        self.assertEqual(same_kept_group(["t3", "t3", "t3"]), "t3")
        self.assertEqual(same_kept_group(["t3", "", "t3"]), "")
        self.assertEqual(same_kept_group(["t3", "t4"]), "")
        self.assertEqual(same_kept_group(["", ""]), "")


class CoalescingTest(unittest.TestCase):
    def test_a_coalesced_round_calls_the_backend_as_torch_binds_it(self) -> None:
        # gloo cannot coalesce: a call that binds meets its refusal, where one
        # with a device (a ProcessGroup's signature) would be a TypeError
        with single_rank_process_group():
            group = open_exchange_group([0], "coalesced", timedelta(seconds=10))
            backend = RecordingBackend(group.backend, [])
            coalesced = dataclasses.replace(group, backend=backend, coalesced=True)
            with self.assertRaisesRegex(
                RuntimeError, "does not implement startCoalescing"
            ):
                coalesced.post([Message(torch.zeros(1), 0, 0, send=True)])
            self.assertEqual(backend.log, [("_start_coalescing", (), {})])
            self.assertEqual(coalesced.post([]), [])
            self.assertEqual(len(backend.log), 1)

    def test_a_group_over_a_cuda_process_group_coalesces_with_the_device(
        self,
    ) -> None:
        with single_rank_process_group() as pg:
            over_cuda = ExchangeGroup.over(pg, device=torch.device("cuda", 0))
            self.assertTrue(over_cuda.coalesced)
            self.assertFalse(ExchangeGroup.over(pg).coalesced)
            # ProcessGroup._start_coalescing(device) binds (gloo refuses it)
            with self.assertRaisesRegex(
                RuntimeError, "does not implement startCoalescing"
            ):
                over_cuda.post([Message(torch.zeros(1), 0, 0, send=True)])

    def test_a_pairs_messages_meet_in_the_same_order_on_both_sides(self) -> None:
        t = torch.zeros(1)
        ordered = _pair_order(
            [
                Message(t, 2, 0, send=False),
                Message(t, 0, 0, send=True),
                Message(t, 2, 0, send=True),
                Message(t, 0, 0, send=False),
            ],
            rank=1,
        )
        # the lower rank of a pair posts its sends first
        self.assertEqual(
            [(m.peer, m.send) for m in ordered],
            [(0, False), (0, True), (2, True), (2, False)],
        )


@contextlib.contextmanager
def _one_rank_kept_groups() -> Iterator[Tuple[List[str], RecordingGroups]]:
    """
    A one-rank process group and exchange groups to keep that record, in one
    list, what the transactions do with them (closed at the end).

    Returns:
        Iterator[Tuple[List[str], RecordingGroups]]: the calls and the groups.
    """
    calls: List[str] = []
    groups = RecordingGroups(calls)
    with single_rank_process_group():
        yield calls, groups
        groups.close()


def _synchronisations_recorded(calls: List[str]) -> Any:
    """Records each device the runner synchronises in ``calls``."""
    return mock.patch(
        "torchrec.distributed.resharding.runner.synchronize_device",
        side_effect=lambda d: calls.append(f"synchronize {d}"),
    )


def _cuda_memory_of_a_machine_without_cuda() -> Any:
    """torch.cuda's memory figures, for a participant on a GPU this host lacks."""
    stack = contextlib.ExitStack()
    stack.enter_context(
        mock.patch(
            "torch.cuda.mem_get_info", autospec=True, return_value=(2**40, 2**40)
        )
    )
    stack.enter_context(
        mock.patch("torch.cuda.memory_allocated", autospec=True, return_value=0)
    )
    stack.enter_context(
        mock.patch("torch.cuda.max_memory_allocated", autospec=True, return_value=0)
    )
    return stack


class DeviceTest(unittest.TestCase):
    def test_cuda_without_index_is_the_current_device(self) -> None:
        with mock.patch("torch.cuda.current_device", autospec=True, return_value=3):
            self.assertEqual(
                normalized_device(torch.device("cuda")), torch.device("cuda", 3)
            )
            self.assertEqual(
                normalized_device(torch.device("cuda", 1)), torch.device("cuda", 1)
            )
        self.assertEqual(normalized_device(torch.device("cpu")), torch.device("cpu"))

    def test_only_a_cuda_device_is_synchronised(self) -> None:
        with mock.patch("torch.cuda.synchronize", autospec=True) as sync:
            synchronize_device(torch.device("cpu"))
            sync.assert_not_called()
            synchronize_device(torch.device("cuda", 2))
            sync.assert_called_once_with(torch.device("cuda", 2))

    def test_the_runner_synchronises_before_the_exchange_and_the_commit(
        self,
    ) -> None:
        # A one-rank exchange of local copies: the device is normalised once
        # and synchronised before the slots are read and before the commit.
        with (
            _one_rank_kept_groups() as (calls, groups),
            mock.patch("torch.cuda.current_device", autospec=True, return_value=1),
            _synchronisations_recorded(calls),
            _cuda_memory_of_a_machine_without_cuda(),
        ):
            env = env_keeping(groups)
            run_transaction(
                CopyParticipant(calls, device=torch.device("cuda"), owner=env)
            )
        self.assertEqual(
            calls,
            [
                "build",
                "synchronize cuda:1",
                "connect",
                "slots",
                "synchronize cuda:1",
                "commit",
                "abort",
            ],
        )


class _HostExchangeOfCudaState(CopyParticipant):
    """Exchanges on the host while its state lives on a GPU (a mixed move)."""

    def state_devices(self) -> List[torch.device]:
        return [torch.device("cuda", 1), self.device()]


class MixedDeviceTest(unittest.TestCase):
    def test_the_state_devices_are_synchronised_not_only_the_exchanges(
        self,
    ) -> None:
        with (
            _one_rank_kept_groups() as (calls, groups),
            _synchronisations_recorded(calls),
        ):
            run_transaction(_HostExchangeOfCudaState(calls, owner=env_keeping(groups)))
        before_exchange = ["synchronize cuda:1", "synchronize cpu"]
        self.assertEqual(
            calls,
            ["build", *before_exchange, "connect", "slots", *before_exchange]
            + ["commit", "abort"],
        )

    def test_a_mixed_move_synchronises_the_models_device(self) -> None:
        cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
        self.assertEqual(state_devices(cuda, cpu), [cuda, cpu])
        self.assertEqual(state_devices(cuda, cuda), [cuda])
        self.assertEqual(state_devices(cpu, cpu), [cpu])


if __name__ == "__main__":
    unittest.main()
