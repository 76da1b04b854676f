"""`xgraph check`: the parameterization check of a model on a backend, from the shell.

    xgraph check                              # the tiny reference model, best backend
    xgraph check --model qwen3-0.6b --sizes 8,64 --kind full
    xgraph check --model FOLDER               # a transformers model folder (the extra)

Prints the report (GraphExecutor.check_parameterization) and exits with status 0 when no
launch follows per-step metadata, 1 when one does. On a backend with programmatic dependent
launch (`Kernels.pdl`), a reference model's decode buckets also get the PDL race check
(`xgraph.pdl_check`, `--pdl-replays` pairs of replays each, 0 to skip); a mismatch makes
the status 1. Imports torch only when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

REFERENCE = ("tiny", "qwen3-0.6b")  # reference model shapes (random weights)
DTYPES = ("auto", "float32", "bfloat16", "float16")


@contextlib.contextmanager
def _reference(args: argparse.Namespace, backend: Any) -> Iterator[Any]:
    import torch

    from .models import Qwen3Model, Workload

    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    model = Qwen3Model.build(
        args.model,
        num_blocks=128,
        block_size=args.block_size,
        dtype=dtype,
        device=backend.device,
        seed=0,
    )
    with Workload(model, max_blocks=8, max_seqs=32).executor(backend=backend, name="check") as ex:
        yield ex


@contextlib.contextmanager
def _folder(args: argparse.Namespace, backend: Any) -> Iterator[Any]:
    from .integrations.transformers.cli import _loading
    from .integrations.transformers.model import GraphModel

    with _loading(args.model):
        gm = GraphModel.from_pretrained(
            args.model,
            dtype=None if args.dtype == "auto" else args.dtype,
            backend=backend,
            name="check",
            block_size=args.block_size,
        )
    with gm:
        yield gm.executor


def race(args: argparse.Namespace, backend: Any) -> bool:
    """The PDL race check of the reference model's decode buckets; False on a mismatch."""
    from .pdl_check import check_decode

    replays = getattr(args, "pdl_replays", 0)
    if not replays or args.kind == "piecewise":
        return True
    if args.model not in REFERENCE:
        print("PDL race check: not run (it runs over the reference model shapes only)")
        return True
    reports = check_decode(backend, args.model, list(args.sizes or [4]), replays)
    if reports is None:
        print(f"PDL race check: not run ({backend.name} has no programmatic dependent launch)")
        return True
    for r in reports:
        print(f"PDL race check, bucket {r.describe()}")
    return all(r.clean for r in reports)


def run_check(args: argparse.Namespace) -> int:
    from .plugins import get_backend

    backend = get_backend(args.backend)
    opened = _reference if args.model in REFERENCE else _folder
    kind = None if args.kind == "both" else args.kind
    with opened(args, backend) as ex:
        report = ex.check_parameterization(args.sizes, kind)
    print(report)
    clean = race(args, backend)
    return 0 if report.ok and clean else 1
