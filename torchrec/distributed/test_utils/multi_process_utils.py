#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Helpers for tests of sharded modules: TorchRec's ``MultiProcessContext`` with
collectives that time out (so that no test hangs forever), a one-rank process
group inside the test process, a multi-process test base whose ranks get the test's master port, a
sharded module's full weights gathered from every rank with plain
collectives (independent of the code under test), and one kernel's worth of
whole tables as TorchRec groups them (to build batched kernels in one
process).
"""

import contextlib
import os
import socket
from datetime import timedelta
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._tensor import DTensor
from torchrec.distributed.embedding_sharding import group_tables
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)
from torchrec.distributed.test_utils.multi_process import (
    MultiProcessContext,
    MultiProcessTestBase,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import DataType, PoolingType


class BoundedMultiProcessContext(MultiProcessContext):
    """
    TorchRec's :class:`MultiProcessContext` whose collectives time out, so that
    no test can hang forever, and whose NCCL group connects at once, bound to
    the rank's GPU. NCCL when there are enough GPUs, gloo on CPU otherwise; one
    intra-op thread per rank. Inside the context, ``pg`` is the world's group,
    ``env`` its ShardingEnv and ``device`` the rank's device.

    Args:
        rank (int): this rank.
        world_size (int): number of ranks.
        port (str): master port.
        local_size (Optional[int]): ranks per host (for TWRW and grid).
        timeout_s (float): timeout of every collective.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: str,
        local_size: Optional[int] = None,
        timeout_s: float = 120.0,
    ) -> None:
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = port
        use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        super().__init__(
            rank,
            world_size,
            backend="nccl" if use_cuda else "gloo",
            local_size=local_size,
            use_deterministic_algorithms=False,
        )
        self.timeout = timedelta(seconds=timeout_s)

    def __enter__(self) -> "BoundedMultiProcessContext":
        local_size = self.local_size or self.world_size
        os.environ["LOCAL_WORLD_SIZE"] = str(local_size)
        os.environ["LOCAL_RANK"] = str(self.rank % local_size)
        dist.init_process_group(
            self.backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self.pg = dist.group.WORLD
        self.env: ShardingEnv = ShardingEnv.from_process_group(self.pg)
        return self


def free_port() -> str:
    """A TCP port free on localhost now (for a one-rank job in this process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return str(s.getsockname()[1])


@contextlib.contextmanager
def single_rank_process_group() -> Iterator[dist.ProcessGroup]:
    """
    A gloo process group of one rank in this process (an in-memory store, no
    port), for one-process tests of code that needs a process group, such as
    building fused kernels. It is the default group until the context ends.

    Returns:
        Iterator[dist.ProcessGroup]: the group.
    """
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def alone_on_subgroups(
    rank: int, world_size: int, port: str, timeout: timedelta
) -> Iterator[ShardingEnv]:
    """
    A bounded multi-process context in which every rank has a process group
    of its own (created by every rank, in rank order).

    Args:
        rank (int): this rank.
        world_size (int): the world size.
        port (str): the rendezvous port.
        timeout (timedelta): the timeout of every collective.

    Returns:
        Iterator[ShardingEnv]: the environment over this rank's own group.
    """
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=timeout.seconds):
        groups = [dist.new_group([r], timeout=timeout) for r in range(world_size)]
        yield ShardingEnv.from_process_group(groups[rank])


class MultiRankTestBase(MultiProcessTestBase):
    """MultiProcessTestBase whose ranks get the test's master port explicitly
    (forkserver children do not see later changes of the parent's env)."""

    def run_ranks(
        self, callable: Callable[..., None], world_size: int = 2, **kwargs: Any
    ) -> None:
        """Runs ``callable(rank=, world_size=, port=, **kwargs)`` on every rank."""
        self._run_multi_process_test(
            callable=callable,
            world_size=world_size,
            port=os.environ["MASTER_PORT"],
            **kwargs,
        )


class NcclOrGlooTestBase(MultiProcessTestBase):
    """MultiProcessTestBase whose ranks run on NCCL where the machine has a
    GPU for each of them, on gloo elsewhere."""

    def run_on_ranks(
        self, callable: Callable[..., None], world_size: int, **kwargs: Any
    ) -> None:
        """Runs ``callable(rank=, world_size=, backend=, **kwargs)`` on every rank."""
        backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
        self._run_multi_process_test(
            callable=callable, world_size=world_size, backend=backend, **kwargs
        )


def local_pieces(value: Any) -> List[Tuple[Tuple[int, int], torch.Tensor]]:
    """
    Args:
        value (Any): a state-dict value.

    Returns:
        List[Tuple[Tuple[int, int], torch.Tensor]]: (row and column offset,
        tensor) of every local shard of a ShardedTensor or a DTensor; none for
        anything else.
    """
    if isinstance(value, ShardedTensor):
        return [
            (tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()
        ]
    if isinstance(value, DTensor):
        wrapper = value._local_tensor
        return [
            (tuple(offset), tensor)
            for tensor, offset in zip(wrapper.local_shards(), wrapper.local_offsets())
        ]
    return []


def global_weights(module: nn.Module, pg: dist.ProcessGroup) -> Dict[str, torch.Tensor]:
    """
    Every table's full weight, assembled from every rank's local shards with an
    all-reduce (each element has one owner; data-parallel tables are local).

    Args:
        module (nn.Module): a sharded module (or a model holding some).
        pg (dist.ProcessGroup): its process group.

    Returns:
        Dict[str, torch.Tensor]: state-dict key -> full tensor, in the table dtype.
    """
    out: Dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        if isinstance(value, (ShardedTensor, DTensor)):
            full = torch.zeros(value.size(), dtype=torch.float64)
            for (row, col), tensor in local_pieces(value):
                full[row : row + tensor.shape[0], col : col + tensor.shape[1]] = (
                    tensor.to("cpu", torch.float64)
                )
            dist.all_reduce(full, group=pg)
            dtype = (
                value.metadata().tensor_properties.dtype
                if isinstance(value, ShardedTensor)
                else value.dtype
            )
            out[key] = full.to(dtype)
        else:
            out[key] = value.detach().to("cpu").clone()
    return out


def grouped_config(
    names: Sequence[str],
    fused_params: Mapping[str, Any],
    rows: int = 8,
    cols: int = 4,
    kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED,
) -> GroupedEmbeddingConfig:
    """
    One batched kernel's worth of whole FP32 tables on rank 0 of a CPU job, as
    TorchRec's ``group_tables`` groups them.

    Args:
        names (Sequence[str]): the tables ("f_<name>" is each one's feature).
        fused_params (Mapping[str, Any]): every table's fused params.
        rows (int): rows of each table.
        cols (int): columns of each table.
        kernel (EmbeddingComputeKernel): their compute kernel.

    Returns:
        GroupedEmbeddingConfig: the kernel's config.
    """
    tables = []
    for name in names:
        metadata = ShardMetadata([0, 0], [rows, cols], "rank:0/cpu")
        tables.append(
            ShardedEmbeddingTable(
                name=name,
                num_embeddings=rows,
                embedding_dim=cols,
                feature_names=[f"f_{name}"],
                data_type=DataType.FP32,
                pooling=PoolingType.SUM,
                compute_kernel=kernel,
                local_rows=rows,
                local_cols=cols,
                local_metadata=metadata,
                global_metadata=ShardedTensorMetadata(
                    shards_metadata=[metadata],
                    size=torch.Size([rows, cols]),
                    tensor_properties=TensorProperties(dtype=torch.float32),
                ),
                fused_params=dict(fused_params),
            )
        )
    ((config,),) = group_tables([tables])
    return config
