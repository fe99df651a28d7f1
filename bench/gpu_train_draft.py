"""Train the eagle draft of SmolLM2-135M in one timed run, then measure its mean accepted length.

    prepare (CPU, needs the MT-bench and ShareGPT packages):
        python bench/gpu_train_draft.py prepare --data-dir .data/eagle
      writes DATA/eval_prompts.json (MT-bench first turns, ShareGPT eval-split first user turns,
      chat-rendered token ids); the training token file DATA/train.npz comes from
      `specdec distill --kind eagle --write-tokens DATA/train.npz`.
    run (GPU machine or CPU):
        python -P bench/gpu_train_draft.py run --model MODEL.gguf --data-dir .data/eagle --out OUT
      trains for --train-seconds, writes OUT/smollm2-135m-draft/ (the shippable folder), then runs
      evaluations in priority order while the --deadline (seconds since start) allows, writing
      OUT/eagle_eval.json after each and a log line per evaluation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()
# dynamic:63 = 63 nodes + the pending token = 64 verify tokens
DEFAULT_EVALS = ("eagle/dynamic:63/mtbench/0,eagle/dynamic:63/mtbench/0.7,eagle/dynamic:63/sharegpt/0,"
                 "eagle/dynamic:63/sharegpt/0.7,ngram/chain:8/mtbench/0,eagle/chain:5/mtbench/0,"
                 "ngram/chain:8/mtbench/0.7,untrained/dynamic:63/mtbench/0")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def prepare(args) -> int:
    from specdec.loading.registry import load_model

    out = eval_prompts(load_model("smollm2-135m").tokenizer, args.sharegpt_prompts, args.max_prompt_tokens)
    path = Path(args.data_dir) / "eval_prompts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    log(f"wrote {len(out)} prompts to {path}")
    return 0


def eval_prompts(tokenizer, sharegpt_prompts: int, max_prompt_tokens: int, sharegpt_path=None) -> list[dict]:
    """MT-bench first turns and the first ``sharegpt_prompts`` ShareGPT evaluation-split first user turns,
    chat-rendered token ids; prompts longer than ``max_prompt_tokens`` are left out."""
    from specdec.benchmark.data import load_mtbench, load_sharegpt
    from specdec.prompts import to_prompt_ids

    out = []
    for name, prompts in (("mtbench", load_mtbench()),
                          ("sharegpt", load_sharegpt("eval", sharegpt_prompts, path=sharegpt_path))):
        for p in prompts:
            ids = to_prompt_ids(p.messages if p.messages is not None else p.prompt, tokenizer)
            if len(ids) <= max_prompt_tokens:
                out.append({"set": name, "id": p.id, "category": p.category, "ids": ids})
    return out


def evaluate(draft, target, prompts: list[dict], tree: str, temperature: float, args) -> dict:
    """Mean accepted length (tokens committed per target forward), overall, per category, per depth."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.outputs import AcceptanceStats
    from specdec.sampling_params import SamplingParams

    cfg = SpecConfig(tree=tree, device=args.device, dtype=args.dtype, max_batch_size=args.eval_batch,
                     max_num_tokens=max(2048, args.eval_batch * 80), prefix_cache=False)
    engine = SpecEngine(draft, target, cfg)
    params = [SamplingParams(temperature=temperature, top_p=args.top_p if temperature else 1.0, seed=i,
                             max_new_tokens=args.max_new_tokens) for i in range(len(prompts))]
    t = time.perf_counter()
    outs = engine.generate([p["ids"] for p in prompts], params)
    wall = time.perf_counter() - t
    total, by_cat = AcceptanceStats(), {}
    for p, o in zip(prompts, outs):
        if o.error is not None:
            raise o.error
        total.merge(o.stats)
        by_cat.setdefault(p["category"], AcceptanceStats()).merge(o.stats)
    return {"mean_accepted_length": round(total.mean_accepted_length, 4), "prompts": len(prompts),
            "output_tokens": sum(len(o.token_ids) for o in outs), "target_forwards": total.target_forwards,
            "acceptance_by_depth": [round(x, 4) for x in total.acceptance_by_depth],
            "per_category": {c: round(s.mean_accepted_length, 4) for c, s in sorted(by_cat.items())},
            "wall_s": round(wall, 2)}


def train(args, target):
    from specdec.training.eagle_distill import distill_eagle, summary_line
    from specdec.training.eagle_train import EagleTrainConfig

    work = Path(args.work)
    if work.exists() and not args.resume:
        shutil.rmtree(work)
    cfg = EagleTrainConfig(out=str(work), tokens=str(Path(args.data_dir) / "train.npz"), target=args.model,
                           draft_vocab=args.draft_vocab, unroll=args.unroll, max_len=args.max_len,
                           batch_tokens=args.batch_tokens, steps=args.max_steps, time_budget=args.train_seconds,
                           lr=args.lr, warmup_steps=args.warmup_steps, ckpt_every=args.ckpt_every,
                           val_docs=args.val_docs, seed=args.seed,
                           resume=args.resume, device=args.device, dtype=args.dtype)
    res = distill_eagle(cfg, target=target)
    log(summary_line(res))
    if res.folder is None:
        raise RuntimeError("training stopped before its planned steps; no draft folder")
    dest = Path(args.out) / "smollm2-135m-draft"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "specdec_draft.json"):
        shutil.copy(work / name, dest / name)
    meta = json.loads((dest / "specdec_draft.json").read_text())
    meta["target"] = args.target_name
    (dest / "specdec_draft.json").write_text(json.dumps(meta, indent=1))
    return dest, res


