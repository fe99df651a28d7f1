"""GPU fast-path round: graphed steps timed against eager and against transformers, n-gram speculation
over MT-bench, float32 equality with graphs on. Writes JSON + logs to OUT; prints a table last.

    python -P bench/gpu_fastpath.py micro OUT_DIR              # random SmolLM2-shaped weights (no model file)
    python -P bench/gpu_fastpath.py real OUT_DIR MODEL PROMPTS  # the real GGUF + pre-tokenised MT-bench prompts
    python -P bench/gpu_fastpath.py eagle OUT_DIR MODEL PROMPTS # the shipped EAGLE draft, graphed, vs target-only
    python -P bench/gpu_fastpath.py hfcompare OUT_DIR MODEL PROMPTS  # target-only vs transformers' static
                                                                     # compiled generate, batch 1, 8 prompts
    python -P bench/gpu_fastpath.py adaptive OUT_DIR MODEL PROMPTS [N]  # n-gram chain:8, adaptive on/off vs
                                                                        # target-only at batch 1, 16, 64
                                                                        # (ADAPTIVE_BATCHES=16,64: those only)
    python -P bench/gpu_fastpath.py prompts PROMPTS            # (CPU) write the tokenised prompt file

On a CPU (for trying the script) everything runs with a tiny model and few tokens.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from specdec.scheduler.scheduler import commit_accepted

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.config import ModelConfig
from specdec.loading.registry import LoadedModel, load_model, truncate_layers
from specdec.models.llama import LlamaForCausalLM
from specdec.runner import _as_signed, causal_bits

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)
TINY = dict(SMOLLM2, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
RESULTS: dict = {}


def log(*a) -> None:
    print(*a, flush=True)


def random_model(dtype=torch.bfloat16) -> LoadedModel:
    cfg = ModelConfig(**(SMOLLM2 if CUDA else TINY))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for layer in model.model.layers:
        layer.input_layernorm.weight.data.fill_(1.0)
        layer.post_attention_layernorm.weight.data.fill_(1.0)
    model.model.norm.weight.data.fill_(1.0)
    model = model.to(DEV, dtype).eval().requires_grad_(False)
    model.rope = model.rope.to(DEV)
    return LoadedModel("random-smollm2-shape", model, None, cfg)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def timed_generate(engine, prompts, params, batch: int, repeats: int = 3) -> dict:
    """Median wall time per engine step and tok/s of running ``prompts`` ``batch`` at a time."""
    walls, steps_all = [], []
    for _ in range(repeats):
        steps = 0
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            for p in prompts[i:i + batch]:
                engine.add_request(p, params)
            while engine.scheduler.has_work:
                engine.step()
                steps += 1
        if CUDA:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        steps_all.append(steps)
    wall = statistics.median(walls)
    n_tok = len(prompts) * params.max_new_tokens
    return {"wall_s": wall, "steps": steps_all[0], "ms_per_step": 1e3 * wall / steps_all[0],
            "tok_per_s": n_tok / wall, "walls": walls}


class _Row(NamedTuple):
    token_ids: list
    positions: list
    prefix_len: int
    seq_len: int
    tree_mask: list | None
    parents: list


def fill_synthetic(engine, key, context: int = 200) -> None:
    """Realistic inputs for bucket ``key``: B rows with ``context`` cached tokens and Q chained queries."""
    _, b, q = key
    bs, graphs = engine.pool.block_size, engine.runner.graphs
    nblk = -(-(context + q) // bs)
    rows, slots, bts = [], [], np.zeros((b, graphs.inputs.width), dtype=np.int32)
    for i in range(b):
        base, first = 1 + i * nblk, context - 1
        rows.append(_Row([100 + j for j in range(q)], list(range(first, first + q)), first, first + q,
                         _as_signed(causal_bits(q, q)) if q > 1 else None, [-1] + list(range(q - 1))))
        slots.append([(base + p // bs) * bs + p % bs for p in range(first, first + q)])
        bts[i, :nblk] = np.arange(base, base + nblk)
    graphs.inputs.fill(b, q, rows, slots, bts)


def user_generate(engine, prompts, params, batch: int, continuous: bool = False, repeats: int = 1) -> dict:
    """tok/s of ``engine.generate`` (what a user runs: detokenisation and streaming included), ``batch``
    prompts at a time (waves: a wave's early finishers leave its tail under-filled), or with ``continuous``
    all prompts in one call, the engine's ``max_batch_size`` (= batch) refilling freed rows at once.
    With ``repeats`` > 1 the whole run is repeated and the median wall time is reported."""
    per_call = len(prompts) if continuous else batch
    walls, n_tok = [], 0
    for _ in range(repeats):
        engine.forget_drafts()  # no drafting from the warm-up's or an earlier repeat's replies to these prompts
        gc.collect()  # a full collection of the engine's ~370k objects takes ~170 ms: not inside one run by chance
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_tok = 0
        for i in range(0, len(prompts), per_call):
            outs = engine.generate(prompts[i:i + per_call], params)
            n_tok += sum(len(o.token_ids) for o in outs)
            _report_failures(outs)
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    return {"wall_s": wall, "walls": walls, "tokens": n_tok, "tok_per_s": n_tok / wall,
            "target_forwards": engine.stats.target_forwards}


_FAILURES_SHOWN = [0]


def _report_failures(outs) -> None:
    """Log how many requests of one ``generate`` failed, with the first cause's traceback (at most 5 per process):
    a benchmark must not pass a failed request off as a short one."""
    bad = [o for o in outs if o.finish_reason == "error"]
    if not bad:
        return
    log(f"FAILED {len(bad)} of {len(outs)} requests: {bad[0].error!r}")
    if _FAILURES_SHOWN[0] < 5:
        _FAILURES_SHOWN[0] += 1
        log("".join(traceback.format_exception(bad[0].error)))


REPEATS = int(os.environ.get("REPEATS", "3" if CUDA else "1"))  # user_generate runs per measured figure


def measured_run(draft, target, tree: str, batch: int, prompts, params, dtype: str, engine_out=None,
                 continuous: bool = False, warm: int = 2, repeats: int = REPEATS, **cfg) -> dict:
    """``user_generate`` of a fresh engine (warmed up on ``warm`` short requests at once, statistics reset
    after), ``repeats`` times: the median run's figures (by tok/s), every run's tok/s, engine steps and, for an EAGLE
    drafter, how many proposals took the device program or the level-by-level path. ``cfg``: more
    SpecConfig fields; the engine is appended to ``engine_out`` when given."""
    eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=dtype, tree=tree, max_batch_size=batch,
                                               prefix_cache=False, **cfg))
    eng.generate(prompts[:warm], SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    steps, step = [0], eng.step

    def counted_step():
        steps[0] += 1
        return step()

    eng.step = counted_step
    runs = []
    for _ in range(repeats):
        eng.stats = type(eng.stats)()
        steps[0], paths = 0, dict(getattr(eng.drafter, "paths", {}))
        chosen = copy.copy(eng.adaptive.chosen) if eng.adaptive is not None else None
        r = user_generate(eng, prompts, params, batch=batch, continuous=continuous)
        r["mean_accepted_length"] = eng.stats.mean_accepted_length
        r["steps"], r["ms_per_step"] = steps[0], 1e3 * r["wall_s"] / max(steps[0], 1)
        r["rows_per_step"] = r["target_forwards"] / max(steps[0], 1)
        if hasattr(eng.drafter, "paths"):
            r["propose_paths"] = {k: v - paths.get(k, 0) for k, v in eng.drafter.paths.items()}
        if eng.adaptive is not None:
            r["mean_budget"] = eng.adaptive.mean_budget(since=chosen)
        runs.append(r)
    r = dict(sorted(runs, key=lambda x: x["tok_per_s"])[len(runs) // 2])  # the median run
    if repeats > 1:
        r["tok_per_s_runs"] = [x["tok_per_s"] for x in runs]
    if engine_out is not None:
        engine_out.append(eng)
    return r


def replay_ms(engine, key, iters: int = 200) -> float | None:
    """Median GPU time of replaying one captured graph (CUDA events) on synthetic 200-token rows."""
    g = engine.runner.graphs.graphs.get(key) if engine.runner.graphs else None
    if g is None or not CUDA:
        return None
    fill_synthetic(engine, key)
    return graph_replay_ms(g[0], iters)


def cuda_ms(fn, iters: int = 200, warm: int = 10) -> float:
    """Median milliseconds per call of ``fn`` on the GPU (CUDA events; ``warm`` calls, then 5 x ``iters``)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


def graph_replay_ms(graph, iters: int = 200) -> float:
    """Median milliseconds per replay of a captured CUDA graph (``cuda_ms`` of its replays)."""
    return cuda_ms(graph.replay, iters)


def phase_times(engine, prompts, params) -> dict:
    """Median host milliseconds per step in schedule / propose / verify (incl. the GPU wait) / commit."""
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # prefill
    phases = {"schedule": [], "propose": [], "verify": [], "commit": [], "total": []}
    while engine.scheduler.has_work:
        t0 = time.perf_counter()
        batch = engine.scheduler.schedule()
        t1 = time.perf_counter()
        engine._prefill(batch)
        prop = engine.drafter.propose(batch.decode)
        t2 = time.perf_counter()
        res = engine.verifier.verify_proposal(batch.decode, prop)
        t3 = time.perf_counter()
        commit_accepted(engine.scheduler, engine.stopper, engine.pool, batch.decode, res)
        t4 = time.perf_counter()
        for k, a, b in (("schedule", t0, t1), ("propose", t1, t2), ("verify", t2, t3), ("commit", t3, t4),
                        ("total", t0, t4)):
            phases[k].append(1e3 * (b - a))
    return {k: statistics.median(v) for k, v in phases.items()}


def micro(out: Path) -> None:
    target = random_model()
    vocab = target.config.vocab_size
    new = 128 if CUDA else 8
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    res = RESULTS.setdefault("micro", {})
    dt = "bfloat16" if CUDA else "float32"
    t0 = time.perf_counter()
    eng = SpecEngine(None, target, SpecConfig(device=DEV, dtype=dt, max_batch_size=64, prefix_cache=False,
                                              cuda_graphs=True if not CUDA else None))
    res["engine_start_s"] = time.perf_counter() - t0
    res["capture"] = str(eng.graph_report)
    log("capture (target-only):", eng.graph_report)
    for b in (1, 8, 32, 64):
        prompts = random_prompts(b if CUDA else 2, 100 if CUDA else 10, vocab, seed=b)
        r = timed_generate(eng, prompts, params, batch=len(prompts), repeats=3 if CUDA else 1)
        res[f"target_only_b{b}"] = r
        log(f"target-only batch {b}: {r['ms_per_step']:.3f} ms/step, {r['tok_per_s']:.0f} tok/s")
    # an n-gram engine with a 63-node lookahead has verify graphs up to 64 tokens per row
    t0 = time.perf_counter()
    wide = SpecEngine("ngram", target, SpecConfig(device=DEV, dtype=dt, max_batch_size=64, prefix_cache=False,
                                                  tree="chain:63", cuda_graphs=True if not CUDA else None))
    res["capture_q64_s"] = time.perf_counter() - t0
    res["capture_q64"] = str(wide.graph_report)
    log("capture (verify up to 64 tokens):", wide.graph_report)
    for key in ((0, 1, 1), (0, 1, 16), (0, 1, 64), (0, 8, 1), (0, 32, 1), (0, 64, 1), (0, 64, 16),
                (0, 16, 1), (0, 16, 4), (0, 16, 8), (0, 16, 16)):  # batch 16: what a chain:8 verify (Q 9) costs
        ms = replay_ms(wide, key)
        res[f"replay_ms_{key[1]}x{key[2]}"] = ms
        log(f"graph replay B={key[1]} Q={key[2]}: {ms}")
    for b in (1, 64):
        prompts = random_prompts(b if CUDA else 2, 200 if CUDA else 10, vocab, seed=b)
        ph = phase_times(eng, prompts, params)
        res[f"phases_ms_b{b}"] = ph
        log(f"phases batch {b}: " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    if CUDA:
        one, tree = res["replay_ms_1x1"], res["replay_ms_1x64"]
        res["tree64_over_decode_b1"] = tree / one
        for b in (1, 64):
            res[f"host_ms_per_step_b{b}"] = res[f"phases_ms_b{b}"]["total"] - res[f"replay_ms_{b}x1"]
            log(f"host ms per step batch {b}: {res[f'host_ms_per_step_b{b}']:.3f}")
    eager = SpecEngine(None, target, SpecConfig(device=DEV, dtype="bfloat16" if CUDA else "float32",
                                                max_batch_size=64, prefix_cache=False, cuda_graphs=False))
    prompts = random_prompts(1, 100 if CUDA else 10, vocab, seed=1)
    r = timed_generate(eager, prompts, SamplingParams(max_new_tokens=32 if CUDA else 4, ignore_eos=True), 1, 1)
    res["eager_target_only_b1"] = r
    log(f"eager target-only batch 1: {r['ms_per_step']:.3f} ms/step")
    (out / "micro.json").write_text(json.dumps(RESULTS, indent=1))


def hf_static_compiled(model_path: str, prompts: list[list[int]], new: int) -> dict:
    """transformers ``generate`` with a static cache, which transformers compiles itself (its
    ``compile_config``: inductor, CUDA graphs); batch 1, the two warm-up prompts excluded."""
    import transformers

    hf = to_hf(load_model(model_path, dtype=torch.bfloat16, device=DEV))
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    walls = []
    for i, ids in enumerate(prompts[:8]):
        x = torch.tensor([ids], device=DEV)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), **kw)
        torch.cuda.synchronize()
        if i >= 2:
            walls.append(time.perf_counter() - t0)
    return {"tok_per_s": new / statistics.median(walls), "walls": walls, "transformers": transformers.__version__}


