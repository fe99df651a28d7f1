"""``specdec distill``: the command line of :mod:`specdec.training.distill` (``--kind layers``) and
:mod:`specdec.training.eagle_distill` (``--kind eagle``)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from specdec.cli.common import device_dtype
from specdec.loading.base import DTYPES
from specdec.training.distill import DistillConfig, distill, summary_line

LAYER_ONLY = ("layers", "init_layers", "data", "num_prompts", "val_prompts", "response_tokens", "max_prompt_tokens",
              "temperature", "gen_batch_size", "batch_size", "write_prompts")
EAGLE_ONLY = ("tokens", "draft_vocab", "aux_layers", "unroll", "step_decay", "max_len", "batch_tokens", "time_budget",
              "val_docs", "loss_on", "write_tokens", "num_tokens", "split")


def add_distill_parser(sub, add_model_args) -> None:
    """Register ``specdec distill`` on the CLI's subparsers (options left unset take the kind's defaults)."""
    p = sub.add_parser("distill", help="train a draft model for a target (layer copy or EAGLE-style head)")
    add = p.add_argument
    add("--kind", default="layers", choices=["layers", "eagle"],
        help="layers: decoder layers copied from the target; eagle: one layer over the target's features")
    add("--model", "--target", dest="target", default=None, help="target model: smollm2-135m, a HF folder or a .gguf")
    add("--out", default=None, help="output folder: the draft, plus data.pt / ckpt.pt (required)")
    add("--layers", type=int, default=None, help="[layers] draft decoder layers, copied from the target's")
    add("--init-layers", type=_int_list, default=None, metavar="I,J,...",
        help="[layers] target layers to start from (default: evenly spaced, first and last included)")
    add("--data", default=None, help="[layers] sharegpt (train split) | PATH.jsonl")
    add("--num-prompts", type=int, default=None, help="[layers] training prompts")
    add("--val-prompts", type=int, default=None,
        help="[layers] prompts held out for the val KL (default: min(64, num-prompts/10))")
    add("--response-tokens", type=int, default=None, help="[layers] target tokens per prompt")
    add("--max-prompt-tokens", type=int, default=None, help="[layers] truncate longer prompts")
    add("--temperature", type=float, default=None, help="[layers] data generation (0 = greedy)")
    add("--gen-batch-size", type=int, default=None, help="[layers] engine batch for generation")
    add("--batch-size", type=int, default=None, help="[layers] sequences per training step")
    add("--tokens", default=None, help="[eagle] token file (.npz) written by --write-tokens")
    add("--draft-vocab", type=int, default=None, help="[eagle] draft vocabulary size N (most frequent tokens)")
    add("--aux-layers", type=_int_list, default=None, metavar="I,J,K",
        help="[eagle] target layers whose outputs the draft reads (default low, middle, high)")
    add("--unroll", type=int, default=None, help="[eagle] unrolled drafting steps per training position")
    add("--step-decay", type=float, default=None, help="[eagle] loss weight of step k is decay**k")
    add("--max-len", type=int, default=None, help="[eagle] tokens per conversation (training / tokenising)")
    add("--batch-tokens", type=int, default=None, help="[eagle] padded tokens per training step")
    add("--time-budget", type=float, default=None, help="[eagle] training seconds (default: none, --steps)")
    add("--val-docs", type=int, default=None, help="[eagle] conversations held out for validation")
    add("--loss-on", default=None, choices=["assistant", "all"], help="[eagle] positions scored")
    add("--write-tokens", default=None, metavar="PATH.npz",
        help="[eagle] only tokenise ShareGPT conversations (--split, --num-tokens, --max-len) and exit "
             "(default: none, train a draft)")
    add("--num-tokens", type=int, default=None, help="[eagle] tokens to write with --write-tokens (default: 12000000)")
    add("--split", default=None, choices=["train", "eval"],
        help="[eagle] ShareGPT split for --write-tokens (default: train)")
    add("--steps", type=int, default=None, help="training steps")
    add("--lr", type=float, default=None, help="peak learning rate")
    add("--warmup-steps", type=int, default=None, help="default min(100, steps / 10)")
    add("--min-lr-ratio", type=float, default=None, help="final lr / lr (cosine decay)")
    add("--weight-decay", type=float, default=None, help="AdamW weight decay")
    add("--grad-clip", type=float, default=None, help="max grad norm (0 = off)")
    add("--ckpt-every", type=int, default=None, help="steps between checkpoints")
    add("--stop-after", type=int, default=None, help="stop after this step (checkpointed; default: none)")
    add("--seed", type=int, default=None, help="seed of the initialisation and the data order")
    add("--resume", action="store_true", help="continue from OUT/ckpt.pt (and OUT/data.pt)")
    add("--save-dtype", default=None, choices=sorted(DTYPES), help="dtype of the stored weights")
    add("--write-prompts", default=None, metavar="PATH.jsonl",
        help="[layers] only write the training prompts (--data, --num-prompts) to a JSONL file and exit "
             "(default: none, train a draft)")
    add_model_args(p, engine=False)
    _show_kind_defaults(p)
    p.set_defaults(func=cmd_distill)


def _show_kind_defaults(p: argparse.ArgumentParser) -> None:
    """Each option left at None takes its --kind's config default; its help says which (``--help`` shows them)."""
    configs = {"layers": {f.name: f.default for f in fields(DistillConfig)}}
    from specdec.training.eagle_train import EagleTrainConfig

    configs["eagle"] = {f.name: f.default for f in fields(EagleTrainConfig)}
    for action in p._actions:
        if action.default is not None or not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue
        shown = [f"{kind} {cfg[action.dest]}" for kind, cfg in configs.items()
                 if action.dest in cfg and cfg[action.dest] is not None]
        if shown and "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: {', '.join(shown)})".lstrip()


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 0,29, got {text!r}") from None


