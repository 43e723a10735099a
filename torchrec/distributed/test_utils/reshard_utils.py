#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Test helpers for live resharding: plans from compact specs, a global view of a
sharded EBC's weights and fused optimizer state (gathered with collectives,
independent of the resharding code), loading that view into a module sharded
directly with another plan, and exact comparisons. The process group, the
test base and ``global_weights`` come from ``multi_process_utils``.
"""

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
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from hypothesis import HealthCheck, Phase, settings, Verbosity
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed._tensor import DTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    placement,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import (  # noqa: F401
    make_ebc,
    numbered_tables,
)
from torchrec.distributed.test_utils.multi_process_utils import (  # noqa: F401
    BoundedMultiProcessContext,
    global_weights,
    local_pieces,
    MultiRankTestBase,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# A table's sharding in a test: (sharding type, arguments).
#   ("table_wise", rank) ("column_wise", [ranks]) ("row_wise", None)
#   ("table_row_wise", host) ("grid_shard", [hosts]) ("data_parallel", None)
#   ("table_column_wise", [ranks]) and ("custom", (type, [(row, col, rows, cols, rank)]))
TableSpec = Tuple[str, Any]

# The mixed plan of three tables many tests start from (or add tables to):
# t0 table-wise on rank 0, t1 column-wise over ranks 0 and 1, t2 row-wise.
TW_CW_RW: Dict[str, TableSpec] = {
    "t0": ("table_wise", 0),
    "t1": ("column_wise", [0, 1]),
    "t2": ("row_wise", None),
}

FUSED: str = EmbeddingComputeKernel.FUSED.value
DENSE: str = EmbeddingComputeKernel.DENSE.value
UVM: str = EmbeddingComputeKernel.FUSED_UVM.value
CACHING: str = EmbeddingComputeKernel.FUSED_UVM_CACHING.value

OPTIMIZERS: Dict[str, EmbOptimType] = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


def _custom_sharding(
    spec: Tuple[str, Sequence[Tuple[int, int, int, int, int]]],
    device_type: str,
    world_size: int,
) -> ParameterSharding:
    sharding_type, shards = spec
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=EmbeddingComputeKernel.DENSE.value,
        ranks=[s[4] for s in shards],
        sharding_spec=EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_offsets=[row, col],
                    shard_sizes=[rows, cols],
                    placement=placement(device_type, rank, world_size),
                )
                for row, col, rows, cols, rank in shards
            ]
        ),
    )


def make_plan(
    ebc: EmbeddingBagCollection,
    specs: Mapping[str, TableSpec],
    world_size: int,
    local_size: int,
    kernel: str,
    device_type: str = "cpu",
) -> EmbeddingModuleShardingPlan:
    """
    Args:
        ebc (EmbeddingBagCollection): the unsharded module.
        specs (Mapping[str, TableSpec]): sharding per table.
        world_size (int): number of ranks.
        local_size (int): ranks per host.
        kernel (str): compute kernel of the non data-parallel tables.
        device_type (str): device type of the placements.

    Returns:
        EmbeddingModuleShardingPlan: the module plan.
    """
    generators = {
        "table_wise": lambda a: table_wise(rank=a),
        "column_wise": lambda a: column_wise(ranks=list(a)),
        "table_column_wise": lambda a: column_wise(ranks=list(a)),
        "row_wise": lambda a: row_wise(),
        "table_row_wise": lambda a: table_row_wise(host_index=a),
        "grid_shard": lambda a: grid_shard(host_indexes=list(a)),
        "data_parallel": lambda a: data_parallel(),
    }
    # construct_module_sharding_plan needs every table of the module: "custom"
    # tables and tables without a spec get a table-wise placeholder; the
    # former are replaced below, the latter dropped.
    configs = (
        ebc.embedding_bag_configs()
        if hasattr(ebc, "embedding_bag_configs")
        else ebc.embedding_configs()
    )
    generated = {config.name: table_wise(rank=0) for config in configs}
    for name, (kind, arg) in specs.items():
        if kind != "custom":
            generated[name] = generators[kind](arg)
    plan = construct_module_sharding_plan(
        ebc,
        generated,
        local_size=local_size,
        world_size=world_size,
        device_type=device_type,
    )
    for name in set(plan) - set(specs):
        del plan[name]
    for name, (kind, arg) in specs.items():
        if kind == "custom":
            plan[name] = _custom_sharding(arg, device_type, world_size)
        elif kind == "table_column_wise":
            plan[name].sharding_type = ShardingType.TABLE_COLUMN_WISE.value
    for ps in plan.values():
        if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
            ps.compute_kernel = kernel
    return plan


def delta(
    old: Mapping[str, ParameterSharding], new: Mapping[str, ParameterSharding]
) -> Dict[str, ParameterSharding]:
    """The tables whose sharding differs, with their new sharding."""
    return {name: ps for name, ps in new.items() if old[name] != ps}


def fused_params(optimizer: Optional[str]) -> Dict[str, Any]:
    """
    The fused params of the tests' sharders.

    Args:
        optimizer (Optional[str]): fused optimizer name (see OPTIMIZERS), or None.

    Returns:
        Dict[str, Any]: the optimizer, learning rate 0.05 and (but for SGD) eps
        0.01; empty without an optimizer.
    """
    fused: Dict[str, Any] = {}
    if optimizer is not None:
        fused = {"optimizer": OPTIMIZERS[optimizer], "learning_rate": 0.05}
        if optimizer != "sgd":
            fused["eps"] = 0.01
    return fused


def make_sharder(optimizer: Optional[str]) -> EmbeddingBagCollectionSharder:
    """
    Args:
        optimizer (Optional[str]): fused optimizer name (see OPTIMIZERS), or None.

    Returns:
        EmbeddingBagCollectionSharder: the sharder.
    """
    return EmbeddingBagCollectionSharder(fused_params=fused_params(optimizer) or None)


def shard(
    ebc: EmbeddingBagCollection,
    sharder: EmbeddingBagCollectionSharder,
    plan: EmbeddingModuleShardingPlan,
    env: ShardingEnv,
    device: torch.device,
) -> ShardedEmbeddingBagCollection:
    """Shards ``ebc`` and loads its weights (sharding on CPU does not copy them)."""
    module = sharder.shard(ebc, plan, env, device)
    module.load_state_dict(ebc.state_dict())
    return module


def one_rank_table_wise_ebc(
    pg: dist.ProcessGroup, kernel: str, optimizer: Optional[str]
) -> ShardedEmbeddingBagCollection:
    """
    The one-rank module of the storage tests: :func:`make_ebc`'s tables t0,
    t1, t2 (dims 8, 8, 16), each table-wise on rank 0, sharded on the host;
    nothing else references it.

    Args:
        pg (dist.ProcessGroup): a one-rank group.
        kernel (str): the compute kernel (e.g. :data:`FUSED`).
        optimizer (Optional[str]): the fused optimizer (see
            :func:`make_sharder`).

    Returns:
        ShardedEmbeddingBagCollection: the sharded module, its weights loaded.
    """
    ebc = make_ebc(3, dims=[8, 8, 16])
    specs = {name: ("table_wise", 0) for name in ("t0", "t1", "t2")}
    plan = make_plan(ebc, specs, 1, 1, kernel)
    env = ShardingEnv.from_process_group(pg)
    return shard(ebc, make_sharder(optimizer), plan, env, torch.device("cpu"))


def make_batches(
    num_tables: int, rows: Sequence[int], count: int, batch_size: int, seed: int
) -> List[KeyedJaggedTensor]:
    """Deterministic sparse batches (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (num_tables * batch_size,), generator=generator)
        values = torch.cat(
            [
                torch.randint(
                    0,
                    rows[i],
                    (int(lengths[i * batch_size : (i + 1) * batch_size].sum()),),
                    generator=generator,
                )
                for i in range(num_tables)
            ]
        )
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(num_tables)],
                values=values,
                lengths=lengths,
            )
        )
    return batches


