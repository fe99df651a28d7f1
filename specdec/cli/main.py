"""``specdec`` command line: the parser, ``generate``, and ``main``.

``bench``, ``distill`` and the argument checks live beside it; ``serve`` / ``bench-serve`` live in
``specdec.serving.cli``."""

from __future__ import annotations

import argparse
import errno
import io
import os
import sys
from functools import partial

from specdec.cli.common import (
    CommandParser,
    DefaultsHelpFormatter,
    OneLineErrors,
    add_max_tokens_arg,
    add_target_arg,
)
from specdec.cli.common import add_model_args as _add_model_args
from specdec.cli.common import device_dtype as _device_dtype


def cmd_generate(args) -> int:
    from specdec.cli.bench import PIPELINE_CHOICES
    from specdec.cli.checks import build, check_model, load
    from specdec.cli.parallel import build_engine, check_parallel, start_tensor_parallel
    from specdec.defaults import default_draft, default_tree
    from specdec.engine import SpecConfig
    from specdec.engine_setup import load_device
    from specdec.sampling_params import SamplingParams

    device, dtype = _device_dtype(args)  # every argument is checked before a model loads
    check_parallel(args, device, "generate")
    name = args.draft or default_draft(args.model, device)
    tree = args.tree if args.tree not in (None, "auto") else default_tree(name, device)
    params = build(SamplingParams, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                   seed=args.seed, max_new_tokens=args.max_new_tokens, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, n=args.n, stop=tuple(args.stop or ()),
                   ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                   frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens, logprobs=args.logprobs)
    config = build(SpecConfig, tree=tree, device=device, dtype=dtype, pipeline=PIPELINE_CHOICES[args.pipeline],
                   gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
    check_model("--model", args.model)
    check_model("--draft", name, extra=("ngram", "none"))
    prompt = _prompt(args)
    code = start_tensor_parallel(args, args.model, name)  # the ranks' processes run this command; None: one of them
    if code is not None:
        return code
    note = sampled_speed_note(device, args.temperature, name)
    if note:
        print(note, file=sys.stderr)
    on = load_device(args.tensor_parallel_size, device)
    target = load("--model", args.model, dtype, on)
    draft = name if name in ("ngram", "none") else load("--draft", name, dtype, on, target=target)
    engine = build_engine(None if draft == "none" else draft, target, config)
    if params.n > 1:
        out = engine.generate([prompt], params)[0]
        code = _print_samples(out, engine, args.stats)
    else:
        code, out = _stream(engine, prompt, params)
        if out is not None and args.stats:
            _print_stats(out, engine)
    if code == 0 and out is not None and args.logprobs is not None:
        _print_logprobs(out, args.logprobs)
    if code == 0 and out is not None and (hint := chat_hint(out, args, target.tokenizer)):
        print(hint, file=sys.stderr)
    return code


def _prompt(args) -> str | list[dict]:
    """The request's prompt: ``--prompt`` (``-``: stdin, read here once; tensor-parallel ranks get the text in
    their arguments), with ``--chat`` a message list (``--system`` first). UsageError for ``--system`` without
    ``--chat`` or nothing on stdin."""
    from specdec.cli.checks import UsageError

    if args.system is not None and not args.chat:
        raise UsageError("--system", "is a chat message: add --chat")
    text = args.prompt
    if text == "-":
        text = sys.stdin.read().removesuffix("\n")  # (the newline `echo` adds is no part of the prompt)
        if not text:
            raise UsageError("--prompt", "- reads the prompt from stdin, which gave nothing")
        args.argv = [*args.argv, f"--prompt={text}"]  # (the last --prompt wins)
    if not args.chat:
        return text
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    return [*system, {"role": "user", "content": text}]


def _stream(engine, prompt, params):
    """Stream one request's text to stdout: (exit status, its last output or None). Ctrl-C keeps the text printed
    so far, ends its line and notes ``[interrupted after N tokens]`` on stderr: status 130, as a shell reports
    SIGINT."""
    final, tokens = None, 0
    try:
        for out in engine.stream(prompt, params):
            if out.error is not None:
                return _request_failed(out.error), None
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            final, tokens = out, len(out.token_ids)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"[interrupted after {tokens} tokens]", file=sys.stderr)
        return 130, None
    sys.stdout.write("\n")
    return 0, final


