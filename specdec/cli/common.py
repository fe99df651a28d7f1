"""Options and helpers shared by the ``specdec`` subcommands."""

from __future__ import annotations

import argparse
import os
import re
import sys

from specdec.defaults import DEFAULT_TARGET, GPU_MEMORY_UTILIZATION

_ARGUMENT = re.compile(r"^argument ([^/: ]+)(/[^: ]+)*: ")  # argparse's "argument --flag/--alias: " prefix


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose errors are one line, ``error: --flag: what`` (argparse's ``argument --flag: what`` without
    the usage block above it), exit status 2."""

    def error(self, message: str):
        self.exit(2, "error: " + _ARGUMENT.sub(r"\1: ", message) + "\n")

    def _print_message(self, message: str, file=None) -> None:
        """Write help, usage or version text; a failed write to stdout raises (argparse's own drops the OSError,
        so that ``specdec --help > /dev/full`` would lose the text and exit 0). Errors to stderr keep argparse's
        way: nowhere is left to report a failed write there."""
        file = file or sys.stdout
        if file is not sys.stdout:
            return super()._print_message(message, file)
        if message:
            file.write(message)
            file.flush()


class CommandParser(OneLineErrors):
    """The top-level ``specdec`` parser: an unknown flag is reported by :func:`unknown_flag_message` with its
    subcommand's flags, not the top level's (``commands``: the subcommand parsers by name, set by ``build_parser``)."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            owner = self.commands.get(command, self)
            owner.error(unknown_flag_message(extra, owner, command))
        return parsed


DISTILL_HELP = "train a draft model for a target (layer copy or EAGLE-style head)"

# Flags of vLLM / transformers that specdec lacks: (the specdec flag that does the job or None, what to do instead)
FOREIGN_FLAGS = {
    "--max-model-len": (None, "the model's own context length, its max_position_embeddings, is used"),
    "--max-length": ("--max-new-tokens", "--max-new-tokens N (it counts new tokens only)"),
    "--do-sample": ("--temperature", "--temperature T (> 0 samples; 0, the default, is greedy)"),
    "--num-return-sequences": ("--n", "--n N"),
    "--num-beams": (None, "there is no beam search"),
    "--api-key": (None, "the key of `specdec serve --api-key`: a client's requests carry it"),
    "--speculative-model": ("--draft", "--draft NAME"),
    "--num-speculative-tokens": ("--tree", "--tree chain:K"),
    "--speculative-config": ("--draft", "--draft NAME (a draft model, or ngram) and --tree chain:K for its "
                                        "num_speculative_tokens"),
    "--enable-prefix-caching": (None, "prefix caching is on by default; serve's --no-prefix-cache turns it off"),
    "--disable-log-requests": ("--log-level", "--log-level warning (requests are logged at info)"),
    "--system-prompt": ("--system", "--system TEXT"),
    "--stop-sequences": ("--stop", "--stop STR (repeatable)"),
    "--tokenizer": (None, "the model's own tokenizer is used"),
    "--trust-remote-code": (None, "specdec runs its own model code"),
    "--quantization": (None, "weights run in --dtype; a .gguf file's are dequantized to it"),
    "--enforce-eager": (None, "CUDA graphs are chosen by the engine"),
}


def unknown_flag_message(extra: list[str], parser: argparse.ArgumentParser, command: str | None) -> str:
    """One line about the arguments ``parser`` did not recognise: its first unknown flag with the closest known
    flags (``--max-tokns: unknown flag (did you mean --max-tokens?)``), or with what to use instead of a vLLM /
    transformers flag the command lacks; stray values (no flag) are named as such."""
    import difflib

    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-") and a != "-"]
    if not flags:
        return f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(extra)} (options take --flag VALUE)"
    flag, known = flags[0], [o for a in parser._actions for o in a.option_strings]
    where = f"specdec {command}" if command else "specdec"
    if flag in FOREIGN_FLAGS:
        instead, what = FOREIGN_FLAGS[flag]
        if instead in known:
            return f"{flag}: not a {where} flag; use {what}"
        return f"{flag}: not supported by {where}" + (f" ({what})" if instead is None else "")
    name, names = flag.lstrip("-").replace("_", "-"), [o[2:] for o in known if o.startswith("--")]
    close = [name] if name in names else difflib.get_close_matches(name, names, n=2, cutoff=0.7) or \
        [n for n in names if name.startswith(f"{n}-")][:2]  # --model-path: --model
    hint = f"did you mean {' or '.join('--' + c for c in close)}?" if close else f"`{where} --help` lists the flags"
    return f"{flag}: unknown flag ({hint})"


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
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "half", "float", "fp16", "fp32", "bf16"],
                   help="auto: bfloat16 on cuda, float32 on cpu")
    if engine:
        p.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION,
                       help="fraction of the GPU's total memory for the weights and KV pool (as in vLLM)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads on --device cpu (default: half this process's cores, 1 to "
                        f"{MAX_DEFAULT_THREADS}; torch's own default oversubscribes a shared machine)")


MAX_DEFAULT_THREADS = 8
MAX_THREADS = 1024  # --threads: torch's thread pool segfaulted (or libgomp aborted) making 10**4 or 10**5 of them
TARGET_HELP = ("target: smollm2-135m, a Hugging Face checkpoint folder (or its id, once in the local cache) or a "
               ".gguf file")


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

    from specdec.cli.checks import UsageError, check_positive, device_and_dtype

    device, dtype = device_and_dtype(args.device, args.dtype)
    threads = getattr(args, "threads", None)
    check_positive("--threads", threads, allow_none=True)
    if threads is not None and threads > MAX_THREADS:
        raise UsageError("--threads", f"must be an integer in [1, {MAX_THREADS}], got {threads}")
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