def _optimizer_shard_pairs(
    module: ShardedEmbeddingBagCollection,
) -> Iterator[Tuple[str, str, Tuple[int, int, int, int], torch.Tensor]]:
    """(param key, state key, weight rect, local state tensor) of every local shard."""
    optimizer = module.fused_optimizer
    state = optimizer.state_dict()["state"]
    for key, weight in optimizer.params.items():
        if not isinstance(weight, ShardedTensor) or key not in state:
            continue
        rects = [
            (*s.metadata.shard_offsets, *s.metadata.shard_sizes)
            for s in weight.local_shards()
        ]
        for state_key, value in state[key].items():
            if isinstance(value, ShardedTensor):
                tensors = [shard.tensor for shard in value.local_shards()]
            elif isinstance(value, DTensor):
                tensors = list(value._local_tensor.local_shards())
            else:
                continue
            for rect, tensor in zip(rects, tensors):
                yield key, state_key, rect, tensor


def global_optimizer_state(
    module: ShardedEmbeddingBagCollection,
    pg: dist.ProcessGroup,
) -> Dict[Tuple[str, str], torch.Tensor]:
    """
    Fused optimizer state as full (rows, cols) float64 tensors: element-wise
    state in place, row-wise state expanded over its shard's columns. The
    tables' shapes come from their ShardedTensors' global sizes.

    Args:
        module (ShardedEmbeddingBagCollection): the module (or a
            ``DistributedModelParallel``: anything with a ``fused_optimizer``).
        pg (dist.ProcessGroup): its process group.

    Returns:
        Dict[Tuple[str, str], torch.Tensor]: (param key, state key) -> full state.
    """
    shapes = {
        key: tuple(weight.size())
        for key, weight in module.fused_optimizer.params.items()
        if isinstance(weight, ShardedTensor)
    }
    keys = sorted({(k, s, shapes[k]) for k, s, _, _ in _optimizer_shard_pairs(module)})
    # Ranks without a shard of a table still join its all-reduce.
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, keys, group=pg)
    all_keys = sorted({k for rank_keys in gathered for k in rank_keys})
    out = {(k, s): torch.zeros(shape, dtype=torch.float64) for k, s, shape in all_keys}
    for key, state_key, (row, col, rows, cols), tensor in _optimizer_shard_pairs(
        module
    ):
        target = out[(key, state_key)][row : row + rows, col : col + cols]
        if tensor.numel() == rows * cols:
            target.copy_(tensor.reshape(rows, cols))
        elif tensor.numel() == rows:
            target.copy_(tensor.reshape(rows, 1).expand(rows, cols))
    for key in sorted(out):
        dist.all_reduce(out[key], group=pg)
    return out