def _request_failed(err: Exception) -> int:
    """Print the request's error on one line (a field the flags set names its flag); the exit status, 2."""
    from specdec.cli.checks import flag_error

    print(f"error: {flag_error(err)}", file=sys.stderr)
    return 2


EARLY_EOS_TOKENS = 3  # an output ended by EOS within this many tokens counts as "ended at once"


def chat_hint(final, args, tokenizer) -> str | None:
    """The note for a raw prompt (no ``--chat``) to a model with a chat template whose every sample ended by EOS
    within ``EARLY_EOS_TOKENS`` tokens: such models often end a prompt that is not in their template at once;
    None otherwise (stop strings given, or EOS ignored, leave nothing to tell)."""
    if args.chat or args.stop or args.ignore_eos or not getattr(tokenizer, "chat_template", None):
        return None
    if all(c.finish_reason == "stop" and len(c.token_ids) <= EARLY_EOS_TOKENS for c in final.outputs):
        return "note: the model ended at once; it is a chat model: add --chat to wrap the prompt in its template"
    return None


def _print_samples(out, engine, stats: bool) -> int:
    """``--n`` > 1: each sample's text after a ``[sample i]`` line, once all are done."""
    if out.error is not None:
        return _request_failed(out.error)
    for c in out.outputs:
        print(f"[sample {c.index}]\n{c.text}")
    if stats:
        _print_stats(out, engine)
    return 0


def _print_logprobs(final, k: int) -> None:
    """``--logprobs K``: per output token (each sample's, after a ``[sample i]`` line when there are several) its
    text, log-probability and rank, then the K most probable tokens', to stderr; then the cumulative log-probability."""
    for c in final.outputs:
        if len(final.outputs) > 1:
            print(f"[sample {c.index}]", file=sys.stderr)
        print(f"{'#':>4}  {'token':<16} {'logprob':>9} {'rank':>5}  most probable", file=sys.stderr)
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            lp, best = entry[tok], sorted(entry.values(), key=lambda v: -v.logprob)[:k]
            top = "  ".join(f"{v.decoded_token!r} {v.logprob:.3f}" for v in best)
            print(f"{j:>4}  {lp.decoded_token!r:<16} {lp.logprob:>9.4f} {lp.rank:>5}  {top}", file=sys.stderr)
        print(f"[cumulative logprob {c.cumulative_logprob:.4f}]", file=sys.stderr)


def _print_stats(final, engine) -> None:
    s = final.stats
    tokens = sum(len(c.token_ids) for c in final.outputs)
    print(f"[{tokens} tokens, finish={final.finish_reason}, target forwards={s.target_forwards}, "
          f"mean accepted length={s.mean_accepted_length:.2f}, acceptance rate={s.acceptance_rate:.2f}]",
          file=sys.stderr)
    print(f"[{engine.plan.describe()}]", file=sys.stderr)


def sampled_speed_note(device: str, temperature: float, draft: str) -> str | None:
    """What ``specdec generate`` tells a user who samples with a draft on CUDA, where sampled speculation may not
    beat target-only decoding; None otherwise."""
    if temperature > 0 and draft != "none" and str(device).startswith("cuda"):
        return ("note: at large batches sampled speculation may not beat target-only decoding; --draft none decodes "
                "target-only, and the output distribution is the same either way")
    return None


