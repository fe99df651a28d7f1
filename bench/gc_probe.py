"""Garbage-collector cost of the n-gram drafter's indexes next to an engine's heap (CPU).

    python bench/gc_probe.py [--shared] [--runs 4]

Builds an engine (the embedded SmolLM2 target, so the heap holds what a real engine holds), then per run
indexes 80 requests of 100 prompt + 128 generated random tokens the way ``NgramDrafter`` does (one lookup per
token) and reports the collections of each generation and their time. Full (generation 2) collections scan
the whole heap; something that adds tracked objects that outlive the young generations sets them off.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import torch

from specdec import SpecConfig, SpecEngine
from specdec.drafters.ngram import NgramIndex, SharedNgrams
from specdec.loading.registry import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", action="store_true", help="index into one SharedNgrams table")
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    target = load_model("smollm2-135m", dtype=torch.float32)
    engine = SpecEngine("ngram", target, SpecConfig(tree="chain:8", max_batch_size=16, cuda_graphs=True))
    print(f"tracked objects with an engine: {len(gc.get_objects())}")
    counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def timer(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(timer)
    rng = random.Random(0)
    table = SharedNgrams() if args.shared else None
    for run in range(args.runs):
        counts[:], seconds[:] = [0, 0, 0], [0.0, 0.0, 0.0]
        t0 = time.perf_counter()
        for _ in range(80):
            tokens = [rng.randrange(49152) for _ in range(100)]
            index = NgramIndex(4, 1, table)
            for _ in range(128):
                tokens.append(rng.randrange(49152))
                index.lookup(tokens, 8)
        print(f"run {run}: {time.perf_counter() - t0:.3f} s; collections per generation {counts}, "
              f"ms {[round(s * 1e3, 1) for s in seconds]}")
    del engine


if __name__ == "__main__":
    main()