def run(args) -> int:
    import torch

    from specdec.loading.registry import load_model
    from specdec.training.folder import load_draft_folder

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads((Path(args.data_dir) / "eval_prompts.json").read_text())
    sets = {s: [p for p in prompts if p["set"] == s][:n] for s, n in (("mtbench", args.mtbench_prompts),
                                                                      ("sharegpt", args.sharegpt_prompts))}
    log(f"device {args.device} {torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}; "
        f"prompts {({k: len(v) for k, v in sets.items()})}")
    target = load_model(args.model, dtype=args.dtype, device=args.device)
    log("target loaded")
    folder, res = train(args, target)
    log(f"draft folder {folder}: {sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.2f} MB")
    draft = load_draft_folder(folder, dtype=args.dtype, device=args.device, target=target)
    report = {"training": res.record, "evals": [], "skipped": []}
    plan = [(d, t, s, float(temp)) for d, t, s, temp in (e.split("/") for e in args.evals.split(","))]
    per_prompt = 0.0  # seconds per prompt of the last evaluation: estimates the next one
    for kind, tree, name, temp in plan:
        left = args.deadline - (time.perf_counter() - T0)
        if left < 1.3 * per_prompt * len(sets[name]) or left < 10:
            report["skipped"].append({"draft": kind, "tree": tree, "set": name, "temperature": temp,
                                      "why": f"{left:.0f}s left before the deadline"})
            continue
        d = {"eagle": draft, "ngram": "ngram", "untrained": lambda: _untrained(draft, target)}[kind]
        d = d() if callable(d) else d
        t = time.perf_counter()
        try:  # one failing evaluation must not cost the others of this (one-shot, timed) run
            r = evaluate(d, target, sets[name], tree, temp, args)  # temperature > 0 uses --top-p
        except Exception as err:  # noqa: BLE001 - recorded with its traceback, then the plan goes on
            traceback.print_exc()
            report["skipped"].append({"draft": kind, "tree": tree, "set": name, "temperature": temp,
                                      "why": f"{type(err).__name__}: {err}"})
            continue
        per_prompt = (time.perf_counter() - t) / max(1, len(sets[name]))
        report["evals"].append({"draft": kind, "tree": tree, "set": name, "temperature": temp,
                                "top_p": args.top_p if temp else 1.0, **r})
        log(f"{kind:9s} {tree:10s} {name:8s} T={temp}: mean accepted length {r['mean_accepted_length']:.3f} "
            f"({r['wall_s']:.0f}s) per depth {r['acceptance_by_depth'][:8]}")
        (out / "eagle_eval.json").write_text(json.dumps(report, indent=1))
    (out / "eagle_eval.json").write_text(json.dumps(report, indent=1))
    log("done")
    return 0


def _untrained(draft, target):
    """A freshly initialised eagle draft of the same shape and vocabulary (the untrained baseline)."""
    from specdec.loading.registry import LoadedModel
    from specdec.training.eagle import eagle_from_target

    m = draft.model
    fresh = eagle_from_target(target.model, m.shape, m.vocab_ids, seed=0).eval().requires_grad_(False)
    return LoadedModel("untrained-eagle", fresh, target.tokenizer, fresh.config)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--sharegpt-prompts", type=int, default=200)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True, help="target: a .gguf path or smollm2-135m")
    r.add_argument("--target-name", default="smollm2-135m", help="target reference written into the folder")
    r.add_argument("--data-dir", required=True, help="holds train.npz and eval_prompts.json")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default="/tmp/eagle_work", help="training folder (checkpoint; not copied back)")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--train-seconds", type=float, default=330)
    r.add_argument("--deadline", type=float, default=520, help="no evaluation starts that would end after this")
    r.add_argument("--max-steps", type=int, default=100_000)
    r.add_argument("--draft-vocab", type=int, default=24576, help="98.4%% of held-out assistant tokens")
    r.add_argument("--unroll", type=int, default=3)
    r.add_argument("--max-len", type=int, default=1024)
    r.add_argument("--batch-tokens", type=int, default=32768)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--warmup-steps", type=int, default=100)
    r.add_argument("--ckpt-every", type=int, default=1000)
    r.add_argument("--val-docs", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--resume", action="store_true")
    r.add_argument("--evals", default=DEFAULT_EVALS,
                   help="comma list of DRAFT/TREE/SET/TEMPERATURE in priority order; DRAFT: eagle, ngram, untrained")
    r.add_argument("--top-p", type=float, default=0.9)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--mtbench-prompts", type=int, default=80)
    r.add_argument("--sharegpt-prompts", type=int, default=200)
    r.add_argument("--eval-batch", type=int, default=100)
    args = ap.parse_args(argv)
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    sys.exit(main())
