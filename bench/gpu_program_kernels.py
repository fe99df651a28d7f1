"""Kernels of the EAGLE device draft program (issue 10: the draft's per-level cost at batch 1).

    python -P bench/gpu_program_kernels.py OUT_DIR [TREE ...]     # default: topk:2x3 dynamic:31, batch 1

A random SmolLM2-shaped target and an untrained EAGLE draft of the shipped draft's shape (no model file).
Per tree: the program's captured-graph replay time (CUDA events, median of 5 x 100 replays after 10 warm
ones), then one eager run of the same program under torch.profiler: kernels launched, their summed GPU
time, and the kernels by name (count, total us). Writes OUT_DIR/program_kernels.json.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import CUDA, DEV, graph_replay_ms, random_model, random_prompts  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import LoadedModel  # noqa: E402
from specdec.training.eagle import EagleShape, default_aux_layers, eagle_from_target  # noqa: E402


def kernels(fn) -> dict:
    """Device kernels of one call of ``fn`` (CPU: the aten ops instead)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if CUDA else [ProfilerActivity.CPU]
    fn()  # warm (compiles)
    with profile(activities=acts) as prof:
        fn()
        if CUDA:
            torch.cuda.synchronize()
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if CUDA and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not CUDA and not ev.name.startswith("aten::"):
            continue
        by_name[ev.name][0] += 1
        by_name[ev.name][1] += ev.device_time if CUDA else ev.cpu_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels": sum(c for c, _ in by_name.values()), "total_us": sum(t for _, t in by_name.values()),
            "top": [(name[:90], c, round(t, 1)) for name, (c, t) in top[:30]]}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    trees = sys.argv[2:] or ["topk:2x3", "dynamic:31"]
    dt = torch.bfloat16 if CUDA else torch.float32
    target = random_model(dt)
    cfg = target.config
    shape = EagleShape(default_aux_layers(cfg.num_layers), min(24576, cfg.vocab_size))
    model = eagle_from_target(target.model, shape, torch.arange(shape.draft_vocab), seed=1)
    draft = LoadedModel("eagle-random", model.eval().requires_grad_(False), None, model.config)
    prompts = random_prompts(1, 100 if CUDA else 10, cfg.vocab_size, seed=1)
    res = {}
    for tree in trees:
        eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype=str(dt).split(".")[1], tree=tree,
                                                   max_batch_size=8, prefix_cache=False, adaptive=False,
                                                   cuda_graphs=True))
        eng.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # fills bucket 1's inputs
        loop = eng.drafter.device_loop
        r = {"program": type(loop).__name__}
        if CUDA and 1 in loop.graphs:
            r["replay_ms"] = graph_replay_ms(loop.graphs[1][0], 100)
        r.update(kernels(functools.partial(loop._program, 1)))
        res[tree] = r
        print(f"{tree}: replay {r.get('replay_ms')} ms, {r['kernels']} kernels, {r['total_us']:.0f} us of kernel time",
              flush=True)
        for name, c, t in r["top"][:15]:
            print(f"  {c:4d} {t:9.1f}  {name}", flush=True)
        del eng
    (out / "program_kernels.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