def _options(args, config_cls, device: str, dtype: str) -> dict:
    """The options of ``config_cls`` that were given on the command line (the rest keep defaults)."""
    given = {f.name: getattr(args, f.name) for f in fields(config_cls) if getattr(args, f.name, None) is not None}
    given.pop("resume", None)
    return {**given, "resume": args.resume, "device": device, "dtype": dtype}


def cmd_distill(args) -> int:
    wrong = [n for n in (EAGLE_ONLY if args.kind == "layers" else LAYER_ONLY) if getattr(args, n) is not None]
    if wrong:
        raise ValueError(f"--{wrong[0].replace('_', '-')} does not apply to --kind {args.kind}")
    if args.kind == "eagle" and args.write_tokens:
        return _write_tokens(args)
    if args.write_prompts:
        from specdec.training.distill_data import load_train_prompts, write_prompt_file

        n = write_prompt_file(load_train_prompts(args.data or "sharegpt", args.num_prompts or 4000),
                              args.write_prompts)
        print(f"distill: wrote {n} training prompts to {args.write_prompts}")
        return 0
    if not args.out:
        raise ValueError("distill needs --out DIR")
    device, dtype = device_dtype(args)
    if args.kind == "eagle":
        from specdec.training.eagle_distill import distill_eagle
        from specdec.training.eagle_distill import summary_line as eagle_summary
        from specdec.training.eagle_train import EagleTrainConfig

        if not args.tokens:
            raise ValueError("distill --kind eagle needs --tokens FILE.npz (write one with --write-tokens)")
        print(eagle_summary(distill_eagle(EagleTrainConfig(**_options(args, EagleTrainConfig, device, dtype)))))
        return 0
    print(summary_line(distill(DistillConfig(**_options(args, DistillConfig, device, dtype)))))
    return 0


def _write_tokens(args) -> int:
    from specdec.loading.registry import load_model
    from specdec.training.eagle_data import build_token_file

    target = args.target or "smollm2-135m"
    tok = load_model(target).tokenizer
    if tok is None:
        raise ValueError(f"target {target!r} has no tokenizer: --write-tokens needs one")
    data = build_token_file(args.write_tokens, tok, args.split or "train", args.num_tokens or 12_000_000,
                            args.max_len or 1024, target=target)
    size = Path(args.write_tokens).stat().st_size / 2**20
    print(f"distill: wrote {data.meta['num_tokens']} tokens of {data.num_docs} conversations to "
          f"{args.write_tokens} ({size:.1f} MB)")
    return 0
