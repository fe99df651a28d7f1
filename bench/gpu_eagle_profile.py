"""Host profile of EAGLE speculative steps (cProfile, own time per function) on a random SmolLM2-shaped
target with an untrained EAGLE draft of the shipped draft's shape (aux layers 2/15/27, 24,576-token draft
vocabulary): no model file needed, acceptance is meaningless, the host work per step and per row is what
it measures.

    python -P bench/gpu_eagle_profile.py OUT_DIR [TREE ...]   # default: chain:3 topk:2x3 dynamic:15, batch 64 and 1

Each (tree, batch) runs fixed and with the adaptive budget (static trees): first a plain timed pass
(ms/step, the figure to compare), then a pass under cProfile (its own timing is inflated by the profiler,
~1 us per Python call). Prefill is outside both passes: requests are admitted and prefilled first.
"""

from __future__ import annotations

import copy
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import DEV, random_model, random_prompts  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import LoadedModel  # noqa: E402
from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    trees = sys.argv[2:] or ["chain:3", "topk:2x3", "dynamic:15"]
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    target = random_model(dt)
    cfg = target.config
    shape = EagleShape(default_aux_layers(cfg.num_layers), min(24576, cfg.vocab_size))
    model = eagle_from_target(target.model, shape, torch.arange(shape.draft_vocab), seed=1)
    draft = LoadedModel("eagle-random", model.eval().requires_grad_(False), None, model.config)
    res = {}
    for batch in (64, 1):
        prompts = random_prompts(batch, 100 if DEV == "cuda" else 10, target.config.vocab_size, seed=batch)
        params = SamplingParams(max_new_tokens=48 if DEV == "cuda" else 4, ignore_eos=True)
        for tree in trees:
            for adaptive in (False, True) if not tree.startswith("dynamic") else (False,):
                eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=str(dt).split(".")[1], tree=tree,
                                                           max_batch_size=64, prefix_cache=False, adaptive=adaptive,
                                                           cuda_graphs=True))
                eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up, whole batch
                key = f"{tree}{'_adaptive' if adaptive else ''}_b{batch}"
                res[key] = decode_pass(eng, prompts, params, None)
                prof = cProfile.Profile()
                res[key]["profiled_ms_per_step"] = decode_pass(eng, prompts, params, prof)["ms_per_step"]
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
                text = s.getvalue()
                (out / f"profile_{key.replace(':', '_')}.txt").write_text(text)
                print(f"{key}: {res[key]}", flush=True)
                print("\n".join(text.splitlines()[:40]), flush=True)
    (out / "eagle_profile.json").write_text(json.dumps(res, indent=1))


def decode_pass(eng, prompts, params, prof) -> dict:
    """Admit and prefill ``prompts``, then time the decode steps to the end (under ``prof`` when given):
    ms per step, steps, and the EAGLE drafter's proposals by path."""
    for p in prompts:
        eng.add_request(p, params)
    while eng.scheduler.waiting or any(not r.prefill_done for r in eng.scheduler.running):
        eng.step()
    paths = dict(getattr(eng.drafter, "paths", {}))
    chosen = copy.copy(eng.adaptive.chosen) if eng.adaptive is not None else None
    steps = 0
    if DEV == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    while eng.scheduler.has_work:
        eng.step()
        steps += 1
    if prof is not None:
        prof.disable()
    if DEV == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
            "device_loop": getattr(eng.drafter, "device_loop", None) is not None,
            "propose_paths": {k: v - paths.get(k, 0) for k, v in getattr(eng.drafter, "paths", {}).items()},
            "mean_budget": eng.adaptive.mean_budget(since=chosen) if eng.adaptive is not None else None}


if __name__ == "__main__":
    main()
