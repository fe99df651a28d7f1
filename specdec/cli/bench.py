"""``specdec bench``: acceptance and speed of speculative decoding vs target-only and transformers."""

from __future__ import annotations

import sys
import time

from specdec.benchmark.report import HF_PARTS
from specdec.defaults import CUDA_DRAFT_TREE, default_draft, default_tree

ADAPTIVE_CHOICES = {"auto": None, "on": True, "off": False}  # --adaptive -> SpecConfig.adaptive
PIPELINE_CHOICES = {"auto": None, "on": True, "off": False}  # --pipeline -> SpecConfig.pipeline


def add_bench_parser(sub, add_model_args) -> None:
    from specdec.cli.common import add_max_tokens_arg, add_target_arg
    from specdec.cli.parallel import add_parallel_args

    b = sub.add_parser("bench", help="acceptance + speed report on a prompt set")
    add_target_arg(b)
    b.add_argument("--draft", default=None,
                   help="draft model name/path or 'ngram' (default: the shipped draft, else ngram; no 'none': "
                        "the target-only column is in every report)")
    b.add_argument("--dataset", default="mtbench", help="mtbench | sharegpt | PATH.jsonl")
    b.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default: all)")
    add_max_tokens_arg(b, 128)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    b.add_argument("--batch-size", default="1", help="one batch size or a comma list to sweep, e.g. 1,8,32,64")
    b.add_argument("--tree", default=None, help=TREE_HELP)
    b.add_argument("--baseline", default="none", choices=["hf", "none"],
                   help="hf: also transformers generate (dynamic cache; static cache + torch.compile; assisted)")
    b.add_argument("--hf-configs", default="hf,hf_static,hf_assisted",
                   help="with --baseline hf: which transformers configurations to run (comma list)")
    b.add_argument("--no-hf-compile", action="store_true",
                   help="run the static-cache transformers baseline without torch.compile (quick checks)")
    b.add_argument("--schedule", default="waves", choices=["waves", "continuous"],
                   help="waves: --batch-size prompts per generate call (a wave lasts as long as its slowest row); "
                        "continuous: every prompt submitted at once, --batch-size rows running, freed rows refilled")
    b.add_argument("--adaptive", default="auto", choices=list(ADAPTIVE_CHOICES),
                   help="tree budget from measured costs, 0 = plain decoding (auto: on for CUDA, one budget per batch "
                        "bucket held for epochs of pipelined steps; on: chosen every step, which turns pipelining off "
                        "for drafts; off: the tree's full budget); reports the mean budget")
    b.add_argument("--pipeline", default="auto", choices=list(PIPELINE_CHOICES),
                   help=f"{_PIPELINE_WHAT} (auto: on for CUDA with CUDA graphs; --adaptive on turns it off for drafts)")
    b.add_argument("--seed", type=int, default=0, help="seed of the sampled requests")
    b.add_argument("--json", dest="json_out", default=None, help="write the full report here (default: not written)")
    b.add_argument("--plot", default=None, help="write a plot of the report here, e.g. bench.png (default: none)")
    b.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA, torch on the CPU")
    add_parallel_args(b, replicas=False)
    add_model_args(b)
    b.set_defaults(func=cmd_bench)


TREE_HELP = f"chain:K | topk:WxD | dynamic:BUDGET | dynamic:BUDGET:KxD | auto (the default: n-gram chain:8; a " \
            f"draft model {CUDA_DRAFT_TREE} on CUDA, else chain:4)"
_PIPELINE_WHAT = "pipelined steps, greedy and sampled (each step queued on the device before the host reads the " \
    "previous one): target-only decoding, fused EAGLE steps and n-gram steps with device lookups"
PIPELINE_HELP = f"{_PIPELINE_WHAT} (auto: on for CUDA with CUDA graphs)"  # (generate's: it has no --adaptive)


