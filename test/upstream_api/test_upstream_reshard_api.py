# pyre-strict

"""
The public reshard API of torchrec 1.8.0 and 1.9.2 (the same on both), called
as its docstrings describe it, on the fork (whose engine does the work behind
it):

- ``EmbeddingBagCollectionSharder.reshard(sharded_module, changed_shard_to_params,
  env, device)`` and ``ShardedEmbeddingBagCollection.update_shards(
  changed_sharding_params, env, device)`` with an ``EmbeddingModuleShardingPlan``
  delta from ``output_sharding_plan_delta_single``;
- ``DistributedModelParallel.reshard(changed_shard_to_params,
  sharded_module_fqn=None) -> float`` with the deltas of
  ``output_sharding_plans_delta`` (it returns the data volume the delta
  names), beside the fork's ``reshard(new_plan)``;
- ``DistributedModelParallel.sharders``.

Every case is differential: the resharded module against one sharded directly
under the new plan and loaded with the state gathered just before (plain
collectives, independent of the code under test): state dict, fused optimizer
state, plan, and the same training steps afterwards. Table-wise and
column-wise deltas, 2 and 4 gloo ranks.
"""

import unittest
from typing import Any, Dict, List

import torch
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding.dynamic_sharding import (
    output_sharding_plan_delta_single,
    output_sharding_plans_delta,
)
from torchrec.distributed.test_utils.reshard_dmp_utils import (
    sparse_arch,
    sparse_arch_batches,
    sparse_arch_plan,
    sparse_arch_step,
)
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec_sharder
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    FUSED,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_sharder,
    ReshardTestBase,
    TableSpec,
    train_step,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan


def _plans(kind: str, world_size: int) -> List[Dict[str, TableSpec]]:
    """Plan A and plan B of three tables: B moves the table-wise tables
    ("table_wise") or the column-wise table's shards ("column_wise")."""
    last = world_size - 1
    a: Dict[str, TableSpec] = {
        "t0": ("table_wise", 0),
        "t1": ("table_wise", 1),
        "t2": ("column_wise", [0, 1]),
    }
    b = dict(a)
    if kind == "table_wise":
        b["t0"] = ("table_wise", last)
        b["t1"] = ("table_wise", 0)
    else:
        b["t2"] = ("column_wise", [last, 0])
    return [a, b]


def _module_api_rank(
    rank: int, world_size: int, port: str, entry: str, kind: str
) -> None:
    with reshard_scenario(rank, world_size, port, num_tables=3) as scenario:
        ebc, sharder, env, device = (
            scenario.ebc,
            scenario.sharder,
            scenario.env,
            scenario.device,
        )
        assert isinstance(sharder, EmbeddingBagCollectionSharder)
        old, new = scenario.plans(_plans(kind, world_size))
        batches = scenario.batches(3, seed=1)
        module = scenario.shard(old)
        train_step(module, batches[0].to(device), None)

        volume, delta = output_sharding_plan_delta_single(
            module.module_sharding_plan, new, return_data_volume=True
        )
        assert isinstance(delta, EmbeddingModuleShardingPlan)
        changed = ["t0", "t1"] if kind == "table_wise" else ["t2"]
        assert sorted(delta) == changed
        # upstream's definition: MiB of every shard of the changed tables, fp32
        assert volume == sum(
            c.num_embeddings * c.embedding_dim
            for c in ebc.embedding_bag_configs()
            if c.name in changed
        ) * 4 / (1024 * 1024)
        state = scenario.global_state(module)

        if entry == "sharder":
            result = sharder.reshard(module, delta, env, device)
            assert result is module
        else:
            assert isinstance(module, ShardedEmbeddingBagCollection)
            assert module.update_shards(delta, env, device) is None

        reference = scenario.reference(new, state)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        assert_optimizer_states_equal(reference, module)
        assert module.module_sharding_plan == reference.module_sharding_plan
        assert_same_training(reference, module, batches[1:], FUSED, device)


