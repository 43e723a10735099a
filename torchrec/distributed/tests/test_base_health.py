#!/usr/bin/env python3
# pyre-strict
"""Health of the upstream base on this stack (torch 2.13, fbgemm-gpu 1.8).

Shards an EmbeddingBagCollection table-wise, column-wise, row-wise and
data-parallel over 2 gloo ranks, runs forward and backward plus one SGD step,
and compares outputs and updated weights with the unsharded module. Trains the
unsharded FusedEmbeddingBagCollection (fbgemm kernel with its optimizer fused
into the backward) against a plain EmbeddingBagCollection and the matching
torch optimizer. Shards an EmbeddingCollection table-wise, column-wise and
row-wise with DTensor state dicts (``ShardingEnv.output_dtensor``, or the
``output_dtensor`` fused param TorchRec 1.1.0's EC read) and trains it against
the unsharded module.
"""

import copy
import unittest
from typing import Any, Dict, List, Type

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._tensor import DTensor, Replicate, Shard
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.multi_process import (
    MultiProcessContext,
    MultiProcessTestBase,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.modules.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

WORLD_SIZE: int = 2
LEARNING_RATE: float = 0.1
BATCH_SIZE: int = 4
TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=f"t{i}",
        embedding_dim=8,
        num_embeddings=16 + 3 * i,
        feature_names=[f"f{i}"],
    )
    for i in range(4)
]


def _batch(seed: int) -> KeyedJaggedTensor:
    """A deterministic local batch (one per rank) over all features."""
    gen = torch.Generator().manual_seed(1000 + seed)
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for table in TABLES:
        lens = torch.randint(0, 4, (BATCH_SIZE,), generator=gen)
        lengths.append(lens)
        values.append(
            torch.randint(0, table.num_embeddings, (int(lens.sum()),), generator=gen)
        )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f for table in TABLES for f in table.feature_names],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def _loss_weights(seed: int) -> torch.Tensor:
    """Per-output weights so that every embedding gets a distinct gradient."""
    gen = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(BATCH_SIZE, sum(t.embedding_dim for t in TABLES), generator=gen)


def _expected_weights(
    ref: EmbeddingBagCollection, world_size: int
) -> Dict[str, torch.Tensor]:
    """Weights after one SGD step: every table sees the gradient of every
    rank's batch averaged over the ranks (TorchRec's collectives divide
    gradients by the world size and data-parallel tables are all-reduced, as
    with DDP)."""
    params = dict(ref.named_parameters())
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    for src in range(world_size):
        loss = (ref(_batch(src)).values() * _loss_weights(src)).sum()
        grads = torch.autograd.grad(loss, list(params.values()))
        for name, grad in zip(params, grads):
            total[name] += grad
    return {
        name: param.detach() - LEARNING_RATE * total[name] / world_size
        for name, param in params.items()
    }


def _check_state(
    state: Dict[str, object], expected: Dict[str, torch.Tensor], rank: int
) -> None:
    """Compare every local shard of the sharded state dict with the expected
    global tensors."""
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    for name, value in state.items():
        want = expected[name]
        if isinstance(value, ShardedTensor):
            assert list(value.size()) == list(want.size()), name
            for shard in value.local_shards():
                rows, cols = shard.metadata.shard_offsets
                nrows, ncols = shard.metadata.shard_sizes
                piece = want[rows : rows + nrows, cols : cols + ncols]
                torch.testing.assert_close(
                    shard.tensor, piece, msg=f"rank {rank} {name} {rows},{cols}"
                )
        else:
            assert isinstance(value, torch.Tensor), (name, type(value))
            torch.testing.assert_close(value, want, msg=f"rank {rank} {name}")