def load_global_state(
    module: ShardedEmbeddingBagCollection,
    weights: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[Tuple[str, str], torch.Tensor],
) -> None:
    """
    Loads a global view into a module sharded with any plan. Row-wise state of
    a shard gets the mean of the expanded state over the shard's columns.
    """
    module.load_state_dict(dict(weights))
    with torch.no_grad():
        for key, state_key, (row, col, rows, cols), tensor in _optimizer_shard_pairs(
            module
        ):
            if (key, state_key) not in optimizer_state:
                continue  # e.g. a data-parallel table becoming fused: fresh state
            full = optimizer_state[(key, state_key)][row : row + rows, col : col + cols]
            if tensor.numel() == rows * cols:
                tensor.copy_(full.reshape(tensor.shape).to(tensor.dtype))
            elif tensor.numel() == rows:
                tensor.copy_(full.mean(dim=1).reshape(tensor.shape).to(tensor.dtype))


def assert_state_dicts_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """
    Same keys, same shard metadata and placements, same local tensors and
    dtypes, bit for bit.
    """
    assert list(a.keys()) == list(b.keys()), (list(a.keys()), list(b.keys()))
    for key in a:
        x, y = a[key], b[key]
        assert type(x) is type(y), (key, type(x), type(y))
        if isinstance(x, ShardedTensor):
            assert x.metadata() == y.metadata(), (key, x.metadata(), y.metadata())
            xs, ys = x.local_shards(), y.local_shards()
            assert len(xs) == len(ys), key
            for s, t in zip(xs, ys):
                assert s.metadata == t.metadata, (key, s.metadata, t.metadata)
                assert s.tensor.dtype == t.tensor.dtype, key
                assert torch.equal(s.tensor, t.tensor), key
        elif isinstance(x, DTensor):
            assert x.size() == y.size() and x.placements == y.placements, key
            px, py = local_pieces(x), local_pieces(y)
            assert [p[0] for p in px] == [p[0] for p in py], key
            for (_, s), (_, t) in zip(px, py):
                assert s.dtype == t.dtype and torch.equal(s, t), key
        elif isinstance(x, Mapping):
            assert_state_dicts_equal(x, y)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert x == y, (key, x, y)


def assert_optimizer_states_equal(
    a: ShardedEmbeddingBagCollection, b: ShardedEmbeddingBagCollection
) -> None:
    """
    The fused optimizer state dicts hold the same keys and are equal, bit for
    bit, and every table trains with the same learning rate. (The order of the
    keys and the number of param groups follow the fbgemm kernels, one per
    group of tables, and a reshard keeps the kernel of tables that stay put
    apart from the kernel of tables that arrive; keys are what loading uses.)
    """
    sa = a.fused_optimizer.state_dict()
    sb = b.fused_optimizer.state_dict()
    assert_state_dicts_equal(
        dict(sorted(sa["state"].items())), dict(sorted(sb["state"].items()))
    )
    lrs_a, lrs_b = _learning_rates(a), _learning_rates(b)
    assert lrs_a == lrs_b, (lrs_a, lrs_b)
    groups_a = {g["lr"] for g in a.fused_optimizer.param_groups}
    groups_b = {g["lr"] for g in b.fused_optimizer.param_groups}
    assert groups_a == groups_b, (groups_a, groups_b)