def engine_mode(engine) -> dict:
    """How a speculative engine resolved its auto options: its plan, under ``plan`` and the summary keys."""
    plan = engine.plan
    return {"pipelined": plan.pipeline, "adaptive_on": plan.adaptive, "budget_epochs": plan.budget_epochs,
            "plan": plan.as_dict()}


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; every size an int >= 1, no repeats (UsageError naming --batch-size otherwise)."""
    from specdec.cli.checks import UsageError

    try:
        sizes = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise UsageError("--batch-size", f"must be integers >= 1 separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise UsageError("--batch-size", f"must be distinct integers >= 1 separated by commas, got {text!r}")
    return sizes


def parse_hf_configs(text: str) -> tuple[str, ...]:
    """``"hf,hf_static"`` -> ("hf", "hf_static"); each must be one of :data:`HF_PARTS` (UsageError otherwise)."""
    from specdec.cli.checks import UsageError

    parts = tuple(p.strip() for p in str(text).split(",") if p.strip())
    bad = [p for p in parts if p not in HF_PARTS]
    if bad or not parts:
        raise UsageError("--hf-configs", f"must be a comma list of {', '.join(HF_PARTS)}, got {text!r}")
    return parts


def check_output_path(flag: str, path: str | None) -> None:
    """A report can be written at ``path`` (None: none asked for): it is no folder and its nearest existing folder
    takes a new file (the missing ones are made when it is written). UsageError naming ``flag`` otherwise, found
    before the benchmark runs."""
    import tempfile
    from pathlib import Path

    from specdec.cli.checks import UsageError

    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(flag, f"{path!r} is a folder; give a file path")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(flag, f"cannot write {path!r}: {str(folder)!r} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise UsageError(flag, f"cannot write {path!r}: no new file can be made in {str(folder)!r} "
                               f"({err.strerror})") from None


def write_report(flag: str, path: str, write) -> None:
    """``write(path)``; an OSError (a full disk, a folder gone) becomes a UsageError naming ``flag`` and ``path``."""
    from specdec.cli.checks import UsageError

    try:
        write(path)
    except OSError as err:
        raise UsageError(flag, f"writing {path!r} failed ({err.strerror or err})") from None


def cmd_bench(args) -> int:
    from specdec.benchmark.data import DATASET_NAMES, load_dataset
    from specdec.benchmark.disturbance import disturbance_note
    from specdec.benchmark.plot import plot_report
    from specdec.benchmark.report import (
        budget_line,
        build_report,
        environment_info,
        format_table,
        lossless_ok,
        write_json,
    )
    from specdec.benchmark.sweep import format_sweep
    from specdec.cli.checks import UsageError, build, check_dataset, check_model, check_positive, load
    from specdec.cli.common import device_dtype
    from specdec.cli.parallel import (
        TP_FLAG,
        build_engine,
        check_parallel,
        start_tensor_parallel,
    )
    from specdec.engine import SpecConfig
    from specdec.engine_setup import load_device
    from specdec.prompts import to_prompt_ids
    from specdec.sampling_params import SamplingParams

    device, dtype = device_dtype(args)  # every argument is checked before a model loads
    check_parallel(args, device, "bench")
    if args.tensor_parallel_size > 1 and args.baseline == "hf":
        raise UsageError("--baseline", f"hf runs transformers in one process; leave it out with {TP_FLAG} "
                                       f"{args.tensor_parallel_size}")
    batch_sizes = parse_batch_sizes(args.batch_size)
    hf_configs = parse_hf_configs(args.hf_configs)
    check_positive("--num-prompts", args.num_prompts, allow_none=True)
    check_output_path("--json", args.json_out)
    check_output_path("--plot", args.plot)
    check_dataset("--dataset", args.dataset, DATASET_NAMES)
    draft_name = args.draft or default_draft(args.model, device)
    if draft_name == "none":
        raise UsageError("--draft", "bench measures a draft against target-only decoding, which every report "
                                    "holds: give a draft model or 'ngram', got 'none'")
    tree = args.tree if args.tree not in (None, "auto") else default_tree(draft_name, device)
    cfg = build(SpecConfig, tree=tree, device=device, dtype=dtype, attention_backend=args.attention_backend,
                max_batch_size=max(64, *batch_sizes), pipeline=PIPELINE_CHOICES[args.pipeline],
                adaptive=ADAPTIVE_CHOICES[args.adaptive], gpu_memory_utilization=args.gpu_memory_utilization,
                tensor_parallel_size=args.tensor_parallel_size)
    params = build(SamplingParams, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   max_new_tokens=args.max_new_tokens)
    check_model("--model", args.model)
    check_model("--draft", draft_name, extra=("ngram",))
    code = start_tensor_parallel(args, args.model, draft_name)  # the ranks run this command; None: one of them
    if code is not None:
        return code
    prompts = load_dataset(args.dataset, args.num_prompts)
    on = load_device(args.tensor_parallel_size, device)
    target = load("--model", args.model, dtype, on)
    draft = "ngram" if draft_name == "ngram" else load("--draft", draft_name, dtype, on, target=target)
    ids = [to_prompt_ids(p.messages if p.messages is not None else p.prompt, target.tokenizer) for p in prompts]
    engines = (build_engine(draft, target, cfg), build_engine(None, target, cfg))
    for prompt, prompt_ids in zip(prompts, ids):  # every prompt checked before the first one runs
        for engine in engines:
            try:
                engine.prepare(prompt_ids, params)
            except ValueError as err:
                raise _request_error(err, prompt.id) from None
    hf = None
    if args.baseline == "hf":
        from specdec.benchmark.hf import HFBaselines
        from specdec.tree_spec import template_from_spec

        hf = HFBaselines(target, draft, template_from_spec(tree).k, params, compile_static=not args.no_hf_compile)
        if hf.assist_skipped and "hf_assisted" in hf_configs:
            print(f"note: {hf.assist_skipped}", file=sys.stderr)
    budgets: dict[int, float | None] = {}
    probes: dict[int, tuple[float, float]] = {}
    sweep = [(b, run_batch_size(engines, hf, prompts, ids, params, b, target, dtype, hf_configs, budgets, probes,
                                schedule=args.schedule)) for b in batch_sizes]
    config = {**vars(args), "batch_size": batch_sizes, "draft": draft_name, "tree": tree, "device": device,
              "dtype": dtype, **engine_mode(engines[0])}
    config.pop("func", None)
    report = build_report(sweep[0][1], environment_info(), config, sweep=sweep)
    for entry in report["sweep"]:
        entry["mean_budget"] = budgets.get(entry["batch_size"])
        probe = entry["probe_s"] = probes.get(entry["batch_size"])
        entry["disturbed"] = probe is not None and disturbance_note(entry["batch_size"], *probe) is not None
    print(format_table(report))
    print(f"steps: {'pipelined' if config['pipelined'] else 'not pipelined'}, adaptive budget "
          f"{'per batch bucket, by epochs' if config['budget_epochs'] else 'on' if config['adaptive_on'] else 'off'}")
    print(budget_line(report), end="")
    print(format_sweep(report), end="")
    if args.json_out:
        write_report("--json", args.json_out, lambda path: write_json(report, path))
    if args.plot:
        try:
            write_report("--plot", args.plot, lambda path: plot_report(report, path))
        except ImportError as err:  # matplotlib is a bench extra; the JSON can be plotted elsewhere
            later = f"python -m specdec.benchmark.plot {args.plot} {args.json_out or 'REPORT.json'}"
            print(f"no plot ({err}); later: {later}", file=sys.stderr)
    return 0 if lossless_ok(report) else 1


def run_batch_size(engines, hf, prompts, ids, params, batch_size: int, target, dtype: str,
                   hf_configs=HF_PARTS, budgets: dict | None = None, probes: dict | None = None,
                   schedule: str = "waves") -> list[dict]:
    """Per-prompt records of one batch size: engine runs, the transformers configurations ``hf_configs``
    (none when ``hf`` is None) and the divergence analysis of every greedy record whose outputs part.
    With an adaptive speculative engine, ``budgets[batch_size]`` gets the mean tree budget it chose;
    ``probes[batch_size]`` the seconds of a short target-only probe before and after the measured runs (a
    warning is printed when they disagree, specdec/benchmark/disturbance.py).
    ``schedule``: how the engines get the prompts (``_run_engine``); transformers always runs waves."""
    from collections import Counter

    from specdec.benchmark.disturbance import disturbance_note, time_probe
    from specdec.benchmark.divergence import classify_divergences, float32_reference

    spec, plain = engines
    _warm_up(spec, plain, ids[:batch_size], params)
    before = time_probe(plain, ids[:batch_size], params)
    device = target.device
    mark = Counter(spec.adaptive.chosen) if spec.adaptive is not None else None
    continuous = schedule == "continuous"
    names = [p.id for p in prompts]
    spec_runs = _run_engine(spec, ids, params, batch_size, f"speculative b={batch_size}", device, continuous, names)
    if mark is not None and budgets is not None:
        budgets[batch_size] = spec.adaptive.mean_budget(since=mark)
    plain_runs = _run_engine(plain, ids, params, batch_size, f"target-only b={batch_size}", device, continuous,
                             names)
    after = time_probe(plain, ids[:batch_size], params)
    if probes is not None:
        probes[batch_size] = (before, after)
    note = disturbance_note(batch_size, before, after)
    if note:
        print(note, file=sys.stderr)
    hf_runs = {part: hf.run(part, ids, batch_size) if hf and part in hf_configs else [None] * len(ids)
               for part in HF_PARTS}
    records = [_record(p, i, s, t, {part: runs[k] for part, runs in hf_runs.items()}, params.greedy)
               for k, (p, i, s, t) in enumerate(zip(prompts, ids, spec_runs, plain_runs))]
    reference = _cached(lambda: float32_reference(target))
    return classify_divergences(records, ids, reference, dtype, target.config.num_layers)


def _cached(make):
    """A zero-argument callable returning ``make()``, made on the first call only."""
    box = []

    def get():
        if not box:
            box.append(make())
        return box[0]

    return get


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _warm_up(spec, plain, group, params) -> None:
    """A short untimed run of both engines at the batch size about to be timed."""
    from dataclasses import replace

    short = replace(params, max_new_tokens=min(8, params.max_new_tokens))
    spec.generate(group, short)
    plain.generate(group, short)
    for engine in (spec, plain):  # the timed run must not draft from the warm-up's (or a past run's) replies
        engine.forget_drafts()


def _run_engine(engine, ids, params, batch_size, label, device, continuous: bool = False,
                names: list[str] | None = None) -> list[dict]:
    """Per prompt: output ids, stats and time (a generate call's time is split by output tokens). Waves:
    ``batch_size`` prompts per generate call; ``continuous``: one call with every prompt, at most
    ``batch_size`` of them running at once (the engine refills a finished row's place at the next step).
    A request that fails raises ``_request_error`` naming its prompt (``names``: the prompts' ids)."""
    from dataclasses import replace

    from tqdm.auto import tqdm

    groups = [ids] if continuous else [ids[s:s + batch_size] for s in range(0, len(ids), batch_size)]
    sched = engine.scheduler
    limit = sched.cfg
    if continuous:
        sched.cfg = replace(limit, max_batch_size=min(batch_size, limit.max_batch_size))
    runs = []
    try:
        for group in tqdm(groups, desc=label, unit="call" if continuous else "batch"):
            _sync(device)
            t0 = time.perf_counter()
            outs = engine.generate(group, params)
            _sync(device)
            elapsed = time.perf_counter() - t0
            total = sum(len(o.token_ids) for o in outs) or 1
            for o in outs:
                if o.error is not None:
                    raise _request_error(o.error, names[len(runs)] if names else str(len(runs) + 1))
                runs.append({"token_ids": o.token_ids, "stats": o.stats, "time_s": elapsed * len(o.token_ids) / total})
    finally:
        sched.cfg = limit
    return runs


def _request_error(err: Exception, name: str) -> Exception:
    """A failed benchmark request as the command line reports it: a field the flags set names its flag
    (``--max-new-tokens``), a prompt the engine refuses names itself in ``--dataset``; anything else is itself."""
    from specdec.cli.checks import UsageError, flag_error
    from specdec.prompts import PromptError

    if isinstance(err, PromptError):
        return UsageError("--dataset", f"prompt {name!r}: {err}")
    return flag_error(err)


def _record(prompt, ids, spec, plain, hf: dict, greedy: bool) -> dict:
    s = spec["stats"]
    return {
        "id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids), "greedy": greedy,
        "spec": {"output_tokens": len(spec["token_ids"]), "time_s": spec["time_s"], "drafted": s.drafted,
                 "accepted": s.accepted, "target_forwards": s.target_forwards,
                 "per_depth_drafted": list(s.depth_steps), "per_depth_accepted": list(s.depth_accepted),
                 "token_ids": spec["token_ids"]},
        "target_only": {"output_tokens": len(plain["token_ids"]), "time_s": plain["time_s"],
                        "token_ids": plain["token_ids"]},
        **hf,
    }
