"""Where a verify step's extra GPU time goes (issue 9: a batch-16 chain:8 verify costs ~16% more than a
decode step): the target's graphed forward per (batch, query) bucket, timed and broken into kernels.

    python -P bench/gpu_verify_kernels.py OUT_DIR

A random SmolLM2-shaped target (no model file), bf16, graphs captured up to 64 rows x 16 queries over
200-token contexts. Per bucket: the captured graph's replay time (CUDA events, median of 5 x 200
replays), then one eager run of the same forward under torch.profiler: kernels by name (count, summed
GPU us). The last table is the per-kernel growth from Q = 1 to each larger Q at batch 16. Also times the
verify head alone: the float32 logits + argmax + isfinite of the torch path against the LM head in bf16 +
the backend's fused ``greedy_head``. Writes OUT_DIR/verify_kernels.json.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import CUDA, DEV, cuda_ms, fill_synthetic, graph_replay_ms, random_model  # noqa: E402
from gpu_program_kernels import kernels  # noqa: E402

from specdec import SpecConfig, SpecEngine  # noqa: E402

KEYS = [(0, 1, 1), (0, 1, 16), (0, 16, 1), (0, 16, 4), (0, 16, 8), (0, 16, 16), (0, 64, 1), (0, 64, 16)]


def head_ms(model, backend, tokens: int, fused: bool) -> float:
    """Median ms of one verify head over ``tokens`` hidden rows (CUDA events)."""
    hidden = torch.randn(tokens, model.config.hidden_size, device=DEV, dtype=next(model.parameters()).dtype)

    def old():
        logits = model.compute_logits(hidden)
        return logits.argmax(-1), torch.isfinite(logits).all(-1)

    def new():
        return backend.greedy_head(model.compute_logits(hidden, dtype=None))

    return cuda_ms(new if fused else old, warm=5)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    target = random_model(torch.bfloat16 if CUDA else torch.float32)
    eng = SpecEngine("ngram", target, SpecConfig(device=DEV, dtype="bfloat16" if CUDA else "float32",
                                                 max_batch_size=64, prefix_cache=False, tree="chain:15",
                                                 adaptive=False, cuda_graphs=True))
    graphs = eng.runner.graphs
    res: dict = {"capture": str(eng.graph_report), "buckets": {}}
    for key in KEYS if CUDA else [(0, 1, 1), (0, 2, 4)]:
        fill_synthetic(eng, key)
        r = {"replay_ms": graph_replay_ms(graphs.graphs[key][0]) if key in graphs.graphs else None}
        r.update(kernels(functools.partial(graphs._forward, key)))
        res["buckets"][f"{key[1]}x{key[2]}"] = r
        print(f"B={key[1]} Q={key[2]}: replay {r['replay_ms']} ms, {r['kernels']} kernels, "
              f"{r['total_us']:.0f} us of kernel time", flush=True)
        for name, c, t in r["top"][:12]:
            print(f"  {c:4d} {t:9.1f}  {name}", flush=True)
    base = {n: t for n, _, t in res["buckets"].get("16x1", {"top": []})["top"]}
    for q in (4, 8, 16):
        top = res["buckets"].get(f"16x{q}")
        if top is None:
            continue
        grow = sorted(((t - base.get(n, 0.0), n) for n, _, t in top["top"]), reverse=True)[:10]
        res[f"growth_16x1_to_16x{q}"] = [(n, round(d, 1)) for d, n in grow]
        print(f"growth B=16 Q=1 -> Q={q} (us of kernel time, top 10):", flush=True)
        for d, n in grow:
            print(f"  {d:8.1f}  {n}", flush=True)
    if CUDA:
        model, backend = target.model, eng.runner.backend
        for t in (16, 144, 960):
            res[f"head_ms_{t}"] = {"torch_float32": head_ms(model, backend, t, False),
                                   "fused": head_ms(model, backend, t, True)}
            print(f"verify head, {t} tokens: {res[f'head_ms_{t}']}", flush=True)
    (out / "verify_kernels.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