def assert_dense_optimizer_states_equal(got: Any, expected: Any) -> None:
    """
    Two (dense) optimizers' states hold the same parameters, each with the
    same state tensors, equal bit for bit.

    Args:
        got (Any): the optimizer under test (a ``state_dict()`` with "state").
        expected (Any): the reference optimizer.

    Returns:
        None
    """
    a, b = got.state_dict()["state"], expected.state_dict()["state"]
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for name, value in b.items():
        for key, tensor in value.items():
            assert torch.equal(a[name][key], tensor), (name, key)


def _learning_rates(module: torch.nn.Module) -> Dict[str, float]:
    """The learning rate of every local table's fused kernel."""
    rates: Dict[str, float] = {}
    for submodule in module.modules():
        kernel = getattr(submodule, "_emb_module", None)
        if kernel is not None and hasattr(kernel, "get_learning_rate"):
            for table in submodule.config.embedding_tables:
                rates[table.name] = kernel.get_learning_rate()
    return rates


def train_step_keyed(
    module: ShardedEmbeddingBagCollection,
    batch: KeyedJaggedTensor,
    dense_optimizer: Optional[torch.optim.Optimizer] = None,
) -> Tuple[List[str], torch.Tensor]:
    """
    One forward/backward (the fused optimizer steps inside backward).

    Returns:
        Tuple[List[str], torch.Tensor]: the keys of the forward's pooled
        embeddings and their values, both in the output's own order (a model
        may read them by position).
    """
    pooled = module(batch).wait()
    values = pooled.values()
    (values.float() ** 2).sum().backward()
    if dense_optimizer is not None:
        dense_optimizer.step()
        dense_optimizer.zero_grad()
    return list(pooled.keys()), values.detach()


def train_step(
    module: ShardedEmbeddingBagCollection,
    batch: KeyedJaggedTensor,
    dense_optimizer: Optional[torch.optim.Optimizer] = None,
) -> torch.Tensor:
    """
    One forward/backward (the fused optimizer steps inside backward).

    Returns:
        torch.Tensor: the pooled embeddings of the forward, in the output's
        own order (:func:`train_step_keyed`).
    """
    return train_step_keyed(module, batch, dense_optimizer)[1]


def assert_same_training(
    m1: torch.nn.Module,
    m2: torch.nn.Module,
    batches: Sequence[Any],
    kernel: str,
    device: torch.device,
) -> None:
    """
    Same forward outputs (the same keys in the same order, the same values at
    the same positions), then the same state after each training step.
    """
    dense_opts = [None, None]
    if kernel == EmbeddingComputeKernel.DENSE.value:
        dense_opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (m1, m2)]
    for batch in batches:
        keys1, out1 = train_step_keyed(m1, batch.to(device), dense_opts[0])
        keys2, out2 = train_step_keyed(m2, batch.to(device), dense_opts[1])
        assert keys1 == keys2, (keys1, keys2)
        assert torch.equal(out1, out2), (out1, out2)
    assert_state_dicts_equal(m1.state_dict(), m2.state_dict())
    assert_optimizer_states_equal(m1, m2)


def reshard_with_reference(
    unsharded: EmbeddingBagCollection,
    sharder: EmbeddingBagCollectionSharder,
    module: ShardedEmbeddingBagCollection,
    old: EmbeddingModuleShardingPlan,
    new: EmbeddingModuleShardingPlan,
    env: ShardingEnv,
    device: torch.device,
    pg: dist.ProcessGroup,
) -> ShardedEmbeddingBagCollection:
    """
    One step of a chain of reshards through the sharder's seed API: gathers
    ``module``'s global state, reshards it from ``old`` to ``new`` in place,
    and builds the oracle, a module sharded directly under ``new`` and loaded
    with the state gathered before.

    Args:
        unsharded (EmbeddingBagCollection): the unsharded module (an EC too).
        sharder (EmbeddingBagCollectionSharder): its sharder.
        module (ShardedEmbeddingBagCollection): the sharded module, under ``old``.
        old (EmbeddingModuleShardingPlan): its plan.
        new (EmbeddingModuleShardingPlan): the plan it is resharded to.
        env (ShardingEnv): the sharding environment.
        device (torch.device): this rank's device.
        pg (dist.ProcessGroup): the group the state is gathered over.

    Returns:
        ShardedEmbeddingBagCollection: the reference.
    """
    weights = global_weights(module, pg)
    opt_state = global_optimizer_state(module, pg)
    result = sharder.reshard(module, delta(old, new), env, device)
    assert result is module
    reference = shard(unsharded, sharder, new, env, device)
    load_global_state(reference, weights, opt_state)
    return reference


