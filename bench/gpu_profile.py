"""Where a step's time goes: wall time per engine step against the GPU's kernel time per step, per configuration.

    python -P bench/gpu_profile.py OUT_DIR MODEL PROMPTS

For each configuration of ``CONFIGS`` (``ONLY``: a space-separated subset of their names) an engine is built with
the CUDA defaults (construction captures and warms its graphs), one untimed ``generate`` runs, then a timed one
(steps counted by wrapping ``engine.step``), then a short one under ``torch.profiler``, then one with each step
timed on the host by kind: steps that ran a prefill chunk and the others (``Steps``). Written to OUT_DIR:
``profile.json`` (per configuration: tok/s, steps, ms per step, tokens per step, the profiled run's kernel
milliseconds per step and the share of the wall time the GPU was busy, the steps of each kind, and the host and GPU
time of the prefill chunks, the draft's prefill and the queueing of the next step in the profiled run),
``<name>.txt`` (the profiled run's top operators by GPU time and by host time) and, with ``PYPROF=1``,
``<name>.py.txt`` (cProfile of the prefill steps and of the other steps). A step whose wall time is far above its
kernel time is host-bound: launches, Python or synchronisations, not arithmetic, are what to cut there.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.budget_policy import EpochBudget
from specdec.loading.registry import load_model

# name -> (draft: None | "eagle" | "ngram", SpecConfig fields, temperature, batch, prompt set, prompts)
CONFIGS = {
    "to_g1": (None, {}, 0.0, 1, "mtbench", 6),
    "to_s1": (None, {}, 0.7, 1, "mtbench", 6),
    "ea_g1": ("eagle", {}, 0.0, 1, "mtbench", 6),
    "ea_s1": ("eagle", {}, 0.7, 1, "mtbench", 6),
    "ea_s1_fixed": ("eagle", {"adaptive": False}, 0.7, 1, "mtbench", 6),
    "ng_s1": ("ngram", {}, 0.7, 1, "mtbench", 6),
    "to_g16": (None, {}, 0.0, 16, "mtbench", 32),
    "ea_g16": ("eagle", {}, 0.0, 16, "mtbench", 32),
    "ea_s16_fixed": ("eagle", {"adaptive": False}, 0.7, 16, "mtbench", 32),
    "to_s16": (None, {}, 0.7, 16, "mtbench", 32),
    "ea_s16": ("eagle", {}, 0.7, 16, "mtbench", 32),
    "to_g64": (None, {}, 0.0, 64, "sharegpt", 96),
    "ea_g64": ("eagle", {}, 0.0, 64, "sharegpt", 96),
    "ea_g64_15": ("eagle", {"adaptive": False, "tree": "dynamic:15"}, 0.0, 64, "sharegpt", 96),
    "to_s64": (None, {}, 0.7, 64, "sharegpt", 96),
    "ng_s64": ("ngram", {}, 0.7, 64, "sharegpt", 96),
    "ea_s64": ("eagle", {}, 0.7, 64, "sharegpt", 96),
    # the shipped draft held at budget 0 (plain decoding through the EAGLE step: the draft's catch-up only)
    "ea_g64_b0": ("eagle", {"budget": 0}, 0.0, 64, "sharegpt", 96),
    "ea_s64_b0": ("eagle", {"budget": 0}, 0.7, 64, "sharegpt", 96),
    "ea_s16_b0": ("eagle", {"budget": 0}, 0.7, 16, "mtbench", 32),
    # n-gram held at budget 0: its plain decoding steps against target-only's (to_s64)
    "ng_s64_b0": ("ngram", {"budget": 0}, 0.7, 64, "sharegpt", 96),
    # T=1.0: the defaults at batch 1 and 16, plain decoding at 16 and 64, and the shipped draft held at budget 3 at
    # batch 16 (what its controller held there on the H200)
    "to_t1": (None, {}, 1.0, 1, "mtbench", 6),
    "ea_t1": ("eagle", {}, 1.0, 1, "mtbench", 6),
    "to_t16": (None, {}, 1.0, 16, "mtbench", 32),
    "ea_t16": ("eagle", {}, 1.0, 16, "mtbench", 32),
    "ea_t16_b0": ("eagle", {"budget": 0}, 1.0, 16, "mtbench", 32),
    "ea_t16_b3": ("eagle", {"budget": 3}, 1.0, 16, "mtbench", 32),
    "ng_t16": ("ngram", {}, 1.0, 16, "mtbench", 32),
    "ng_t16_b0": ("ngram", {"budget": 0}, 1.0, 16, "mtbench", 32),
    "to_t64": (None, {}, 1.0, 64, "sharegpt", 96),
    "ng_t64_b0": ("ngram", {"budget": 0}, 1.0, 64, "sharegpt", 96),
    # n-gram forced to chains of one token (``force``: the controller never falls back to plain decoding)
    "ng_t16_f1": ("ngram", {"force": 1}, 1.0, 16, "mtbench", 32),
    "ng_t64_f1": ("ngram", {"force": 1}, 1.0, 64, "sharegpt", 96),
    # request fields (``request``: SamplingParams fields, not the engine's), greedy, against to_g1 / to_g16 / ea_g16:
    # every request asking for its top 5 log-probabilities, with a presence penalty (its batch steps unpipelined) or a
    # logit bias (its rules eager, its steps queued)
    "to_g1_lp": (None, {"request": {"logprobs": 5}}, 0.0, 1, "mtbench", 6),
    "to_g16_lp": (None, {"request": {"logprobs": 5}}, 0.0, 16, "mtbench", 32),
    "ea_g16_lp": ("eagle", {"request": {"logprobs": 5}}, 0.0, 16, "mtbench", 32),
    "to_g16_pen": (None, {"request": {"presence_penalty": 0.5}}, 0.0, 16, "mtbench", 32),
    "ea_g16_pen": ("eagle", {"request": {"presence_penalty": 0.5}}, 0.0, 16, "mtbench", 32),
    "ea_g16_bias": ("eagle", {"request": {"logit_bias": {0: -1.0}}}, 0.0, 16, "mtbench", 32),  # (steps queued)
}
ONLY = os.environ.get("ONLY", "").split()
PYPROF = os.environ.get("PYPROF", "") == "1"  # also a cProfile of one generate per configuration: <name>.py.txt
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # the CPU runs 2 prompts x 8 tokens, for trying the script


def log(*a) -> None:
    print(*a, flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


class Steps:
    """Wraps ``engine.step``: counts the steps and, while ``split`` is on, times each one on the host into
    ``prefill`` (steps that ran a prefill chunk: ``drafter.step_prefilled``) or ``decode``, with a cProfile of
    each kind when ``pyprof`` is on (a run whose times are then the profiler's). The prefill part of a step, the
    drafter's own prefill (none with padded steps: the prefill replays write the draft's KV) and the queueing of the
    next step run inside ``torch.profiler.record_function`` ranges (``RANGES``), so the profiled run's table gives
    their host and GPU time."""

    RANGES = ("specdec::prefill_chunks", "specdec::draft_prefill", "specdec::queue")

    def __init__(self, engine) -> None:
        self.count, self.split, self.pyprof = 0, False, False
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.stats: dict[str, pstats.Stats | None] = {"prefill": None, "decode": None}
        step = engine.step

        def wrapped():
            self.count += 1
            if not self.split:
                return step()
            prof = cProfile.Profile() if self.pyprof else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            out = step()
            if prof is not None:
                prof.disable()
            kind = "prefill" if engine.drafter.step_prefilled else "decode"
            getattr(self, kind).append(time.perf_counter() - t0)
            if prof is not None:
                if self.stats[kind] is None:
                    self.stats[kind] = pstats.Stats(prof)
                else:
                    self.stats[kind].add(prof)
            return out

        engine.step = wrapped
        engine._prefill_chunks = _ranged(self.RANGES[0], engine._prefill_chunks)
        engine.drafter.prefill = _ranged(self.RANGES[1], engine.drafter.prefill)
        if engine.pipeline is not None:
            engine.pipeline.queue = _ranged(self.RANGES[2], engine.pipeline.queue)

    def summary(self) -> dict:
        """Steps of each kind, their median host milliseconds and their share of the timed steps' wall time."""
        total = sum(self.prefill) + sum(self.decode)
        return {kind: {"steps": len(t), "median_ms": 1e3 * statistics.median(t) if t else None,
                       "share": sum(t) / total if total else None}
                for kind, t in (("prefill", self.prefill), ("decode", self.decode))}

    def python_profiles(self) -> str:
        text = io.StringIO()
        for kind, stats in self.stats.items():
            if stats is None:
                continue
            text.write(f"===== {kind} steps ({len(getattr(self, kind))})\n")
            stats.stream = text
            stats.sort_stats("cumulative").print_stats(70)
        return text.getvalue()


