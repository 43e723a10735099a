#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What the benchmark scripts share: the set-up of their unsharded modules and
their ranks, the collection of every rank's results, number formatting for
their tables, and writing a run's results (JSON, and a plot) to the output
folder. Each script keeps what it measures and how it tells it.
"""

import argparse
import json
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

MiB: int = 1 << 20


def output_arguments() -> argparse.ArgumentParser:
    """
    The arguments of a benchmark's output, for ``argparse``'s ``parents=``:
    ``--out-dir`` (default: ``benchmarks/results``) and ``--no-plot``.
    """
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--out-dir",
        type=str,
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
        help="where the results (JSON and plot) are written",
    )
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    return p


def benchmark_parser(
    description: Optional[str],
    formatter_class: Type[argparse.HelpFormatter] = argparse.HelpFormatter,
) -> argparse.ArgumentParser:
    """
    A benchmark's argument parser, with the output arguments
    (:func:`output_arguments`).

    Args:
        description (Optional[str]): what ``--help`` says the benchmark
            does.
        formatter_class (Type[argparse.HelpFormatter]): how ``--help`` lays
            it out.

    Returns:
        argparse.ArgumentParser: the parser; the benchmark adds its own
        arguments.
    """
    return argparse.ArgumentParser(
        description=description,
        formatter_class=formatter_class,
        parents=[output_arguments()],
    )


def save_figure(fig: Any, path: str, dpi: Optional[int] = 110) -> None:
    """
    Lays a matplotlib figure out tightly and writes it to ``path``.

    Args:
        fig (matplotlib.figure.Figure): the figure.
        path (str): the image file.
        dpi (Optional[int]): its resolution (None: matplotlib's default).
    """
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)


def fmt(x: Optional[float], spec: str) -> str:
    """``x`` formatted with ``spec``, or "-" when there is none."""
    return "-" if x is None else format(x, spec)


def table_head(columns: Sequence[Tuple[str, int]], tail: str = "") -> List[str]:
    """
    The head of a text table and the rule under it.

    Args:
        columns (Sequence[Tuple[str, int]]): each column's label and width
            (right-aligned; a negative width: left-aligned), one space apart.
        tail (str): text after the last column, as it is.

    Returns:
        List[str]: the head line and a rule of its length.
    """
    head = " ".join(
        format(label, f"<{-width}" if width < 0 else f">{width}")
        for label, width in columns
    )
    head += tail
    return [head, "-" * len(head)]


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def meta_ebc(names: Sequence[str], rows: int, dim: int) -> Any:
    """
    An unsharded ``EmbeddingBagCollection`` of ``rows`` x ``dim`` tables (the
    feature of table ``t`` is ``f_t``) on the meta device: it never allocates.
    """
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=dim,
            num_embeddings=rows,
            feature_names=[f"f_{name}"],
        )
        for name in names
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def worker_setup(
    port: int, verbose: bool, loggers: Sequence[str] = ("torchrec",)
) -> None:
    """
    A benchmark worker's first steps: rendezvous on localhost at ``port``, one
    intra-op thread per rank (the ranks share the machine's cores), and,
    unless ``verbose``, no warnings and only errors from ``loggers``.

    Args:
        port (int): the rendezvous port (``MASTER_PORT``).
        verbose (bool): keep warnings and the loggers' messages.
        loggers (Sequence[str]): the loggers to silence below ERROR.

    Returns:
        None
    """
    import logging
    import warnings

    import torch

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if not verbose:
        warnings.filterwarnings("ignore")
        for name in loggers:
            logging.getLogger(name).setLevel(logging.ERROR)


def progress(rank: int, verbose: bool, message: str) -> None:
    """
    A worker's progress line: printed (and flushed) by rank 0 when verbose.

    Args:
        rank (int): the worker's rank.
        verbose (bool): whether the run reports progress.
        message (str): the line.

    Returns:
        None
    """
    if rank == 0 and verbose:
        print(message, flush=True)


def gather_to_json(results: List[Any], path: str, group: Any) -> None:
    """
    Every rank's ``results``, gathered on every rank of ``group`` and written
    by its first rank to ``path`` as a list by rank; a barrier after.
    """
    import torch.distributed as dist

    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, results, group=group)
    if dist.get_rank(group) == 0:
        with open(path, "w") as f:
            json.dump(gathered, f)
    dist.barrier(group=group)


def save_results(
    out_dir: str,
    name: str,
    payload: Dict[str, Any],
    plot: Optional[Callable[[str], None]] = None,
) -> str:
    """
    Writes a run's results to ``out_dir/name.json`` and, with ``plot``, its
    plot to ``out_dir/name.png`` (``plot`` gets the path); says so.

    Returns:
        str: the path of the JSON file without its extension.
    """
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    with open(stem + ".json", "w") as f:
        json.dump(payload, f, indent=1)
    if plot is not None:
        plot(stem + ".png")
    print(f"\nwrote {stem}.json" + ("" if plot is None else f" and {stem}.png"))
    return stem