def _health_rank(rank: int, world_size: int, kernel: str, backend: str) -> None:
    """One rank: shard, compare forward, backward + SGD step, compare weights."""
    torch.set_num_threads(1)
    with MultiProcessContext(rank, world_size, backend) as ctx:
        device = ctx.device
        torch.manual_seed(0)
        ref = EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
        fused = kernel == EmbeddingComputeKernel.FUSED.value
        sharder = EmbeddingBagCollectionSharder(
            fused_params=(
                {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
                if fused
                else None
            )
        )
        plan = construct_module_sharding_plan(
            ref,
            {
                "t0": table_wise(rank=1),
                "t1": column_wise(ranks=[0, 1]),
                "t2": row_wise(),
                "t3": data_parallel(),
            },
            local_size=world_size,
            world_size=world_size,
            device_type=device.type,
        )
        dp_tables = [
            name
            for name, ps in plan.items()
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value
        ]
        for name, ps in plan.items():
            if name not in dp_tables:
                ps.compute_kernel = kernel
        assert ctx.pg is not None
        sharded = sharder.shard(
            copy.deepcopy(ref), plan, ShardingEnv.from_process_group(ctx.pg), device
        )
        # On CPU, shard() does not copy the weights: load them explicitly.
        sharded.load_state_dict(ref.state_dict())

        kjt = _batch(rank).to(device)
        out = sharded(kjt).wait()
        want = ref(_batch(rank))
        assert out.keys() == want.keys(), (out.keys(), want.keys())
        torch.testing.assert_close(out.values().cpu(), want.values().detach())

        loss = (out.values() * _loss_weights(rank).to(device)).sum()
        loss.backward()  # the fused kernel applies its SGD step here
        dense = [p for p in sharded.parameters() if p.grad is not None]
        assert dense, "no parameter received a gradient"
        torch.optim.SGD(dense, lr=LEARNING_RATE).step()

        expected = _expected_weights(ref, world_size)
        state = {k: v for k, v in sharded.state_dict().items()}
        _check_state(state, expected, rank)


class BaseHealthTest(MultiProcessTestBase):
    """The base release shards and trains correctly on this stack."""

    def _run(self, kernel: str) -> None:
        backend = "nccl" if torch.cuda.device_count() >= WORLD_SIZE else "gloo"
        self._run_multi_process_test(
            callable=_health_rank,
            world_size=WORLD_SIZE,
            kernel=kernel,
            backend=backend,
        )

    def test_tw_cw_rw_dp_dense(self) -> None:
        self._run(EmbeddingComputeKernel.DENSE.value)

    def test_tw_cw_rw_dp_fused(self) -> None:
        self._run(EmbeddingComputeKernel.FUSED.value)


# Two pooling modes: FusedEmbeddingBagCollection builds one fbgemm kernel per
# (pooling, data type), so these tables exercise two fused kernels at once.
# Tables of one kernel come first and in table order: the base concatenates
# the outputs kernel by kernel but labels them in table order, so interleaved
# pooling modes would mislabel its outputs (a TorchRec 1.1.0 bug that does not
# depend on fbgemm).
FUSED_TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name="s0",
        embedding_dim=4,
        num_embeddings=11,
        feature_names=["g0", "g1"],
        pooling=PoolingType.SUM,
    ),
    EmbeddingBagConfig(
        name="s1",
        embedding_dim=4,
        num_embeddings=5,
        feature_names=["g2"],
        pooling=PoolingType.SUM,
    ),
    EmbeddingBagConfig(
        name="m0",
        embedding_dim=8,
        num_embeddings=7,
        feature_names=["g3"],
        pooling=PoolingType.MEAN,
    ),
]
# Learning rate per step; the change before step 2 goes through the fused
# optimizer's param group, as an LR scheduler would set it.
FUSED_LRS: List[float] = [0.25, 0.25, 0.0625, 0.0625]