def to_hf(loaded: LoadedModel):
    from specdec.benchmark.hf import to_hf_model

    return to_hf_model(loaded)


def real(out: Path, model_path: str, prompt_file: str) -> None:
    data = json.loads(Path(prompt_file).read_text())
    prompts = data["mtbench"]
    new = 128 if CUDA else 8
    res = RESULTS.setdefault("real", {})
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    dt = "bfloat16" if CUDA else "float32"
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    n = len(prompts) if CUDA else 2
    for b in (1, 16):
        for name, draft, tree in (("target_only", None, "chain:8"), ("ngram", "ngram", "chain:8")):
            r = res[f"{name}_b{b}"] = measured_run(draft, target, tree, b, prompts[:n], params, dt)
            log(f"real {name} batch {b}: {r['tok_per_s']:.1f} tok/s, mean accepted length "
                f"{r['mean_accepted_length']:.2f}")
        res[f"ngram_speedup_b{b}"] = res[f"ngram_b{b}"]["tok_per_s"] / res[f"target_only_b{b}"]["tok_per_s"]
    (out / "real.json").write_text(json.dumps(RESULTS, indent=1))
    float32_equality(out, model_path, prompts)
    (out / "real.json").write_text(json.dumps(RESULTS, indent=1))
    if CUDA:
        try:
            res["hf_static_compiled_b1"] = hf_static_compiled(model_path, prompts, new)
            res["speedup_vs_hf_static_b1"] = (res["target_only_b1"]["tok_per_s"]
                                              / res["hf_static_compiled_b1"]["tok_per_s"])
            log("hf static compiled:", res["hf_static_compiled_b1"]["tok_per_s"])
        except Exception as exc:  # noqa: BLE001 - the baseline is reported as failed, the round goes on
            res["hf_static_compiled_b1"] = {"error": repr(exc)}
            log("hf static compiled failed:", repr(exc))
    (out / "real.json").write_text(json.dumps(RESULTS, indent=1))


