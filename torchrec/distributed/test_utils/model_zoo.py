#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The model zoo of the reshard tests: every test model and its table configs is
built here. Tables are "t0".."tN" (or another prefix), table ``ti`` read by
feature "fi"; the modules are an EBC, an EC, one table on the meta device, a
DLRM of equal tables, the embeddings model of the group moves (EBC + EC +
dense) and the sparse arch of the model-level reshard (two EBCs and an EC).
Everything is seeded, so that every rank builds the same weights.
"""

from typing import Any, List, Optional, Sequence, Tuple, Type, TypeVar

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ConfigT = TypeVar("ConfigT", bound=BaseEmbeddingConfig)

# the embedding dim of :class:`EmbeddingsModel`'s tables and dense layer
EMBEDDINGS_MODEL_DIM: int = 16


def numbered_tables(
    config: Type[ConfigT],
    num_tables: int,
    dims: Sequence[int],
    rows: Sequence[int],
    data_type: DataType = DataType.FP32,
    table_prefix: str = "t",
    feature_prefix: str = "f",
) -> List[ConfigT]:
    """
    The configs of tables "t0".."tN", table ``ti`` read by feature "fi".

    Args:
        config (Type[ConfigT]): EmbeddingBagConfig or EmbeddingConfig.
        num_tables (int): number of tables.
        dims (Sequence[int]): embedding dim per table (at least ``num_tables``).
        rows (Sequence[int]): rows per table (at least ``num_tables``).
        data_type (DataType): every table's data type.
        table_prefix (str): the tables' names before their number.
        feature_prefix (str): the features' names before their number.

    Returns:
        List[ConfigT]: one config per table.
    """
    return [
        config(
            name=f"{table_prefix}{i}",
            embedding_dim=dims[i],
            num_embeddings=rows[i],
            feature_names=[f"{feature_prefix}{i}"],
            data_type=data_type,
        )
        for i in range(num_tables)
    ]


def make_ebc(
    num_tables: int,
    data_type: DataType = DataType.FP32,
    dims: Optional[Sequence[int]] = None,
    rows: Optional[Sequence[int]] = None,
    seed: int = 0,
) -> EmbeddingBagCollection:
    """
    Args:
        num_tables (int): number of tables "t0".."tN" with features "f0".."fN".
        data_type (DataType): FP32, FP16 or BF16.
        dims (Optional[Sequence[int]]): embedding dims (multiples of 4).
        rows (Optional[Sequence[int]]): rows per table.
        seed (int): seed of the weights.

    Returns:
        EmbeddingBagCollection: on CPU, with deterministic weights.
    """
    dims = dims or [16] * num_tables
    rows = rows or [24 + 3 * i for i in range(num_tables)]
    tables = numbered_tables(EmbeddingBagConfig, num_tables, dims, rows, data_type)
    torch.manual_seed(seed)
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


def make_ec(
    num_tables: int,
    data_type: DataType = DataType.FP32,
    dim: int = 16,
    rows: Optional[Sequence[int]] = None,
    seed: int = 0,
) -> EmbeddingCollection:
    """
    The tables of :func:`make_ebc` in an EmbeddingCollection, which needs the
    same dim for every table.

    Args:
        dim (int): the embedding dim of every table.
        num_tables, data_type, rows, seed: as for :func:`make_ebc`.

    Returns:
        EmbeddingCollection: on CPU, with deterministic weights.
    """
    rows = rows or [24 + 3 * i for i in range(num_tables)]
    tables = numbered_tables(
        EmbeddingConfig, num_tables, [dim] * num_tables, rows, data_type
    )
    torch.manual_seed(seed)
    return EmbeddingCollection(tables=tables, device=torch.device("cpu"))


def one_table_ebc(rows: int, cols: int, device: str = "meta") -> EmbeddingBagCollection:
    """
    Args:
        rows (int): the table's rows.
        cols (int): the table's embedding dim.
        device (str): where it is built ("meta": only its shape).

    Returns:
        EmbeddingBagCollection: one table ``t`` read by feature ``f``.
    """
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t", embedding_dim=cols, num_embeddings=rows, feature_names=["f"]
            )
        ],
        device=torch.device(device),
    )


def on_meta(module: nn.Module) -> nn.Module:
    """
    Args:
        module (nn.Module): an EmbeddingCollection or EmbeddingBagCollection.

    Returns:
        nn.Module: the same embedding tables, built on the meta device.
    """
    meta = torch.device("meta")
    if isinstance(module, EmbeddingCollection):
        return EmbeddingCollection(tables=module.embedding_configs(), device=meta)
    return EmbeddingBagCollection(tables=module.embedding_bag_configs(), device=meta)


def equal_tables_dlrm(
    num_tables: int,
    rows: int,
    dim: int,
    dense_in: int,
    over_arch: List[int],
    device: torch.device,
    seed: int = 0,
) -> DLRMTrain:
    """
    A DLRM of ``num_tables`` tables ``t{i}`` (one feature ``f{i}`` each) of the
    same size, built from ``seed`` so that every rank builds the same model:
    the job of the demo, of the pipeline tests and of the rebalance benchmark.

    Args:
        num_tables (int): number of tables.
        rows (int): rows of each table.
        dim (int): embedding dimension (and the dense arch's width).
        dense_in (int): dense input features.
        over_arch (List[int]): the over arch's layer sizes.
        device (torch.device): the device ("meta" for the planner).
        seed (int): the seed of every weight.

    Returns:
        DLRMTrain: the model, with its loss.
    """
    torch.manual_seed(seed)
    tables = numbered_tables(
        EmbeddingBagConfig, num_tables, [dim] * num_tables, [rows] * num_tables
    )
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables, device=device),
            dense_in_features=dense_in,
            dense_arch_layer_sizes=[dim],
            over_arch_layer_sizes=over_arch,
            dense_device=device,
        )
    )


class EmbeddingsModel(nn.Module):
    """
    Pooled (EBC) and sequence (EC) embeddings and a dense layer.

    Args:
        ebc (EmbeddingBagCollection): the pooled tables (dim
            :data:`EMBEDDINGS_MODEL_DIM`).
        ec (EmbeddingCollection): the sequence tables.
    """

    def __init__(self, ebc: EmbeddingBagCollection, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec
        self.dense = nn.Linear(EMBEDDINGS_MODEL_DIM, EMBEDDINGS_MODEL_DIM)

    def forward(self, batch: Tuple[KeyedJaggedTensor, KeyedJaggedTensor]) -> Any:
        """
        Args:
            batch (Tuple[KeyedJaggedTensor, KeyedJaggedTensor]): the pooled
                and the sequence features.

        Returns:
            Any: every output flattened into one tensor.
        """
        # by position: a model sharded directly under the same plan must list
        # the pooled features in the same order
        pooled = self.ebc(batch[0]).values()
        sequences = self.ec(batch[1])
        x = torch.cat(pooled.split(EMBEDDINGS_MODEL_DIM, dim=1), dim=0)
        return torch.cat(
            [self.dense(x).flatten()]
            + [sequences[k].values().flatten() for k in sorted(sequences.keys())]
        )


def model_definition(
    device: str = "meta", seed: int = 1, ebc_rows: Optional[Sequence[int]] = None
) -> EmbeddingsModel:
    """
    Args:
        device (str): "cpu" for the weights, anything else for the meta device.
        seed (int): the seed of the EBC (the EC and the dense layer take the
            next two).
        ebc_rows (Optional[Sequence[int]]): rows of the EBC's tables.

    Returns:
        EmbeddingsModel: an EBC of 4 tables, an EC of 2, dense layers.
    """
    dim = EMBEDDINGS_MODEL_DIM
    ebc = make_ebc(4, dims=[dim] * 4, rows=ebc_rows, seed=seed)
    ec = make_ec(2, dim=dim, seed=seed + 1)
    torch.manual_seed(seed + 2)
    model = EmbeddingsModel(ebc, ec)
    if device == "cpu":
        return model
    model.dense.to("meta")
    model.ebc, model.ec = on_meta(ebc), on_meta(ec)
    return model


class SparseArch(nn.Module):
    """
    Two EBCs (pooled) and an EC (sequence), outputs flattened together.

    Args:
        sparse_a (EmbeddingBagCollection): the first pooled tables.
        sparse_b (EmbeddingBagCollection): the second pooled tables.
        seq (EmbeddingCollection): the sequence tables.
    """

    def __init__(
        self,
        sparse_a: EmbeddingBagCollection,
        sparse_b: EmbeddingBagCollection,
        seq: EmbeddingCollection,
    ) -> None:
        super().__init__()
        self.sparse_a = sparse_a
        self.sparse_b = sparse_b
        self.seq = seq

    def forward(self, features: Tuple[KeyedJaggedTensor, ...]) -> torch.Tensor:
        """
        Args:
            features (Tuple[KeyedJaggedTensor, ...]): the features of
                ``sparse_a``, ``sparse_b`` and ``seq``.

        Returns:
            torch.Tensor: every output flattened into one tensor.
        """
        # Pooled embeddings are read by position: a model sharded directly
        # under the same plan must list them in the same order.
        pooled_a = self.sparse_a(features[0]).values()
        pooled_b = self.sparse_b(features[1]).values()
        sequences = self.seq(features[2])
        return torch.cat(
            [pooled_a.flatten(), pooled_b.flatten()]
            + [sequences[k].values().flatten() for k in sorted(sequences.keys())]
        )


def sparse_arch() -> SparseArch:
    """
    Returns:
        SparseArch: the unsharded model, seeded: 3 + 2 pooled tables and 2
        sequence tables.
    """
    return SparseArch(make_ebc(3, seed=1), make_ebc(2, seed=2), make_ec(2, seed=3))