def build_parser() -> argparse.ArgumentParser:
    """The ``specdec`` parser (torch is imported by the commands, not by their options)."""
    import specdec
    from specdec.cli.bench import PIPELINE_CHOICES, PIPELINE_HELP, TREE_HELP, add_bench_parser
    from specdec.cli.distill import add_distill_parser
    from specdec.cli.parallel import add_parallel_args

    parser = CommandParser(prog="specdec", description="Lossless speculative decoding engine")
    parser.add_argument("--version", action="version", version=f"specdec {specdec.__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=partial(OneLineErrors, formatter_class=DefaultsHelpFormatter))

    g = sub.add_parser("generate", help="generate text, streaming it to the terminal")
    add_target_arg(g)
    g.add_argument("--draft", default=None,
                   help="draft model name/path, 'ngram', or 'none' (default: the shipped draft, else ngram)")
    g.add_argument("--tree", default=None, help=TREE_HELP)
    g.add_argument("--prompt", required=True,
                   help="the prompt text, or - to read it from stdin (with --chat: the user's message)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="with --chat: a system message before the prompt (default: none)")
    add_max_tokens_arg(g, 128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="seed of a sampled request (default: none, not reproducible)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the likeliest token's probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty of the tokens already in the prompt or output (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token already in the output (in [-2, 2]; 0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="times its count in the output, subtracted from each token's logit (in [-2, 2]; 0 = off)")
    g.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="end the output before this text; repeat for several (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past EOS, up to --max-new-tokens")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="no EOS and no --stop before the output has this many tokens (0 = off)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="print each output token's log-probability and rank, and the K most probable tokens', to "
                        "stderr (0-20; default: off)")
    g.add_argument("--n", type=int, default=1, help="independent samples of the prompt, printed one after another")
    g.add_argument("--stats", action="store_true", help="print acceptance statistics to stderr")
    g.add_argument("--pipeline", default="auto", choices=list(PIPELINE_CHOICES), help=PIPELINE_HELP)
    add_parallel_args(g, replicas=False)
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)

    from specdec.serving.cli import add_serve_parsers

    add_bench_parser(sub, _add_model_args)
    add_serve_parsers(sub, _add_model_args)
    add_distill_parser(sub, _add_model_args)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user error (bad argument, missing or unreadable model or file) prints
    ``error: <message>`` and returns 2, only an internal error shows a traceback. Ctrl-C returns 130 after a
    one-line note; stdout's reader going away (``| head``) returns 141 silently, as for a tool killed by SIGPIPE;
    output that cannot be written (``> /dev/full``, ``>&-``) prints ``error: writing the output failed: ...`` and
    returns 1, as coreutils do."""
    from specdec.loading.errors import ModelNotFoundError

    given = list(sys.argv[1:] if argv is None else argv)
    try:
        if sys.stdout is None and given[:1] != ["serve"]:  # started with stdout closed (``>&-``): Python leaves it
            sys.stdout = _ClosedStdout()  # None and print drops the output (serve's log, sent there, goes to stderr)
        args = build_parser().parse_args(given)  # (--help writes here; a Ctrl-C may land here too)
        args.argv = given  # what tensor-parallel ranks run again
        code = args.func(args)
        if sys.stdout is not None:  # (output still buffered fails here, not in the interpreter's flush at exit)
            sys.stdout.flush()
        return code
    except (ValueError, ModelNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (generate notes what it had printed itself)
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 141
    except OSError as err:
        if err.errno not in WRITE_ERRNOS or err.filename is not None:  # (not a write: opening a file names it)
            raise
        _discard_stdout()
        print(f"error: writing the output failed: {err}", file=sys.stderr)
        return 1


# a write to a stream that cannot take it: a full disk or quota, a file too large, an I/O error, a closed descriptor
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF)


class _ClosedStdout(io.TextIOBase):
    """``sys.stdout`` of a command started with it closed: a write raises the OSError of a closed descriptor."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that the interpreter's last flush at exit does not fail on
    the closed pipe (and print a traceback of its own)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # a stream without a descriptor (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
