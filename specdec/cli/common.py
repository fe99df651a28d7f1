"""Options and helpers shared by the ``specdec`` subcommands."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add ``--device`` and ``--dtype`` to a subcommand."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")


def device_dtype(args) -> tuple[str, str]:
    """(device, dtype) from ``--device`` / ``--dtype``: cuda + bfloat16 when CUDA is there, else cpu + float32.

    Raises UsageError (naming the flag) for a device that does not exist here."""
    from specdec.cli.checks import device_and_dtype

    return device_and_dtype(args.device, args.dtype)
