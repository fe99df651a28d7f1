"""``specdec distill``: the command line of :mod:`specdec.training.distill` (``--kind layers``) and
:mod:`specdec.training.eagle_distill` (``--kind eagle``)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from pathlib import Path

from specdec.cli.common import DISTILL_HELP, device_dtype
from specdec.config import DTYPE_NAMES
from specdec.training.configs import DRAFT_VOCAB, LR, WARM_LR, DistillConfig, EagleTrainConfig

LAYER_ONLY = ("layers", "init_layers", "data", "num_prompts", "val_prompts", "response_tokens", "max_prompt_tokens",
              "temperature", "gen_batch_size", "batch_size", "write_prompts")
EAGLE_ONLY = ("tokens", "init_from", "draft_vocab", "aux_layers", "unroll", "step_decay", "max_len", "batch_tokens",
              "time_budget", "val_docs", "loss_on", "write_tokens", "num_tokens", "split", "target_name", "run_seconds",
              "loss_temperature", "sampled_weight", "prompts_only", "max_turns", "regenerate", "regen_temperatures",
              "top_p", "regen_new_tokens", "regen_seconds", "regen_batch", "regen_start", "measure", "compare", "tree",
              "measure_temperatures", "measure_new_tokens", "measure_prompts", "json")
# the eagle modes besides training, each with the options only it reads (--max-turns and --top-p are shared)
MODES = {"write_tokens": ("num_tokens", "split", "prompts_only"),
         "regenerate": ("regen_temperatures", "regen_new_tokens", "regen_seconds", "regen_batch", "regen_start"),
         "measure": ("compare", "tree", "measure_temperatures", "measure_new_tokens", "measure_prompts", "json")}
SHARED = {"max_turns": ("prompts_only", "regenerate"), "top_p": ("regenerate", "measure")}


def add_distill_parser(sub, add_model_args) -> None:
    """Register ``specdec distill`` on the CLI's subparsers (options left unset take the kind's defaults)."""
    p = sub.add_parser("distill", help=DISTILL_HELP)
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
    add("--tokens", default=None,
        help="[eagle] token file (.npz) written by --write-tokens, or several joined by commas, trained on as one "
             "(required to train)")
    add("--init-from", default=None, metavar="DRAFT",
        help="[eagle] start from this trained eagle draft of the same target (a draft folder or smollm2-135m-draft) "
             "instead of a fresh one: its weights, draft vocabulary and aux layers; --lr defaults lower "
             "(default: none, a fresh draft)")
    add("--draft-vocab", type=int, default=None,
        help=f"[eagle] draft vocabulary size N (most frequent tokens) (default: {DRAFT_VOCAB}, with --init-from "
             "the draft's)")
    add("--aux-layers", type=_int_list, default=None, metavar="I,J,K",
        help="[eagle] target layers whose outputs the draft reads (default: low, middle, high; with --init-from "
             "the draft's)")
    add("--unroll", type=int, default=None, help="[eagle] unrolled drafting steps per training position")
    add("--step-decay", type=float, default=None, help="[eagle] loss weight of step k is decay**k")
    add("--max-len", type=int, default=None, help="[eagle] tokens per conversation (training / tokenising)")
    add("--batch-tokens", type=int, default=None, help="[eagle] padded tokens per training step")
    add("--time-budget", type=float, default=None,
        help="[eagle] training seconds over all runs: fixes the step count after 20 timed steps (default: none, "
             "--steps)")
    add("--run-seconds", type=float, default=None,
        help="[eagle] end this run (checkpointed) after these training seconds; --resume continues exactly "
             "(default: none)")
    add("--loss-temperature", type=float, default=None,
        help="[eagle] sampling temperature of the second KL term (and of the validation overlap)")
    add("--sampled-weight", type=float, default=None,
        help="[eagle] share of the loss that is the KL at --loss-temperature (0: the KL at temperature 1 only)")
    add("--target-name", default=None, help="[eagle] target named in the draft folder (default: --target)")
    add("--val-docs", type=int, default=None, help="[eagle] conversations held out for validation")
    add("--loss-on", default=None, choices=["assistant", "all"], help="[eagle] positions scored")
    add("--write-tokens", default=None, metavar="PATH.npz",
        help="[eagle] only tokenise ShareGPT conversations (--split, --num-tokens, --max-len) and exit "
             "(default: none, train a draft)")
    add("--num-tokens", type=int, default=None, help="[eagle] tokens to write with --write-tokens (default: 12000000)")
    add("--split", default=None, choices=["train", "eval"],
        help="[eagle] ShareGPT split for --write-tokens (default: train)")
    add("--prompts-only", action="store_true", default=None,
        help="[eagle] with --write-tokens: keep only what --regenerate reads (user turns, each reply cut to its "
             "closing tokens, --max-turns replies)")
    add("--max-turns", type=int, default=None, help="[eagle] replies per conversation for --prompts-only and "
                                                    "--regenerate (default: 1)")
    add("--regenerate", default=None, metavar="SRC.npz",
        help="[eagle] with --write-tokens: rewrite SRC's assistant replies with the target's own, once per "
             "--regen-temperatures (default: none)")
    add("--regen-temperatures", type=_float_list, default=None, metavar="T,T",
        help="[eagle] temperatures of the regenerated replies, 0 = greedy (default: 0.7)")
    add("--top-p", type=float, default=None, help="[eagle] top-p of sampled replies and measurements (default: 0.9)")
    add("--regen-new-tokens", type=int, default=None, help="[eagle] most tokens per regenerated reply (default: 256)")
    add("--regen-seconds", type=float, default=None,
        help="[eagle] no new chunk of conversations is regenerated past these seconds of the run, loading "
             "included (default: none)")
    add("--regen-batch", type=int, default=None, help="[eagle] engine rows while regenerating (default: 64)")
    add("--regen-start", type=int, default=None, metavar="K",
        help="[eagle] regenerate from SRC's conversation K on (an earlier file's source_docs end below K; train on "
             "both with --tokens A.npz,B.npz) (default: 0)")
    add("--measure", default=None, metavar="PROMPTS[,PROMPTS]",
        help="[eagle] measure the draft folder --out: mean accepted length on these prompt sets (mtbench, sharegpt, "
             ".jsonl prompt files, .json of token ids by set), written into its record (default: none)")
    add("--compare", default=None, metavar="DRAFT",
        help="[eagle] with --measure: measure this draft too and say whether --out is better everywhere "
             "(default: none)")
    add("--tree", default=None, help="[eagle] with --measure: tree(s), comma list (default: dynamic:31)")
    add("--measure-temperatures", type=_float_list, default=None, metavar="T,T",
        help="[eagle] with --measure: temperatures, 0 = greedy (default: 0,0.7)")
    add("--measure-new-tokens", type=int, default=None, help="[eagle] with --measure: tokens per prompt (default: 128)")
    add("--measure-prompts", type=int, default=None, help="[eagle] with --measure: first N prompts per set "
                                                          "(default: all)")
    add("--json", default=None, metavar="PATH", help="[eagle] with --measure: write the figures here "
                                                     "(default: not written)")
    add("--steps", type=int, default=None, help="training steps")
    add("--lr", type=float, default=None,
        help=f"peak learning rate (default: layers {DistillConfig.lr:g}, eagle {LR:g}, eagle with --init-from "
             f"{WARM_LR:g}: a lower peak keeps what the draft learnt)")
    add("--warmup-steps", type=int, default=None, help="default min(100, steps / 10)")
    add("--min-lr-ratio", type=float, default=None, help="final lr / lr (cosine decay)")
    add("--weight-decay", type=float, default=None, help="AdamW weight decay")
    add("--grad-clip", type=float, default=None, help="max grad norm (0 = off)")
    add("--ckpt-every", type=int, default=None, help="steps between checkpoints")
    add("--stop-after", type=int, default=None, help="stop after this step (checkpointed; default: none)")
    add("--seed", type=int, default=None, help="seed of the initialisation and the data order")
    add("--resume", action="store_true", help="continue from OUT/ckpt.pt (and OUT/data.pt)")
    add("--save-dtype", default=None, choices=sorted(DTYPE_NAMES), help="dtype of the stored weights")
    add("--write-prompts", default=None, metavar="PATH.jsonl",
        help="[layers] only write the training prompts (--data, --num-prompts) to a JSONL file and exit "
             "(default: none, train a draft)")
    add_model_args(p, engine=False)
    _show_kind_defaults(p)
    p.set_defaults(func=cmd_distill)


def _show_kind_defaults(p: argparse.ArgumentParser) -> None:
    """Each option left at None takes its --kind's config default; its help says which (``--help`` shows them)."""
    configs = {kind: {f.name: f.default for f in fields(cls) if f.default is not MISSING}
               for kind, cls in (("layers", DistillConfig), ("eagle", EagleTrainConfig))}
    for action in p._actions:
        if action.default is not None or not action.option_strings or action.nargs == 0 or action.dest == "help":
            continue
        shown = [f"{kind} {cfg[action.dest]}" for kind, cfg in configs.items()
                 if action.dest in cfg and cfg[action.dest] is not None]
        if shown and "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: {', '.join(shown)})".lstrip()


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,0.7, got {text!r}") from None


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
    if args.kind == "eagle":
        _check_eagle_mode(args)
    if args.kind == "eagle" and args.write_tokens:
        return _regenerate(args) if args.regenerate else _write_tokens(args)
    if args.kind == "eagle" and args.measure:
        return _measure(args)
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

        if not args.tokens:
            raise ValueError("distill --kind eagle needs --tokens FILE.npz (write one with --write-tokens)")
        print(eagle_summary(distill_eagle(EagleTrainConfig(**_options(args, EagleTrainConfig, device, dtype)))))
        return 0
    from specdec.training.distill import distill, summary_line

    print(summary_line(distill(DistillConfig(**_options(args, DistillConfig, device, dtype)))))
    return 0