def _fused_batch(step: int) -> KeyedJaggedTensor:
    """A deterministic batch with repeated ids (exact optimizers must sum the
    gradients of a row before updating it) and empty bags."""
    gen = torch.Generator().manual_seed(3000 + step)
    keys: List[str] = []
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for table in FUSED_TABLES:
        for feature in table.feature_names:
            lens = torch.randint(0, 5, (BATCH_SIZE,), generator=gen)
            keys.append(feature)
            lengths.append(lens)
            values.append(
                torch.randint(
                    0, table.num_embeddings, (int(lens.sum()),), generator=gen
                )
            )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _fused_loss_weights(step: int) -> torch.Tensor:
    """Per-output weights so that every pooled value gets its own gradient."""
    gen = torch.Generator().manual_seed(4000 + step)
    width = sum(t.embedding_dim * len(t.feature_names) for t in FUSED_TABLES)
    return torch.randn(BATCH_SIZE, width, generator=gen)


class FusedEmbeddingModulesHealthTest(unittest.TestCase):
    """The unsharded fused modules build and train on this stack (fbgemm 1.8
    removed the OptimizerArgs field they read their learning rate from)."""

    def _train(
        self,
        fused_optimizer: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        reference_optimizer: Type[torch.optim.Optimizer],
        reference_kwargs: Dict[str, Any],
        state_key: str,
    ) -> None:
        """Train a FusedEmbeddingBagCollection and, from the same weights, a
        plain EmbeddingBagCollection with ``reference_optimizer``; compare
        outputs, weights and (when ``state_key`` is set) optimizer state after
        every step.

        Args:
            fused_optimizer: the optimizer type fused into the fbgemm kernel.
            optimizer_kwargs: its arguments (without "lr").
            reference_optimizer: the torch optimizer doing the same math.
            reference_kwargs: its arguments (without "lr").
            state_key: name of the reference optimizer's per-parameter state
                that the fused optimizer keeps as "momentum_1" ("" for none).
        """
        torch.manual_seed(0)
        fused = FusedEmbeddingBagCollection(
            tables=FUSED_TABLES,
            optimizer_type=fused_optimizer,
            optimizer_kwargs={"lr": FUSED_LRS[0], **optimizer_kwargs},
        )
        optimizer = fused.fused_optimizer()
        # The param groups show the rate the kernels hold (a float32 tensor).
        self.assertEqual(len(optimizer.param_groups), 2)
        for group in optimizer.param_groups:
            self.assertEqual(
                group["lr"], torch.tensor(FUSED_LRS[0], dtype=torch.float32).item()
            )
        ref = EmbeddingBagCollection(tables=FUSED_TABLES)
        ref.load_state_dict(fused.state_dict())
        ref_params = dict(ref.named_parameters())
        self.assertEqual(set(ref_params), set(fused.state_dict()))
        ref_opt = reference_optimizer(
            list(ref_params.values()), lr=FUSED_LRS[0], **reference_kwargs
        )
        before = {k: v.detach().clone() for k, v in ref_params.items()}

        for step, lr in enumerate(FUSED_LRS):
            for group in optimizer.param_groups:  # one group per fused kernel
                group["lr"] = lr
            optimizer.step()  # pushes each group's rate into its kernel
            for group in ref_opt.param_groups:
                group["lr"] = lr
            kjt = _fused_batch(step)
            out = fused(kjt)
            want = ref(kjt)
            self.assertEqual(out.keys(), want.keys())
            if step == 0:
                # Same weights, same pooling: bit-equal outputs.
                torch.testing.assert_close(out.values(), want.values(), rtol=0, atol=0)
            else:
                # fbgemm sums a row's gradients in another order than autograd:
                # the weights (and outputs) may differ in the last bits.
                torch.testing.assert_close(out.values(), want.values())
            (out.values() * _fused_loss_weights(step)).sum().backward()
            ref_opt.zero_grad()
            (want.values() * _fused_loss_weights(step)).sum().backward()
            ref_opt.step()

            got = fused.state_dict()
            for name, param in ref_params.items():
                torch.testing.assert_close(
                    got[name], param.detach(), msg=f"step {step} {name}"
                )
            if state_key:
                states = optimizer.state_dict()["state"]
                for name, param in ref_params.items():
                    table = name.split(".")[1]
                    key = f"{table}.weight"
                    torch.testing.assert_close(
                        states[key][f"{key}.momentum_1"],
                        ref_opt.state[param][state_key],
                        msg=f"step {step} {name} optimizer state",
                    )
        for name, param in ref_params.items():
            # Every table was looked up, so training changed each of them.
            self.assertFalse(torch.equal(before[name], param.detach()), name)

    def test_fused_ebc_trains_exact_sgd(self) -> None:
        self._train(torch.optim.SGD, {}, torch.optim.SGD, {}, "")

    def test_fused_ebc_trains_exact_adagrad(self) -> None:
        self._train(
            torch.optim.Adagrad,
            {"eps": 1e-8},
            torch.optim.Adagrad,
            {"eps": 1e-8},
            "sum",
        )

    def test_fused_ec_builds(self) -> None:
        # FusedEmbeddingCollection accepts only cuda and meta devices; on meta
        # it builds its fused optimizer through the same code path.
        fused = FusedEmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="e0", embedding_dim=4, num_embeddings=6, feature_names=["h0"]
                )
            ],
            optimizer_type=torch.optim.SGD,
            optimizer_kwargs={"lr": 0.5},
            device=torch.device("meta"),
        )
        self.assertEqual(fused.fused_optimizer().param_groups[0]["lr"], 0.5)
        self.assertEqual(
            fused.state_dict()["embeddings.e0.weight"].shape, torch.Size([6, 4])
        )


