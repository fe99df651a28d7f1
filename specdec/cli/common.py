"""Options and helpers shared by the ``specdec`` subcommands."""

from __future__ import annotations

import argparse


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
