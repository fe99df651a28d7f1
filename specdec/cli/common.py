"""Options and helpers shared by the ``specdec`` subcommands."""

from __future__ import annotations

import argparse
import os

from specdec.defaults import DEFAULT_TARGET, GPU_MEMORY_UTILIZATION


class CommandParser(argparse.ArgumentParser):
    """The top-level ``specdec`` parser: an unknown flag is reported with its subcommand's usage, not the top
    level's (``commands``: the subcommand parsers by name, set by ``build_parser``)."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self.commands.get(getattr(parsed, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every default: an option's help gets ``(default: X)`` unless it already says its default
    in words (``default: ...``) or is an on/off switch."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        switch = action.nargs == 0
        if action.default in (None, argparse.SUPPRESS) or switch or "default" in text or not action.option_strings:
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def add_model_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
    """Add ``--device`` and ``--dtype`` to a subcommand; ``engine``: also the engine's memory option."""
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on cuda, float32 on cpu")
    if engine:
        p.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION,
                       help="fraction of the GPU's total memory for the weights and KV pool (as in vLLM)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads on --device cpu (default: half this process's cores, 1 to "
                        f"{MAX_DEFAULT_THREADS}; torch's own default oversubscribes a shared machine)")


MAX_DEFAULT_THREADS = 8
TARGET_HELP = "target: smollm2-135m, a Hugging Face checkpoint folder or a .gguf file"


def add_target_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_TARGET, help: str = TARGET_HELP) -> None:
    """``--model`` (alias ``--target``): the target model, the same flag in every subcommand."""
    p.add_argument("--model", "--target", dest="model", default=default, help=help)


def add_max_tokens_arg(p: argparse.ArgumentParser, default: int) -> None:
    """``--max-new-tokens`` (alias ``--max-tokens``, the OpenAI / vLLM name): the same flag in every subcommand."""
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=default,
                   help="most tokens to generate per request")


def device_dtype(args) -> tuple[str, str]:
    """(device, dtype) from ``--device`` / ``--dtype``: cuda + bfloat16 when CUDA is there, else cpu + float32.
    On the CPU, also sets torch's thread count from ``--threads`` (:func:`cpu_threads`).

    Raises UsageError (naming the flag) for a device that does not exist here or a bad thread count."""
    import torch

    from specdec.cli.checks import check_positive, device_and_dtype

    device, dtype = device_and_dtype(args.device, args.dtype)
    threads = getattr(args, "threads", None)
    check_positive("--threads", threads, allow_none=True)
    if device == "cpu" and (threads is not None or "OMP_NUM_THREADS" not in os.environ):  # (a set OMP_NUM_THREADS wins)
        torch.set_num_threads(cpu_threads(threads))
    return device, dtype


def cpu_threads(requested: int | None = None, cores: int | None = None) -> int:
    """``requested``, else half of ``cores`` (default: the cores this process may run on), 1 to
    MAX_DEFAULT_THREADS. torch's default (every core) spins threads against each other and other processes on a
    shared machine; a 2-core machine measured 20-30x slower that way than with one thread."""
    if requested is not None:
        return requested
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))