def _write_tokens(args) -> int:
    from specdec.loading.registry import load_model
    from specdec.training.eagle_data import build_token_file

    target = args.target or "smollm2-135m"
    model = load_model(target)
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"target {target!r} has no tokenizer: --write-tokens needs one")
    data = build_token_file(args.write_tokens, tok, args.split or "train", args.num_tokens or 12_000_000,
                            args.max_len or 1024, target=target)
    if args.prompts_only:
        from specdec.training.eagle_regen import eos_ids, prompt_token_file

        data = prompt_token_file(data, args.write_tokens, eos_ids(tok, model.config), args.max_turns or 1)
    size = Path(args.write_tokens).stat().st_size / 2**20
    print(f"distill: wrote {data.meta['num_tokens']} tokens of {data.num_docs} conversations to "
          f"{args.write_tokens} ({size:.1f} MB)")
    return 0


def _check_eagle_mode(args) -> None:
    """An option of another mode (tokenising, regenerating, measuring, training) is an error naming it."""
    mode = "regenerate" if args.regenerate else next((m for m in MODES if getattr(args, m)), None)
    if mode == "regenerate" and not args.write_tokens:
        raise ValueError("--regenerate needs --write-tokens OUT.npz (where the regenerated file goes)")
    for owner, names in MODES.items():
        for name in names:
            if getattr(args, name) is not None and owner != mode:
                raise ValueError(f"--{name.replace('_', '-')} applies only with --{owner.replace('_', '-')}")
    for name, owners in SHARED.items():
        if getattr(args, name) is not None and not any(getattr(args, o) for o in owners):
            raise ValueError(f"--{name.replace('_', '-')} applies only with "
                             f"{' or '.join('--' + o.replace('_', '-') for o in owners)}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _regenerate(args) -> int:
    import signal
    import time

    from specdec.engine import SpecConfig
    from specdec.loading.registry import load_model
    from specdec.training.eagle_regen import RegenConfig, regenerate_token_file

    started = time.perf_counter()  # --regen-seconds counts loading and the engine's warm-up too
    signal.signal(signal.SIGTERM, _interrupt)  # a time limit's SIGTERM still writes the finished conversations
    device, dtype = device_dtype(args)
    cfg = RegenConfig(**{k: v for k, v in {
        "max_new_tokens": args.regen_new_tokens, "temperatures": args.regen_temperatures, "top_p": args.top_p,
        "max_turns": args.max_turns, "max_len": args.max_len, "time_budget": args.regen_seconds,
        "first_doc": args.regen_start,
        "seed": args.seed}.items() if v is not None})
    batch = args.regen_batch or 64
    engine = SpecConfig(device=device, dtype=dtype, max_batch_size=batch, max_num_tokens=max(2048, 16 * batch))
    target = load_model(args.target or "smollm2-135m", dtype=dtype, device=device)
    data = regenerate_token_file(target, args.regenerate, args.write_tokens, cfg, engine, started)
    r = data.meta["regenerated"]
    print(f"distill: regenerated {data.num_docs} conversations ({r['docs_per_temperature']} by temperature) of "
          f"{r['source_docs_considered']} in {r['seconds']:.0f}s: {r['generated_tokens']} reply tokens, "
          f"{r['tokens_per_s']:.0f} tok/s, finish {r['finish']} -> {args.write_tokens} "
          f"({Path(args.write_tokens).stat().st_size / 2**20:.1f} MB)")
    return 0


def _measure(args) -> int:
    import json

    from specdec.loading.registry import load_model
    from specdec.training.eagle_measure import (
        MeasureConfig,
        better_everywhere,
        load_prompt_sets,
        measure,
        record_measurement,
    )

    if not args.out:
        raise ValueError("--measure needs --out DRAFT_FOLDER (the draft measured; its record gets the figures)")
    device, dtype = device_dtype(args)
    target = load_model(args.target or "smollm2-135m", dtype=dtype, device=device)
    sets = load_prompt_sets(args.measure.split(","), target.tokenizer, args.measure_prompts)
    drafts = {"draft": args.out, **({"compare": args.compare} if args.compare else {})}
    figures: dict[str, list[dict]] = {k: [] for k in drafts}
    for tree in (args.tree or "dynamic:31").split(","):
        cfg = MeasureConfig(**{k: v for k, v in {
            "tree": tree, "temperatures": args.measure_temperatures, "top_p": args.top_p,
            "max_new_tokens": args.measure_new_tokens, "seed": args.seed, "device": device, "dtype": dtype}.items()
            if v is not None})
        for role, path in drafts.items():
            figures[role] += measure(load_model(path, dtype=dtype, device=device, target=target), target, sets, cfg)
    for i, r in enumerate(figures["draft"]):
        old = f" | compare {figures['compare'][i]['mean_accepted_length']:.3f}" if args.compare else ""
        print(f"measure: {r['set']} T={r['temperature']:g} {r['tree']}: draft {r['mean_accepted_length']:.3f}{old} | "
              f"by depth {r['acceptance_by_depth'][:8]}")
    report = {"draft": args.out, "device": device, "dtype": dtype, **figures}
    if args.compare:
        report["better_everywhere"] = better_everywhere(figures["draft"], figures["compare"])
        print(f"measure: {args.out} better than {args.compare} on every set: {report['better_everywhere']}")
    record_measurement(args.out, figures["draft"], device, f"compared with {args.compare}" if args.compare else "")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