EC_DIM: int = 8
EC_TABLES: List[EmbeddingConfig] = [
    EmbeddingConfig(
        name=f"e{i}",
        embedding_dim=EC_DIM,
        num_embeddings=13 + 2 * i,
        feature_names=[f"h{i}"],
    )
    for i in range(4)
]
# sharding per table, the DTensor placements it gives, and whether the
# table's state dict value is a DTensor at all (data-parallel: a plain tensor)
EC_LAYOUT: Dict[str, Any] = {
    "e0": (table_wise(rank=1), (Replicate(),)),
    "e1": (column_wise(ranks=[0, 1]), (Shard(1),)),
    "e2": (row_wise(), (Shard(0),)),
    "e3": (table_wise(rank=0), (Replicate(),)),
}


def _ec_batch(rank: int, step: int) -> KeyedJaggedTensor:
    """A deterministic local batch per rank and step, with repeated ids."""
    gen = torch.Generator().manual_seed(5000 + 100 * step + rank)
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for table in EC_TABLES:
        lens = torch.randint(0, 4, (BATCH_SIZE,), generator=gen)
        lengths.append(lens)
        values.append(
            torch.randint(0, table.num_embeddings, (int(lens.sum()),), generator=gen)
        )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f for table in EC_TABLES for f in table.feature_names],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def _ec_loss(out: Dict[str, JaggedTensor], rank: int, step: int) -> torch.Tensor:
    """A loss giving every looked-up position its own gradient."""
    gen = torch.Generator().manual_seed(6000 + 100 * step + rank)
    loss = torch.zeros(())
    for name in sorted(out):
        values = out[name].values()
        weights = torch.randn(values.shape, generator=gen).to(values.device)
        loss = loss + (values * weights).sum()
    return loss


def _ec_reference_step(
    weights: Dict[str, torch.Tensor], world_size: int, step: int
) -> Dict[str, torch.Tensor]:
    """The weights after one EXACT_SGD step of the sharded EC: the gradients of
    every rank's batch averaged over the ranks (TorchRec's collectives divide
    them by the world size), times the learning rate."""
    ref = EmbeddingCollection(tables=EC_TABLES, device=torch.device("cpu"))
    ref.load_state_dict(weights)
    params = dict(ref.named_parameters())
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    for src in range(world_size):
        grads = torch.autograd.grad(
            _ec_loss(ref(_ec_batch(src, step)), src, step), list(params.values())
        )
        for name, grad in zip(params, grads):
            total[name] += grad
    return {
        name: param.detach() - LEARNING_RATE * total[name] / world_size
        for name, param in params.items()
    }


