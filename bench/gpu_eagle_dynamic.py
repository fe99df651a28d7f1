"""Dynamic EAGLE trees grown inside the device program (``specdec/drafters/eagle_dynamic.py``) with the
shipped draft and the real target: mean accepted length of tree shapes, and the GPU speed round.

    python -P bench/gpu_eagle_dynamic.py mal OUT_DIR MODEL PROMPTS [N [NEW [TREE ...]]]
        # float32 greedy mean accepted length of N MT-bench prompts (default 4, evenly spaced over the 80,
        # so over the categories) x NEW tokens (default 48),
        # one batch: the device program's dynamic:B:KxD shapes against the host path's dynamic:B and
        # topk:2x4 (CPU or GPU; cuda_graphs on for the device program: on the CPU its padded step runs eagerly);
        # TREE: device shapes, or host:TREE for the host path (default: both lists below)
    python -P bench/gpu_eagle_dynamic.py speed OUT_DIR MODEL PROMPTS [TREE ...]
        # bf16 on the GPU: tok/s and mean accepted length at batch 1 (20 prompts) and 64 (64 prompts),
        # 128 new tokens, against graphed target-only in the same process (TREE: fixed budgets, default
        # SPEED_TREES; then ADAPTIVE_TREE with the adaptive budget), each with the fused step (the verify
        # launched right behind the device program, specdec/fused_step.py; the default) and, for the
        # trees in env UNFUSED (default "dynamic:31 adaptive"), also without it (SpecConfig(fused_verify=False),
        # name suffix "_unfused"); per-phase host ms per step (propose = the device program + its one read; with the
        # fused step also the verify and its GPU wait; verify = the rest)

MODEL: a GGUF path or a model name (smollm2-135m); PROMPTS: the tokenised prompt file of
``python -P bench/gpu_fastpath.py prompts PROMPTS``. Writes OUT_DIR/eagle_dynamic_<mode>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import CUDA, DEV, log, measured_run, phase_times  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import load_model  # noqa: E402

HOST_TREES = ("topk:2x4", "dynamic:15", "dynamic:31", "dynamic:63")  # host path (no graphs): the reference
DEVICE_TREES = ("dynamic:63", "dynamic:32:10x5", "dynamic:40:10x5", "dynamic:32:8x5", "dynamic:40:8x5",
                "dynamic:48:8x6", "dynamic:32:12x5", "dynamic:32:12x4", "dynamic:32:10x4", "dynamic:32:16x4")
# a verify of N + 1 tokens fills query bucket 16 / 32 / 64 for N = 15 / 31 / 63 (dynamic:63: N = 50 on the device)
SPEED_TREES = ("dynamic:31", "dynamic:15", "dynamic:63", "dynamic:31:8x4", "topk:2x4")
ADAPTIVE_TREE = "dynamic:63"  # also run with the adaptive budget (its best 1, 3, 7, 15, 31 or 50 nodes)
# also run with SpecConfig(fused_verify=False), fused against unfused: env UNFUSED, fixed-budget trees and/or
# "adaptive" (the adaptive run), space separated; "" for none
UNFUSED_TREES = tuple(os.environ.get("UNFUSED", "dynamic:31 adaptive").split())


def _models(model_path: str, dtype: torch.dtype):
    target = load_model(model_path, dtype=dtype, device=DEV)
    return target, load_model("smollm2-135m-draft", dtype=dtype, device=DEV, target=target)


def _mal(draft, target, tree: str, device: bool, prompts, params) -> dict:
    """Greedy mean accepted length of one batch of ``prompts``; ``device``: the graphed path (device program)."""
    eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype="float32", tree=tree, max_batch_size=len(prompts),
                                               cuda_graphs=device, adaptive=False, prefix_cache=False))
    loop = getattr(eng.drafter, "device_loop", None)
    if device and loop is None:
        raise RuntimeError(f"{tree}: no device program")
    t0 = time.perf_counter()
    out = eng.generate(prompts, params)
    st, shape = eng.stats, getattr(loop, "shape", None)
    return {"mean_accepted_length": st.mean_accepted_length, "wall_s": time.perf_counter() - t0,
            "shape": None if shape is None else list(shape), "token_ids": [o.token_ids for o in out],
            "nodes_per_tree": st.drafted / max(1, st.target_forwards), "depth_steps": st.depth_steps,
            "depth_accepted": st.depth_accepted}


def mal(out: Path, model_path: str, prompt_file: str, count: int, new: int, trees: list[str]) -> None:
    every = json.loads(Path(prompt_file).read_text())["mtbench"]
    prompts = every[::max(1, len(every) // count)][:count]  # spread over the categories (10 prompts each)
    target, draft = _models(model_path, torch.float32)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    plain = [o.token_ids for o in SpecEngine(None, target, SpecConfig(device=DEV, dtype="float32")).generate(
        prompts, params)]
    trees = trees or [f"host:{t}" for t in HOST_TREES] + list(DEVICE_TREES)
    runs = [(t.removeprefix("host:"), not t.startswith("host:")) for t in trees]
    res = {"prompts": count, "new_tokens": new}
    for tree, device in runs:
        name = f"{'device' if device else 'host'} {tree}"
        r = _mal(draft, target, tree, device, prompts, params)
        r["equals_target_only"] = r.pop("token_ids") == plain
        res[name] = r
        log(f"{name:30s} mal {r['mean_accepted_length']:.3f}  shape {r['shape']}  equal {r['equals_target_only']}  "
            f"{r['wall_s']:.1f} s")
        (out / "eagle_dynamic_mal.json").write_text(json.dumps(res, indent=1))


def speed(out: Path, model_path: str, prompt_file: str, trees: list[str]) -> None:
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"]
    dt = "bfloat16" if CUDA else "float32"
    target, draft = _models(model_path, torch.bfloat16 if CUDA else torch.float32)
    new = 128 if CUDA else 6
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    res: dict = {"new_tokens": new}
    sizes = {1: 20, 64: 64} if CUDA else {1: 1, 64: 2}
    for b, count in sizes.items():
        ps = prompts[:count]
        base = res[f"target_only_b{b}"] = measured_run(None, target, "chain:4", b, ps, params, dt)
        log(f"batch {b} target-only: {base['tok_per_s']:.1f} tok/s")
        fixed = list(trees or SPEED_TREES)
        runs = [(t, False, True) for t in fixed] + [(t, False, False) for t in UNFUSED_TREES if t in fixed]
        runs += [(ADAPTIVE_TREE, True, True)] + [(ADAPTIVE_TREE, True, False)] * ("adaptive" in UNFUSED_TREES)
        for tree, adaptive, fused in runs:
            name = f"eagle_{tree}{'_adaptive' if adaptive else ''}{'' if fused else '_unfused'}_b{b}"
            engines: list = []
            try:
                r = measured_run(draft, target, tree, b, ps, params, dt, engine_out=engines, adaptive=adaptive,
                                 fused_verify=fused)
                r["phases_ms"] = phase_times(engines[0], ps, params)
            except Exception as exc:  # noqa: BLE001 - reported, the other shapes still run
                res[name] = {"error": repr(exc)}
                log(f"{name} failed: {exc!r}")
                continue
            loop = engines[0].drafter.device_loop
            r["device_program"] = type(loop).__name__ if loop is not None else None
            r["program_graphs"] = len(loop.graphs) if loop is not None else 0
            r["fused_verify"] = fused
            r["speedup"] = r["tok_per_s"] / base["tok_per_s"]
            res[name] = r
            ph = r["phases_ms"]
            log(f"{name}: {r['tok_per_s']:.1f} tok/s, {r['speedup']:.2f}x, mal {r['mean_accepted_length']:.2f}, "
                f"propose {ph['propose']:.3f} ms, verify {ph['verify']:.3f} ms, step {ph['total']:.3f} ms, "
                f"paths {r.get('propose_paths')}")
            (out / "eagle_dynamic_speed.json").write_text(json.dumps(res, indent=1))


def main() -> None:
    cmd, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if cmd == "mal":
        rest = sys.argv[5:]
        mal(out, sys.argv[3], sys.argv[4], int(rest[0]) if rest else 4, int(rest[1]) if len(rest) > 1 else 48,
            rest[2:])
    elif cmd == "speed":
        speed(out, sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        raise SystemExit(f"mode must be mal or speed, got {cmd!r}")


if __name__ == "__main__":
    main()
