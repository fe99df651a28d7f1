"""Where a graphed engine step's wall time goes on the GPU machine: the GPU's busy time per step, its idle
gaps, and the host functions that run while the GPU waits (the host time on the step's critical path).

A random SmolLM2-shaped target (``gpu_fastpath.random_model``) with an untrained EAGLE draft of the shipped
draft's shape (no model file needed; acceptance is meaningless, every step drafts the whole tree: adaptive
off), or target-only decoding. Each case: a plain timed pass (ms per step, the figure to compare), then a
few steps under ``torch.profiler`` with Python stacks (its tracing inflates host time, so compare functions
with each other, not with the plain pass). For each profiled step the GPU's kernel intervals are merged;
what is left of the step is GPU idle time, and each Python function is charged the idle time that passes
while it is the innermost frame (its own time on the critical path).

    python -P bench/gpu_step_timeline.py OUT_DIR [CASE ...]   # CASE: MODE:TREE:BATCH, e.g. eagle:dynamic:31:1
    # MODE: decode, eagle, eagle+pipe (pipelined fused steps, specdec/lookahead.py), ngram or ngram-host (fixed
    # budget; ngram-host: the n-gram lookup on the host at any batch size)
    # env TIMELINE_MODEL=PATH TIMELINE_PROMPTS=IDS.json: the real target (bf16) on MT-bench prompts instead of
    # random weights on random prompts (n-gram drafts need real text to find matches), with the shipped EAGLE draft
    # for the eagle modes; TIMELINE_TEMPERATURE=T:
    # the timed steps sample at temperature T (top-p 0.9) instead of greedy
    # default: decode::1 eagle:dynamic:31:1 eagle:topk:2x3:1 eagle:dynamic:31:64

Writes OUT_DIR/timeline.json (per case: ms/step, GPU busy and idle per step, top functions) and one gzipped
Chrome trace per case (open in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import DEV, random_model, random_prompts  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import LoadedModel, load_model  # noqa: E402
from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target  # noqa: E402

MODEL, PROMPTS = os.environ.get("TIMELINE_MODEL"), os.environ.get("TIMELINE_PROMPTS")
TEMP = float(os.environ.get("TIMELINE_TEMPERATURE", "0"))  # > 0: the timed steps sample (top-p 0.9)
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP = "ENGINE_STEP"
ADDRESS = re.compile(r" (of \w+ object )?at 0x[0-9a-f]+")  # "<built-in method view of Tensor object at 0x..>"
OURS = re.compile(r"(specdec|scheduler|kernels)/[\w/]+\.py\(")  # a frame of this project's code


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` (start, end) as sorted disjoint intervals."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap(s: float, e: float, spans: list[tuple[float, float]]) -> float:
    """Length of [s, e) inside the disjoint sorted ``spans``."""
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in spans if a < e and b > s)


def idle_attribution(events: list[dict]) -> dict:
    """Per ``STEP`` annotation of a Chrome trace's ``events``: wall, GPU busy and idle (us), and the idle time
    charged to each Python function (or CUDA runtime call) while it was the innermost frame of its thread;
    medians over the steps. Host events nest per thread (the profiler's stacks do)."""
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == STEP and "dur" in e)
    gpu = merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS and "dur" in e])
    host = [e for e in events if e.get("cat") in ("python_function", "cuda_runtime", "cuda_driver")
            and "dur" in e]
    per_step = []
    for s, e in steps:
        busy = overlap(s, e, gpu)
        idle_spans = []
        t = s
        for a, b in gpu:
            if b <= s or a >= e:
                continue
            if a > t:
                idle_spans.append((t, a))
            t = max(t, b)
        if t < e:
            idle_spans.append((t, e))
        charged: dict[str, float] = defaultdict(float)
        ours: dict[str, float] = defaultdict(float)  # the same, charged to the innermost specdec function
        by_thread = defaultdict(list)
        for ev in host:
            if ev["ts"] < e and ev["ts"] + ev["dur"] > s:
                by_thread[ev["tid"]].append(ev)
        for evs in by_thread.values():
            evs.sort(key=lambda ev: (ev["ts"], -ev["dur"]))
            stack: list[list] = []  # [name, its idle overlap, its children's idle overlap, owner]
            for ev in evs + [None]:
                while stack and (ev is None or ev["ts"] >= stack[-1][4]):
                    name, own, kids, owner, _ = stack.pop()
                    charged[name] += own - kids
                    ours[owner] += own - kids
                    if stack:
                        stack[-1][2] += own
                if ev is not None:
                    name = ADDRESS.sub("", ev["name"])
                    owner = name if OURS.search(name) else (stack[-1][3] if stack else "(outside specdec)")
                    end = ev["ts"] + ev["dur"]
                    stack.append([name, overlap(ev["ts"], end, idle_spans), 0.0, owner, end])
        per_step.append({"wall_us": e - s, "gpu_busy_us": busy, "gpu_idle_us": e - s - busy,
                         "idle_gaps": len(idle_spans), "charged": charged, "ours": ours})
    if not per_step:
        return {"steps": 0}
    med = {k: statistics.median(st[k] for st in per_step) for k in ("wall_us", "gpu_busy_us", "gpu_idle_us",
                                                                      "idle_gaps")}
    s0, e0 = steps[0][0], steps[-1][1]  # the whole window: a pipelined step's kernels run in the next step's
    window = {"window_us_per_step": (e0 - s0) / len(steps),
              "window_gpu_busy_fraction": overlap(s0, e0, gpu) / (e0 - s0)}
    return {"steps": len(per_step), **med, **window, "idle_by_function_us": _top(per_step, "charged"),
            "idle_by_specdec_function_us": _top(per_step, "ours")}