def assert_reshard_matches_direct(
    rank: int,
    world_size: int,
    port: str,
    plans: List[Dict[str, TableSpec]],
    data_type: DataType = DataType.FP32,
    kernel: str = FUSED,
    optimizer: Optional[str] = "rowwise_adagrad",
    steps_before: int = 2,
    local_size: Optional[int] = None,
    dims: Optional[Sequence[int]] = None,
    output_dtensor: bool = False,
    run_forward: bool = True,
    train_each_step: bool = False,
) -> None:
    """
    The scenario of the differential tests, run by every rank of a
    ``ReshardTestBase`` test: shards an EmbeddingBagCollection under
    ``plans[0]``, trains ``steps_before`` steps, reshards through ``plans[1:]``
    in order with the sharder's seed API, and after each step compares the
    module, bit for bit, with one sharded directly under the new plan and
    loaded with the global state gathered just before (state dict, fused
    optimizer state, plan); finally both train on and must stay identical.

    Args:
        rank (int): this rank.
        world_size (int): the world size.
        port (str): the rendezvous port.
        plans (List[Dict[str, TableSpec]]): the chain of plans, first the start.
        data_type (DataType): the tables' data type.
        kernel (str): the compute kernel (fused or dense).
        optimizer (Optional[str]): the fused optimizer.
        steps_before (int): training steps before the first reshard.
        local_size (Optional[int]): ranks per host (default: all).
        dims (Optional[Sequence[int]]): the tables' dims.
        output_dtensor (bool): the environment's output_dtensor.
        run_forward (bool): False for kernels that cannot run on this
            backend: only the state is compared.
        train_each_step (bool): follow every step of the chain by a compared
            training step.

    Returns:
        None
    """
    with BoundedMultiProcessContext(rank, world_size, port, local_size) as context:
        pg, device = context.pg, context.device
        num_tables = len(plans[0])
        ebc = make_ebc(num_tables, data_type, dims=dims)
        rows = [c.num_embeddings for c in ebc.embedding_bag_configs()]
        sharder = make_sharder(optimizer if kernel == FUSED else None)
        env = ShardingEnv(world_size, rank, pg, output_dtensor=output_dtensor)
        module_plans = [
            make_plan(ebc, p, world_size, local_size or world_size, kernel, device.type)
            for p in plans
        ]
        batches = make_batches(num_tables, rows, steps_before + 2, 4, seed=1)

        m2 = shard(ebc, sharder, module_plans[0], env, device)
        before = torch.optim.SGD(m2.parameters(), lr=0.05) if kernel == DENSE else None
        for batch in batches[:steps_before]:
            train_step(m2, batch.to(device), before)

        # Each step of a chain is checked against the state just before it:
        # row-wise optimizer state of joined columns is averaged, so a chain
        # that joins and splits columns again is not expected to round-trip.
        for old, new in zip(module_plans, module_plans[1:]):
            m1 = reshard_with_reference(ebc, sharder, m2, old, new, env, device, pg)
            assert_state_dicts_equal(m1.state_dict(), m2.state_dict())
            assert_optimizer_states_equal(m1, m2)
            assert m1.module_sharding_plan == m2.module_sharding_plan
            if train_each_step and run_forward:
                assert_same_training(m1, m2, batches[-1:], kernel, device)

        if run_forward:
            assert_same_training(m1, m2, batches[steps_before:], kernel, device)


class ReshardTestBase(MultiRankTestBase):
    """The base of the multi-process resharding tests (see MultiRankTestBase)."""

    def run_matches_direct(self, world_size: int, **kwargs: Any) -> None:
        """
        :func:`assert_reshard_matches_direct` on ``world_size`` ranks.

        Args:
            world_size (int): the number of ranks.
            **kwargs (Any): its arguments but the rank's own.

        Returns:
            None
        """
        self.run_ranks(assert_reshard_matches_direct, world_size, **kwargs)


def multi_process_settings(max_examples: int) -> Callable[[Any], Any]:
    """
    Hypothesis settings for tests whose examples each spawn ranks: no
    shrinking (a failing example is reported as found: shrinking one that
    spawns processes takes many minutes and hides the failure behind it).
    """
    return settings(
        verbosity=Verbosity.verbose,
        max_examples=max_examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