def _ranged(name: str, fn):
    def call(*a, **kw):
        with record_function(name):
            return fn(*a, **kw)
    return call


def ranges_table(prof) -> dict:
    """Host and GPU milliseconds and calls of each of ``Steps.RANGES`` in a profiled run."""
    out = {}
    for evt in prof.key_averages():
        if evt.key in Steps.RANGES:
            out[evt.key] = {"calls": evt.count, "cpu_ms": evt.cpu_time_total / 1e3, "gpu_ms": _device_us(evt) / 1e3}
    return out


class FirstUse:
    """Counts what happens on first use while it is active: Triton compilations (kernel names, through Triton's
    post-compile hook where this Triton has one) and CUDA graph captures (``torch.cuda.CUDAGraph.capture_begin``).
    A new engine's first requests should see neither: its warm-up ran every shape."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.captures = 0

    def __enter__(self):
        self._graph_begin = torch.cuda.CUDAGraph.capture_begin if CUDA else None
        if CUDA:
            def begin(graph, *a, **kw):
                self.captures += 1
                return self._graph_begin(graph, *a, **kw)
            torch.cuda.CUDAGraph.capture_begin = begin
        try:
            import triton.knobs as knobs

            self._knobs, self._hook = knobs.runtime, knobs.runtime.jit_post_compile_hook

            def hook(*a, **kw):
                fn = kw.get("fn")
                self.compiled.append(getattr(getattr(fn, "fn", fn), "__name__", repr(fn)))
                return False
            knobs.runtime.jit_post_compile_hook = hook
        except (ImportError, AttributeError):
            self._knobs = None
        return self

    def __exit__(self, *exc) -> None:
        if self._graph_begin is not None:
            torch.cuda.CUDAGraph.capture_begin = self._graph_begin
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._hook


def timed(engine, steps: Steps, prompts, params) -> dict:
    sync()
    steps.count = 0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    bad = [o for o in outs if o.finish_reason == "error"]
    if bad:
        log(f"FAILED {len(bad)}: {bad[0].error!r}")
    n = max(1, steps.count)
    return {"wall_s": wall, "tokens": tokens, "steps": steps.count, "tok_per_s": tokens / wall,
            "ms_per_step": 1e3 * wall / n, "tokens_per_step": tokens / n}


def kernel_ms(prof) -> float:
    """Total GPU kernel time of a profiled run (ms), memcpy and memset included."""
    total = 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            total += _device_us(evt)
    return total / 1e3


def _device_us(evt) -> float:
    """A profiler event's device microseconds (``cuda_time_total`` in older torch)."""
    return evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total