def hfcompare(out: Path, model_path: str, prompt_file: str) -> None:
    """Issue 9's first item in one run: target-only (and n-gram chain:8) at batch 1 against transformers'
    static-cache compiled ``generate`` over the same 8 MT-bench prompts, 128 new tokens each."""
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"][:8]
    new = 128 if CUDA else 4
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    dt = "bfloat16" if CUDA else "float32"
    res = RESULTS.setdefault("hfcompare", {})
    for name, draft in (("target_only", None), ("ngram", "ngram")):
        r = res[f"{name}_b1"] = measured_run(draft, target, "chain:8", 1, prompts, params, dt)
        log(f"hfcompare {name} batch 1: {r['tok_per_s']:.1f} tok/s")
    if CUDA:
        hf = res["hf_static_compiled_b1"] = hf_static_compiled(model_path, prompts, new)
        res["target_only_over_hf_static"] = res["target_only_b1"]["tok_per_s"] / hf["tok_per_s"]
        log(f"hfcompare transformers static compiled: {hf['tok_per_s']:.1f} tok/s; target-only / it = "
            f"{res['target_only_over_hf_static']:.2f}x")
    (out / "hfcompare.json").write_text(json.dumps(RESULTS, indent=1))


def quick(out: Path, model_path: str, prompt_file: str) -> None:
    """n-gram vs target-only at batch 1 and 16 (80 MT-bench prompts); the EAGLE draft is the ``eagle`` mode's."""
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    new = 128 if CUDA else 8
    res = RESULTS.setdefault("quick", {})
    dt = "bfloat16" if CUDA else "float32"
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    n = len(prompts) if CUDA else 2
    runs = [("target_only", None, "chain:8", 1, n), ("ngram", "ngram", "chain:8", 1, n),
            ("target_only", None, "chain:8", 16, n), ("ngram", "ngram", "chain:8", 16, n),
            ("target_only", None, "chain:8", 1, 10 if CUDA else 2)]
    for name, draft, tree, b, count in runs:
        r = res[f"{name}_b{b}_n{count}"] = measured_run(draft, target, tree, b, prompts[:count], params, dt)
        log(f"quick {name} batch {b} ({count} prompts): {r['tok_per_s']:.1f} tok/s, "
            f"mal {r['mean_accepted_length']:.2f}")
    for b in (1, 16):
        spec, plain = res[f"ngram_b{b}_n{n}"], res[f"target_only_b{b}_n{n}"]
        res[f"ngram_speedup_b{b}"] = spec["tok_per_s"] / plain["tok_per_s"]
        log(f"n-gram speed-up batch {b}: {res[f'ngram_speedup_b{b}']:.2f}x")
    (out / "quick.json").write_text(json.dumps(RESULTS, indent=1))


