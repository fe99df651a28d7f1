"""Draft-tree level expansion alone (no model): time per level and synchronizing calls per level.

Random SmolLM2-sized draft logits (bf16, V = 49152) stand in for the draft model; rows alternate
greedy and sampled requests. For each tree and batch size the script grows full trees with
``ModelDrafter._expand_level`` and reports the median time of a level and the synchronizing CUDA
calls per level counted by ``torch.cuda.set_sync_debug_mode("warn")`` (expected: 1, the read).

    python -P bench/gpu_tree_levels.py OUT_DIR     # writes OUT_DIR/tree_levels.json, prints a table

On a CPU it runs too (no sync counts; the figures only show that the script works).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec.drafters.model_drafter import ModelDrafter, _Growth
from specdec.sampling_params import SamplingParams
from specdec.tree import template_from_spec

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
VOCAB = 49152 if CUDA else 4096
SHAPES = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95)]


def grow(tree: str, rows: int, seed: int) -> tuple[list[float], list[int]]:
    """Level times (s) and synchronizing calls per level while growing ``rows`` full trees."""
    drafter = ModelDrafter(None, SimpleNamespace(device=DEV), template_from_spec(tree))
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = lambda n: torch.randn(n, VOCAB, generator=gen, device=DEV, dtype=torch.bfloat16) * 3  # noqa: E731
    grows = [_Growth(SimpleNamespace(params=SHAPES[r % 2], generator=torch.Generator(device=DEV).manual_seed(r)),
                     L=100) for r in range(rows)]
    for g, lg in zip(grows, logits(rows)):
        g.frontier = [(-1, lg)]
    times, syncs = [], []
    for _ in range(drafter._max_depth):
        if CUDA:
            torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if CUDA:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            new = drafter._expand_level(grows)
            times.append(time.perf_counter() - t0)
            if CUDA:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in seen))
        if not any(new):
            break
        for g, nodes in zip(grows, new):
            if nodes:
                g.frontier = list(zip(nodes, logits(len(nodes))))
    return times, syncs


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for tree in ("dynamic:63", "dynamic:16", "topk:2x3", "chain:4"):
        for rows in (1, 8, 32, 64):
            grow(tree, rows, seed=0)  # warm-up
            times, syncs = grow(tree, rows, seed=1)
            results.append(dict(tree=tree, rows=rows, levels=len(times), level_ms=1e3 * statistics.median(times),
                                syncs_per_level=syncs))
            r = results[-1]
            print(f"{tree:>10} rows {rows:>3}: {r['levels']} levels, median {r['level_ms']:.3f} ms/level, "
                  f"syncs per level {syncs}", flush=True)
    (out / "tree_levels.json").write_text(json.dumps(dict(device=str(DEV), vocab=VOCAB, results=results), indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