def _ec_output_dtensor_rank(
    rank: int, world_size: int, switch: str, backend: str
) -> None:
    """One rank: shard an EC with DTensor output asked for through ``switch``
    ("env" or "fused_param"), check the state dict, train, check again."""
    torch.set_num_threads(1)
    with MultiProcessContext(rank, world_size, backend) as ctx:
        device = ctx.device
        assert ctx.pg is not None
        torch.manual_seed(0)
        ec = EmbeddingCollection(tables=EC_TABLES, device=torch.device("cpu"))
        fused_params: Dict[str, Any] = {
            "optimizer": EmbOptimType.EXACT_SGD,
            "learning_rate": LEARNING_RATE,
        }
        env = ShardingEnv.from_process_group(ctx.pg)
        if switch == "env":
            env.output_dtensor = True
        else:
            fused_params["output_dtensor"] = True
        plan = construct_module_sharding_plan(
            ec,
            {name: gen for name, (gen, _) in EC_LAYOUT.items()},
            local_size=world_size,
            world_size=world_size,
            device_type=device.type,
        )
        for ps in plan.values():
            ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
        sharded = EmbeddingCollectionSharder(fused_params=fused_params).shard(
            ec, plan, env, device
        )
        sharded.load_state_dict(ec.state_dict())
        weights = {k: v.detach().clone() for k, v in ec.state_dict().items()}

        def check(expected: Dict[str, torch.Tensor], when: str) -> None:
            state = sharded.state_dict()
            assert list(state) == list(expected), (list(state), list(expected))
            for name, want in expected.items():
                value = state[name]
                table = name.split(".")[1]
                assert isinstance(value, DTensor), (when, name, type(value))
                assert value.placements == EC_LAYOUT[table][1], (name, value)
                assert value.size() == want.size(), name
                wrapper = value._local_tensor
                local = list(zip(wrapper.local_shards(), wrapper.local_offsets()))
                # every rank holds what the plan gives it, nothing else
                owned = [
                    s.shard_offsets
                    for s in plan[table].sharding_spec.shards
                    if s.placement.rank() == rank
                ]
                assert [list(o) for _, o in local] == [list(o) for o in owned], (
                    name,
                    local,
                    owned,
                )
                for tensor, (row, col) in local:
                    piece = want[
                        row : row + tensor.shape[0], col : col + tensor.shape[1]
                    ]
                    torch.testing.assert_close(
                        tensor.cpu(), piece, msg=f"{when} rank {rank} {name}"
                    )

        check(weights, "after load")
        for step in range(2):
            out = sharded(_ec_batch(rank, step).to(device)).wait()
            want = ec(_ec_batch(rank, step))
            # (the sharded EC orders its features by sharding type)
            assert sorted(out) == sorted(want), (list(out), list(want))
            for feature in want:
                torch.testing.assert_close(
                    out[feature].values().cpu(), want[feature].values().detach()
                )
            _ec_loss(out, rank, step).backward()  # the fused SGD steps here
            weights = _ec_reference_step(weights, world_size, step)
            ec.load_state_dict(weights)
            check(weights, f"after step {step}")


class EcOutputDTensorHealthTest(MultiProcessTestBase):
    """An EmbeddingCollection with table-wise, column-wise and row-wise tables
    shards with DTensor state and trains like the unsharded module, whichever
    way DTensor output is asked for."""

    def _run(self, switch: str) -> None:
        backend = "nccl" if torch.cuda.device_count() >= WORLD_SIZE else "gloo"
        self._run_multi_process_test(
            callable=_ec_output_dtensor_rank,
            world_size=WORLD_SIZE,
            switch=switch,
            backend=backend,
        )

    def test_ec_tw_cw_rw_dtensor_from_env(self) -> None:
        self._run("env")

    def test_ec_tw_cw_rw_dtensor_from_fused_param(self) -> None:
        self._run("fused_param")


if __name__ == "__main__":
    unittest.main()