def eagle(out: Path, model_path: str, prompt_file: str) -> None:
    """The shipped EAGLE draft with graphed draft and verify steps against graphed target-only decoding, in
    one process: batch 1 and 64, several tree shapes; the GPU cost of one draft tree level against a target
    verify step (graph replays); per-phase host times of a speculative step."""
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    new = 128 if CUDA else 6
    res = RESULTS.setdefault("eagle", {})
    dt = "bfloat16" if CUDA else "float32"
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    draft = load_model("smollm2-135m-draft", dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV,
                       target=target)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    sizes = {1: 20 if CUDA else 1, 64: 64 if CUDA else 2}
    # (tree, adaptive budget): static shapes fixed and adaptive; at batch 64 a dynamic one for reference and the
    # first shape again last (a first-run penalty of the process would show as a difference between the two)
    static = ("topk:2x3", "topk:2x4", "chain:3")
    trees = {1: [(t, False) for t in static] + [(t, True) for t in static],
             64: [(t, False) for t in static] + [(t, True) for t in static] + [("dynamic:15", False),
                                                                               ("topk:2x3", False)]}
    if not CUDA:
        trees = {1: [("chain:3", False), ("dynamic:7", False), ("chain:3", True)], 64: [("chain:3", False)]}
    for b, count in sizes.items():
        ps = prompts[:count]
        # every engine is warmed up on a whole batch and timed twice: nothing used for the first time is timed
        run = dict(warm=max(2, b), repeats=2 if CUDA else 1)
        base = res[f"target_only_b{b}"] = measured_run(None, target, "chain:4", b, ps, params, dt, **run)
        log(f"eagle round: target-only batch {b}: {base['tok_per_s']:.1f} tok/s, {base['ms_per_step']:.2f} ms/step")
        for tree, adaptive in trees[b]:
            name = f"eagle_{tree}{'_adaptive' if adaptive else ''}_b{b}"
            name += "_again" if name in res else ""
            try:
                r = measured_run(draft, target, tree, b, ps, params, dt, adaptive=adaptive, **run)
            except Exception as exc:  # noqa: BLE001 - reported, the other shapes still run
                res[name] = {"error": repr(exc)}
                log(f"{name} failed: {exc!r}")
                continue
            r["speedup"] = r["tok_per_s"] / base["tok_per_s"]
            res[name] = r
            log(f"{name}: {r['tok_per_s']:.1f} tok/s (runs {r.get('tok_per_s_runs')}), {r['speedup']:.2f}x, "
                f"mal {r['mean_accepted_length']:.2f}, {r['ms_per_step']:.2f} ms/step, paths {r.get('propose_paths')}, "
                f"mean budget {r.get('mean_budget')}")
        (out / "eagle.json").write_text(json.dumps(RESULTS, indent=1))
    eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=dt, tree="dynamic:31", max_batch_size=64,
                                               prefix_cache=False, cuda_graphs=True if not CUDA else None,
                                               adaptive=False))
    res["capture"] = str(eng.graph_report)
    for b in (1, 64):
        verify = replay_ms(eng, (0, b, 32))  # dynamic:31 verifies 32 tokens per row
        for q in (1, 4, 8):
            level = replay_ms(eng, (1, b, q))
            res[f"replay_ms_draft_b{b}_q{q}"] = level
            if verify and level:
                res[f"draft_level_over_verify_b{b}_q{q}"] = level / verify
        res[f"replay_ms_verify_b{b}_q32"] = verify
        ph = phase_times(eng, prompts[:b] if CUDA else prompts[:1], params)
        res[f"phases_ms_b{b}"] = ph
        log(f"eagle dynamic:31 batch {b}: verify replay {verify}, draft level replays "
            f"{[res.get(f'replay_ms_draft_b{b}_q{q}') for q in (1, 4, 8)]}, phases " +
            ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    static_eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=dt, tree="topk:2x3", max_batch_size=64,
                                                      prefix_cache=False, cuda_graphs=True if not CUDA else None,
                                                      adaptive=False))
    for b in (1, 64):  # the device tree loop's step: propose = catch-up + every level in one program + one read
        ph = res[f"phases_ms_topk2x3_b{b}"] = phase_times(static_eng, prompts[:b] if CUDA else prompts[:1], params)
        log(f"eagle topk:2x3 batch {b}: phases " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    (out / "eagle.json").write_text(json.dumps(RESULTS, indent=1))


def adaptive(out: Path, model_path: str, prompt_file: str, count: int | None = None,
             batches: tuple[int, ...] | None = None) -> None:
    """n-gram chain:8 with adaptive budgets on and off against target-only, at ``batches`` (default 1, 16 and
    64; waves of ``batch`` prompts and, above 1, continuous batching), over the first ``count`` MT-bench
    prompts (all 80 on CUDA by default), in one process; per run tok/s, engine steps, ms per step and rows
    per step; the controller's chosen budgets, measured cost table, learned costs and acceptance go into
    adaptive.json."""
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    prompts = prompts[:count or (len(prompts) if CUDA else 4)]
    params = SamplingParams(max_new_tokens=128 if CUDA else 16, ignore_eos=True)
    dt = "bfloat16" if CUDA else "float32"
    target = load_model(model_path, dtype=torch.bfloat16 if CUDA else torch.float32, device=DEV)
    res = RESULTS.setdefault("adaptive", {"prompts": len(prompts), "new_tokens": params.max_new_tokens})
    runs = [("target_only", None, False, False), ("ngram_fixed", "ngram", False, False),
            ("ngram_adaptive", "ngram", True, False)]
    # continuous batching (all prompts submitted, freed rows refilled) besides waves of `batch` prompts
    runs_cont = [(f"{n}_continuous", d, on, True) for n, d, on, _ in runs]
    for b in batches or (1, 16, 64):
        for name, draft, on, cont in runs + (runs_cont if b > 1 else []):
            engines: list = []
            r = res[f"{name}_b{b}"] = measured_run(draft, target, "chain:8", b, prompts, params, dt, engines,
                                                  continuous=cont, adaptive=on)
            ctrl = engines[0].adaptive
            if ctrl is not None:
                r["mean_budget"] = ctrl.mean_budget()
                r["budget_steps"] = {f"{rows}x{n}": c for (rows, n), c in sorted(ctrl.chosen.items())}
                r["depth_rates"] = ctrl.acceptance.rates
                r["verify_cost_table_ms"] = {f"{bb}x{q}": 1e3 * c for (bb, q), c in sorted(ctrl.costs.table.items())
                                             if bb in (1, 16, 64)}
                r["learned_ms"] = {k: {str(kk): 1e3 * v for kk, v in getattr(ctrl.costs, k).items()}
                                   for k in ("offset", "seen", "draft", "other")}
            log(f"adaptive {name} batch {b}: {r['tok_per_s']:.1f} tok/s, mal {r['mean_accepted_length']:.2f}, "
                f"mean budget {r.get('mean_budget')}, {r['steps']} steps, {r['ms_per_step']:.3f} ms/step, "
                f"{r['rows_per_step']:.1f} rows/step")
        for suffix in ("", "_continuous") if b > 1 else ("",):
            base = res[f"target_only{suffix}_b{b}"]["tok_per_s"]
            for name in ("ngram_fixed", "ngram_adaptive"):
                res[f"{name}{suffix}_speedup_b{b}"] = res[f"{name}{suffix}_b{b}"]["tok_per_s"] / base
            log(f"batch {b}{suffix}: fixed {res[f'ngram_fixed{suffix}_speedup_b{b}']:.2f}x, adaptive "
                f"{res[f'ngram_adaptive{suffix}_speedup_b{b}']:.2f}x target-only")
        (out / "adaptive.json").write_text(json.dumps(RESULTS, indent=1))


def float32_equality(out: Path, model_path: str, prompts) -> None:
    """float32, graphs on: speculative == target-only for n-gram, chain, top-k and dynamic trees."""
    target = load_model(model_path, dtype=torch.float32, device=DEV)
    draft = truncate_layers(target, 4)
    params = SamplingParams(max_new_tokens=64 if CUDA else 6, ignore_eos=True)
    ps = prompts[:8] if CUDA else prompts[:2]
    base = dict(device=DEV, dtype="float32", max_batch_size=8, prefix_cache=False)
    ref = [o.token_ids for o in SpecEngine(None, target, SpecConfig(cuda_graphs=False, **base)).generate(ps, params)]
    res = RESULTS.setdefault("float32_equality", {})
    for name, d, tree in (("ngram", "ngram", "chain:8"), ("chain", draft, "chain:4"), ("topk", draft, "topk:2x3"),
                          ("dynamic", draft, "dynamic:16")):
        eng = SpecEngine(d, target, SpecConfig(tree=tree, cuda_graphs=True, **base))
        got = [o.token_ids for o in eng.generate(ps, params)]
        res[name] = {"identical": sum(a == b for a, b in zip(got, ref)), "of": len(ref),
                     "graphs": eng.graph_report.graphs if eng.graph_report else 0,
                     "mean_accepted_length": eng.stats.mean_accepted_length}
        log(f"float32 {name}: identical {res[name]['identical']}/{len(ref)}")


def write_prompts(path: str) -> None:
    """Tokenise the 80 MT-bench first turns with SmolLM2's chat template (run on the CPU)."""
    from specdec.benchmark.data import load_mtbench
    from specdec.prompts import to_prompt_ids

    tok = load_model("smollm2-135m").tokenizer
    ids = [to_prompt_ids(p.to_messages(), tok) for p in load_mtbench()]
    Path(path).write_text(json.dumps({"mtbench": ids}))
    print(f"{len(ids)} prompts -> {path}")


def main() -> None:
    cmd = sys.argv[1]
    if cmd == "prompts":
        return write_prompts(sys.argv[2])
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if CUDA else "cpu"}
    if cmd == "micro":
        micro(out)
    elif cmd == "real":
        real(out, sys.argv[3], sys.argv[4])
    elif cmd == "hfcompare":
        hfcompare(out, sys.argv[3], sys.argv[4])
    elif cmd == "quick":
        quick(out, sys.argv[3], sys.argv[4])
    elif cmd == "eagle":
        eagle(out, sys.argv[3], sys.argv[4])
    elif cmd == "adaptive":
        batches = os.environ.get("ADAPTIVE_BATCHES")  # e.g. "16,64"; default 1, 16, 64
        adaptive(out, sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] else None,
                 tuple(int(b) for b in batches.split(",")) if batches else None)
    log(json.dumps(RESULTS, indent=1, default=str)[-6000:])


if __name__ == "__main__":
    main()