def _top(per_step: list[dict], key: str, n: int = 40) -> dict[str, float]:
    """The ``n`` largest medians over the steps of ``per_step[i][key]`` (a step without a name counts 0)."""
    names = {name for st in per_step for name in st[key]}
    med = {name: statistics.median(st[key].get(name, 0.0) for st in per_step) for name in names}
    return dict(sorted(((k, v) for k, v in med.items() if v >= 1.0), key=lambda kv: -kv[1])[:n])


def eagle_draft(target: LoadedModel) -> LoadedModel:
    cfg = target.config
    shape = EagleShape(default_aux_layers(cfg.num_layers), min(24576, cfg.vocab_size))
    model = eagle_from_target(target.model, shape, torch.arange(shape.draft_vocab), seed=1)
    return LoadedModel("eagle-random", model.eval().requires_grad_(False), None, model.config)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def run_case(case: str, target: LoadedModel, draft: LoadedModel, out: Path) -> dict:
    mode, rest = case.split(":", 1)
    tree, batch = rest.rsplit(":", 1)[0], int(rest.rsplit(":", 1)[1])
    dt = "bfloat16" if DEV == "cuda" else "float32"
    extra = {"tree": tree, "adaptive": False, "pipeline": mode == "eagle+pipe"} if mode.startswith("eagle") else {}
    if mode.startswith("ngram"):  # ngram: the engine's choice of lookup (the device from 8 rows); ngram-host
        extra = {"tree": tree, "adaptive": False, **({"ngram_device": False} if mode == "ngram-host" else {})}
    cfg = SpecConfig(device=DEV, dtype=dt, max_batch_size=64, prefix_cache=False, cuda_graphs=True, **extra)
    eng = SpecEngine(draft if mode.startswith("eagle") else "ngram" if mode.startswith("ngram") else None, target,
                     cfg)
    if PROMPTS:
        prompts = json.loads(Path(PROMPTS).read_text())["mtbench"][:batch]
    else:
        prompts = random_prompts(batch, 100 if DEV == "cuda" else 10, target.config.vocab_size, seed=batch)
    eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up: captures, caches
    plain_steps, prof_steps = (40, 8) if DEV == "cuda" else (4, 2)
    params = SamplingParams(max_new_tokens=4 * (plain_steps + prof_steps + 10), ignore_eos=True, temperature=TEMP,
                            top_p=0.9 if TEMP else 1.0)
    for p in prompts:
        eng.add_request(p, params)
    while eng.scheduler.waiting or any(not r.prefill_done for r in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    walls = []
    for _ in range(plain_steps):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        walls.append(time.perf_counter() - t0)
    sync()
    t0 = time.perf_counter()
    for _ in range(plain_steps):
        eng.step()
    sync()
    pipelined = (time.perf_counter() - t0) / plain_steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with torch.profiler.profile(activities=acts, with_stack=True) as prof:
        for _ in range(prof_steps):  # no sync between steps: a pipelined step's device work runs on
            with torch.profiler.record_function(STEP):
                eng.step()
        sync()
    trace = out / f"trace_{case.replace(':', '_')}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    with trace.open("rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    while eng.scheduler.has_work:
        eng.step()
    res = {"case": case, "ms_per_step_synced": 1e3 * statistics.median(walls),
           "ms_per_step_back_to_back": 1e3 * pipelined, "profiled": idle_attribution(events)}
    p = res["profiled"]
    print(f"{case}: {res['ms_per_step_synced']:.3f} ms/step synced, {res['ms_per_step_back_to_back']:.3f} back to "
          f"back; profiled step {p.get('wall_us', 0):.0f} us, GPU busy {p.get('gpu_busy_us', 0):.0f}, idle "
          f"{p.get('gpu_idle_us', 0):.0f} in {p.get('idle_gaps', 0)} gaps; window {p.get('window_us_per_step', 0):.0f} "
          f"us/step, GPU busy {100 * p.get('window_gpu_busy_fraction', 0):.0f}%", flush=True)
    for title, key in (("innermost frame", "idle_by_function_us"), ("innermost specdec frame",
                                                                       "idle_by_specdec_function_us")):
        print(f" GPU idle by {title} (median us per step):", flush=True)
        for name, us in list(p.get(key, {}).items())[:25]:
            print(f"  {us:8.1f}  {name}", flush=True)
    return res


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cases = sys.argv[2:] or ["decode::1", "eagle:dynamic:31:1", "eagle:topk:2x3:1", "eagle:dynamic:31:64"]
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    target = load_model(MODEL, dtype=dt, device=DEV) if MODEL else random_model(dt)
    draft = load_model("smollm2-135m-draft", dtype=dt, device=DEV, target=target) if MODEL else eagle_draft(target)
    results = []
    for case in cases:
        results.append(run_case(case, target, draft, out))
        (out / "timeline.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