def split_run(engine, steps: Steps, prompts, params, pyprof: bool = False) -> dict:
    """One ``generate`` with each step timed by kind (or, with ``pyprof``, profiled by cProfile by kind)."""
    engine.forget_drafts()
    steps.prefill, steps.decode, steps.split, steps.pyprof = [], [], True, pyprof
    sync()
    engine.generate(prompts, params)
    sync()
    steps.split = False
    return steps.summary()


def main() -> None:
    out, model_path, prompt_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    prompt_sets = json.loads(Path(prompt_file).read_text())
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    eagle = None
    res = {}
    for name, (draft, fields, temp, batch, pset, n) in CONFIGS.items():
        if ONLY and name not in ONLY:
            continue
        if draft == "eagle":
            draft = eagle = eagle or load_model("smollm2-135m-draft", dtype=target.dtype, device=DEV, target=target)
        fields = {"tree": "dynamic:31" if draft is eagle and draft is not None else "chain:8", **fields}
        held = fields.pop("budget", None)
        forced = fields.pop("force", None)
        request = fields.pop("request", {})
        t0 = time.perf_counter()
        cfg = SpecConfig(device=DEV, dtype="bfloat16" if CUDA else "float32", max_batch_size=batch,
                         prefix_cache=False, kv_memory_bytes=3 << 30, **fields)
        engine = SpecEngine(draft, target, cfg)
        if engine.adaptive is not None and (held, forced) != (None, None):  # only it (and 0, which it needs) left
            engine.adaptive = EpochBudget([o for o in engine.adaptive.options if o.nodes in (0, held, forced)])
            if forced is not None:  # held whatever it measures (index 1; budget 0 still gets its probes)
                engine.adaptive._best = lambda state: 1
        build_s = time.perf_counter() - t0
        prompts = prompt_sets[pset][:n if CUDA else 2]
        top_p = 0.9 if temp else 1.0
        params = SamplingParams(max_new_tokens=128 if CUDA else 8, ignore_eos=True, temperature=temp, top_p=top_p,
                                **request)
        steps = Steps(engine)
        with FirstUse() as fresh:
            first = timed(engine, steps, prompts, params)
        first.update(compiled=fresh.compiled, captures=fresh.captures)
        engine.forget_drafts()
        run = timed(engine, steps, prompts, params)
        short = SamplingParams(max_new_tokens=48 if CUDA else 4, ignore_eos=True, temperature=temp, top_p=top_p,
                               **request)
        few = prompts[:max(1, min(len(prompts), batch))]
        sync()
        steps.count = 0
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * CUDA) as prof:
            t1 = time.perf_counter()
            engine.generate(few, short)
            sync()
            prof_wall = time.perf_counter() - t1
        n_steps = max(1, steps.count)
        split = split_run(engine, steps, prompts, params)
        if PYPROF:  # (a run of its own: cProfile slows the host, so its step times are not the split's)
            split_run(engine, steps, prompts, params, pyprof=True)
            (out / f"{name}.py.txt").write_text(steps.python_profiles())
        ranges = ranges_table(prof)
        gpu = kernel_ms(prof)
        avg = prof.key_averages()
        (out / f"{name}.txt").write_text(
            f"{name}: {n_steps} steps, wall {prof_wall * 1e3:.1f} ms, kernels {gpu:.1f} ms\n\n"
            + avg.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n"
            + avg.table(sort_by="self_cpu_time_total", row_limit=30))
        res[name] = {"build_s": build_s, "first": first, "run": run, "plan": engine.plan.as_dict(),
                     "mean_accepted_length": engine.stats.mean_accepted_length,
                     "split": split, "ranges": ranges,
                     "profiled": {"steps": n_steps, "wall_ms_per_step": prof_wall * 1e3 / n_steps,
                                  "kernel_ms_per_step": gpu / n_steps, "gpu_busy": gpu / (prof_wall * 1e3)}}
        p = res[name]["profiled"]
        log(f"profile {name}: {run['tok_per_s']:.0f} tok/s, {run['ms_per_step']:.2f} ms/step, "
            f"{run['tokens_per_step']:.2f} tok/step (first run {first['tok_per_s']:.0f} tok/s); profiled "
            f"{p['wall_ms_per_step']:.2f} ms/step wall, {p['kernel_ms_per_step']:.2f} ms kernels, "
            f"busy {p['gpu_busy']:.2f}; build {build_s:.1f} s; first run: {first['captures']} captures, compiled "
            f"{first['compiled']}")
        pre, dec = split["prefill"], split["decode"]
        log(f"profile {name}: prefill steps {pre['steps']} at {pre['median_ms'] or 0:.2f} ms ({pre['share'] or 0:.0%} "
            f"of step time), decode steps {dec['steps']} at {dec['median_ms'] or 0:.2f} ms; profiled ranges "
            + ", ".join(f"{k.split('::')[1]} {v['calls']}x host {v['cpu_ms'] / v['calls']:.2f} ms "
                        f"gpu {v['gpu_ms'] / v['calls']:.2f} ms" for k, v in ranges.items()))
        (out / "profile.json").write_text(json.dumps(res, indent=1))
        del engine
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
