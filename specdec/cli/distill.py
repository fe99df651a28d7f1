"""``specdec distill``: the command line of :mod:`specdec.training.distill`."""

from __future__ import annotations

import argparse
from dataclasses import fields

from specdec.cli.common import device_dtype
from specdec.loading.base import DTYPES
from specdec.training.distill import DistillConfig, distill, summary_line


def add_distill_parser(sub, add_model_args) -> None:
    """Register ``specdec distill`` on the CLI's subparsers."""
    d = {f.name: f.default for f in fields(DistillConfig)}
    p = sub.add_parser("distill", help="train a small draft model for a target by self-distillation")
    add = p.add_argument
    add("--target", default=d["target"], help="target model: smollm2-135m, a HF folder or a .gguf")
    add("--out", default=None, help="output folder: the draft, plus data.pt and ckpt.pt (required)")
    add("--layers", type=int, default=d["layers"], help="draft decoder layers, copied from the target's")
    add("--init-layers", type=_int_list, default=None, metavar="I,J,...",
        help="target layers to start from (default: evenly spaced, first and last included)")
    add("--data", default=d["data"], help="sharegpt (train split) | PATH.jsonl")
    add("--num-prompts", type=int, default=d["num_prompts"])
    add("--val-prompts", type=int, default=d["val_prompts"],
        help="prompts held out for the val KL (default: min(64, num-prompts/10))")
    add("--response-tokens", type=int, default=d["response_tokens"], help="target tokens per prompt")
    add("--max-prompt-tokens", type=int, default=d["max_prompt_tokens"], help="truncate longer prompts")
    add("--temperature", type=float, default=d["temperature"], help="data generation (0 = greedy)")
    add("--gen-batch-size", type=int, default=d["gen_batch_size"], help="engine batch for generation")
    add("--steps", type=int, default=d["steps"])
    add("--batch-size", type=int, default=d["batch_size"], help="sequences per training step")
    add("--lr", type=float, default=d["lr"])
    add("--warmup-steps", type=int, default=d["warmup_steps"])
    add("--min-lr-ratio", type=float, default=d["min_lr_ratio"], help="final lr / lr (cosine decay)")
    add("--weight-decay", type=float, default=d["weight_decay"])
    add("--grad-clip", type=float, default=d["grad_clip"], help="max grad norm (0 = off)")
    add("--ckpt-every", type=int, default=d["ckpt_every"])
    add("--stop-after", type=int, default=None, help="stop after this step (checkpointed, same schedule)")
    add("--seed", type=int, default=d["seed"])
    add("--resume", action="store_true", help="continue from OUT/data.pt and OUT/ckpt.pt")
    add("--save-dtype", default=d["save_dtype"], choices=sorted(DTYPES), help="dtype of the stored weights")
    add("--write-prompts", default=None, metavar="PATH.jsonl",
        help="only write the training prompts (--data, --num-prompts) to a JSONL file and exit")
    add_model_args(p)
    p.set_defaults(func=cmd_distill)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 0,29, got {text!r}") from None


def cmd_distill(args) -> int:
    if args.write_prompts:
        from specdec.training.distill_data import load_train_prompts, write_prompt_file

        n = write_prompt_file(load_train_prompts(args.data, args.num_prompts), args.write_prompts)
        print(f"distill: wrote {n} training prompts to {args.write_prompts}")
        return 0
    if not args.out:
        raise ValueError("distill needs --out DIR")
    device, dtype = device_dtype(args)
    names = [f.name for f in fields(DistillConfig) if f.name not in ("device", "dtype")]
    cfg = DistillConfig(**{n: getattr(args, n) for n in names}, device=device, dtype=dtype)
    print(summary_line(distill(cfg)))
    return 0
