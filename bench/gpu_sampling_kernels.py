"""Launch settings of the sampled rule's row kernels: the sort-free top-k/top-p filter (``kernels/nucleus.py``), the
Gumbel-max token choice over a kept set (``kernels/gumbel_choice.py``), each one program per row walking the
vocabulary, and the choice the rule runs (``choose_filtered_triton``: the unfiltered choice split over programs, then
one program per row checking it against the row's nucleus); and of the EAGLE draft's children top-k
(``kernels/topk.py``, blocks of columns per program, then a merge).

    python -P bench/gpu_sampling_kernels.py OUT_DIR [--vocab V] [--rows 16,64,256] [--topk-rows 10x10,...]

For R rows of float32 logits (two shapes of distribution: peaked, where the nucleus holds a few tokens, and flat,
where it holds thousands), T = 0.7 and top-p 0.9, every (block, warps) pair of each kernel is timed (CUDA events,
median of 30 launches after 5 untimed) and checked against the current default's output (the same kept set and
the same tokens). The top-k: bf16 logits over the draft vocabulary (24,576), R nodes x k children (the device
program's levels: 10 nodes of 10 children at batch 1, 160 and 640 at batch 16 and 64, and the narrow cuts' 3 x 3
and 7 x 7 per row at batch 64), each way of taking a block's best k (``METHODS``) at every (block, warps), checked
against the default's columns. Writes
OUT_DIR/sampling_kernels.json and prints one line per (kernel, distribution, rows) with the default's time and the
fastest setting's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from specdec.kernels.gumbel_choice import DEFAULT_BLOCK as CHOOSE_BLOCK
from specdec.kernels.gumbel_choice import choose_filtered_triton, choose_tokens_triton
from specdec.kernels.nucleus import DEFAULT_BLOCK as NUCLEUS_BLOCK
from specdec.kernels.nucleus import nucleus_probs
from specdec.kernels.topk import DEFAULT_BLOCK as TOPK_BLOCK
from specdec.kernels.topk import METHODS, topk_logprobs_small

from specdec.row_sampling import RowSampling

NUCLEUS = [(b, w) for b in (1024, 2048, 4096, 8192) for w in (4, 8, 16)]
CHOOSE = [(b, w) for b in (512, 1024, 2048, 4096) for w in (4, 8, 16)]
TOPK = [(b, w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8)]


def timed(fn, reps: int = 30) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` launches after 5 untimed ones (CUDA events; on the CPU,
    where the script only checks itself, the wall clock)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sweep(grid, launch, same, default: tuple[int, int], reps: int) -> tuple[list[dict], dict | None, dict]:
    """Every (block, warps) of ``grid``: ``launch(block=, num_warps=)`` checked by ``same(output)`` and timed.
    Returns the rows, the default's row (None when it failed or differed) and the fastest row that agreed."""
    rows = []
    for block, warps in grid:
        fn = functools.partial(launch, block=block, num_warps=warps)
        try:
            agrees = same(fn())
            ms = timed(fn, reps)
        except Exception as e:  # (a setting that does not compile or fit: recorded, skipped)
            rows.append({"block": block, "warps": warps, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append({"block": block, "warps": warps, "ms": ms, "same": agrees})
    ok = [e for e in rows if "ms" in e and e["same"]]
    return rows, next((e for e in ok if (e["block"], e["warps"]) == default), None), min(ok, key=lambda e: e["ms"])


def report(what: str, rows: list[dict], base: dict | None, best: dict) -> None:
    """One line: the default's time and the fastest setting's."""
    print(f"kernels {what}: default {base['ms'] * 1e3 if base else float('nan'):.1f} us, best {best['ms'] * 1e3:.1f} "
          f"us at block {best['block']} warps {best['warps']}; "
          f"{sum(1 for e in rows if 'ms' in e and not e['same'])} settings differ", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--topk-rows", default="10x10,160x10,640x10,192x3,448x7", help="nodes x children")
    ap.add_argument("--draft-vocab", type=int, default=24576)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    res = []
    for dist, scale in (("peaked", 4.0), ("flat", 1.0)):
        for r in (int(x) for x in args.rows.split(",")):
            x = torch.randn(r, args.vocab, device=dev, generator=gen) * scale
            t = torch.full((r,), 0.7, device=dev, dtype=torch.float64)
            sampling = RowSampling(t, torch.zeros(r, dtype=torch.int64, device=dev),
                                   torch.full((r,), 0.9, device=dev, dtype=torch.float64), True, False,
                                   torch.zeros(r, device=dev, dtype=torch.float64))
            tv = t.float().view(r, 1)
            probs = torch.softmax(x / tv, -1)
            keys = torch.randint(0, 2**32, (3, r), device=dev, generator=gen)
            pos = torch.arange(r, device=dev) + 100
            ref = nucleus_probs(x, tv, probs, sampling)
            kept = ref > 0
            want = choose_tokens_triton(x, t, keys[0], keys[1], pos, kept)
            size = kept.sum(1).float().median().item()
            kernels = (("nucleus", NUCLEUS, (NUCLEUS_BLOCK, 8),
                        functools.partial(nucleus_probs, x, tv, probs, sampling)),
                       ("choose", CHOOSE, (CHOOSE_BLOCK, 16),
                        functools.partial(choose_tokens_triton, x, t, keys[0], keys[1], pos, kept)),
                       ("filtered", CHOOSE, (CHOOSE_BLOCK, 16),  # (what the sampled rule runs; its checks' launch)
                        functools.partial(choose_filtered_triton, x, t, keys[0], keys[1], pos, sampling, t.float())))
            for name, grid, default, launch in kernels:
                same = (lambda got, kept=kept: bool(((got > 0) == kept).all())) if name == "nucleus" else \
                    (lambda got, want=want: bool((got == want).all()))
                rows, base, best = sweep(grid, launch, same, default, args.reps)
                res.append({"kernel": name, "dist": dist, "rows": r, "kept_median": size, "default": base,
                            "best": best, "all": rows})
                report(f"{name} {dist} rows {r} (nucleus median {size:.0f} tokens)", rows, base, best)
                (out / "sampling_kernels.json").write_text(json.dumps(res, indent=1))
    for shape in args.topk_rows.split(","):
        r, k = (int(v) for v in shape.split("x"))
        x = (torch.randn(r, args.draft_vocab, device=dev, generator=gen) * 3).to(torch.bfloat16)
        want = topk_logprobs_small(x, k).indices
        for method in METHODS:  # k rounds of a block-wide max, or one bitonic top-k per block
            rows, base, best = sweep(TOPK, functools.partial(topk_logprobs_small, x, k, method=method),
                                     lambda got, want=want: bool(torch.equal(got.indices, want)),
                                     (TOPK_BLOCK, 8 if TOPK_BLOCK >= 4096 else 4), args.reps)
            res.append({"kernel": "topk", "method": method, "rows": r, "k": k, "default": base, "best": best,
                        "all": rows})
            report(f"topk {method} {r} nodes x {k}", rows, base, best)
            (out / "sampling_kernels.json").write_text(json.dumps(res, indent=1))

if __name__ == "__main__":
    main()