def _dmp_specs(kind: str) -> List[Dict[str, Dict[str, TableSpec]]]:
    a = {
        "sparse_a": {
            "t0": ("table_wise", 0),
            "t1": ("column_wise", [0, 1]),
            "t2": ("table_wise", 1),
        },
        "sparse_b": {"t0": ("table_wise", 1), "t1": ("table_wise", 0)},
        "seq": {"t0": ("table_wise", 0), "t1": ("table_wise", 1)},
    }
    b = {name: dict(specs) for name, specs in a.items()}
    if kind == "table_wise":
        b["sparse_a"]["t0"] = ("table_wise", 1)
        b["sparse_a"]["t2"] = ("table_wise", 0)
    else:
        b["sparse_a"]["t1"] = ("column_wise", [1, 0])
    return [a, b]


def _dmp_api_rank(
    rank: int, world_size: int, port: str, kind: str, by_fqn: bool
) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        sharders = [make_sharder("rowwise_adagrad"), make_ec_sharder("rowwise_adagrad")]
        unsharded = sparse_arch()
        old, new = (
            sparse_arch_plan(unsharded, specs, world_size) for specs in _dmp_specs(kind)
        )
        batches = sparse_arch_batches(unsharded, 3)
        model = DistributedModelParallel(
            sparse_arch(), env=env, device=device, plan=old, sharders=sharders
        )
        model.load_state_dict(unsharded.state_dict())
        assert model.sharders == sharders
        sparse_arch_step(model, batches[0])

        deltas = output_sharding_plans_delta(
            model.plan.plan, new.plan, return_data_volume=True
        )
        assert set(deltas) == {"sparse_a", "sparse_b", "seq"}
        assert [fqn for fqn, (_, delta) in deltas.items() if delta] == ["sparse_a"]
        weights = global_weights(model, pg)
        opt_state = global_optimizer_state(model, pg)

        if by_fqn:
            volume = model.reshard(deltas, "sparse_a")
        else:
            # no FQN: the first module (in module order) a sharder can reshard
            only = {"sparse_a": deltas["sparse_a"]}
            volume = model.reshard(changed_shard_to_params=only)
        assert isinstance(volume, float)
        assert volume == deltas["sparse_a"][0] > 0
        assert model.plan.plan["sparse_a"] == new.plan["sparse_a"]

        reference = DistributedModelParallel(
            sparse_arch(), env=env, device=device, plan=new, sharders=sharders
        )
        load_global_state(reference, weights, opt_state)
        assert_state_dicts_equal(reference.state_dict(), model.state_dict())
        assert_optimizer_states_equal(reference, model)
        for batch in batches[1:]:
            assert torch.equal(
                sparse_arch_step(model, batch), sparse_arch_step(reference, batch)
            )
        assert_state_dicts_equal(reference.state_dict(), model.state_dict())


class UpstreamReshardApiTest(ReshardTestBase):
    def _module(self, entry: str, kind: str) -> None:
        for world_size in (2, 4):
            with self.subTest(world_size=world_size):
                self.run_ranks(_module_api_rank, world_size, entry=entry, kind=kind)

    def test_sharder_reshard_table_wise_delta(self) -> None:
        self._module("sharder", "table_wise")

    def test_sharder_reshard_column_wise_delta(self) -> None:
        self._module("sharder", "column_wise")

    def test_update_shards_table_wise_delta(self) -> None:
        self._module("update_shards", "table_wise")

    def test_update_shards_column_wise_delta(self) -> None:
        self._module("update_shards", "column_wise")

    def _dmp(self, **kwargs: Any) -> None:
        for world_size in (2, 4):
            with self.subTest(world_size=world_size):
                self.run_ranks(_dmp_api_rank, world_size, **kwargs)

    def test_dmp_reshard_table_wise_delta_by_fqn(self) -> None:
        self._dmp(kind="table_wise", by_fqn=True)

    def test_dmp_reshard_column_wise_delta_first_module(self) -> None:
        self._dmp(kind="column_wise", by_fqn=False)


if __name__ == "__main__":
    unittest.main()
