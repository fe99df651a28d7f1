"""generate() (final outputs only) against draining stream() (every step's outputs built), same engine,
alternating runs; SmolLM2 cut to 1 layer on the CPU so host work shows.

    OMP_NUM_THREADS=1 python bench/generate_finals.py
"""
import json
import statistics
import time

import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.loading.registry import load_model, truncate_layers

prompts = json.load(open('.gpu/mtbench_ids.json'))['mtbench']
target = truncate_layers(load_model("smollm2-135m", dtype=torch.float32), 1)
p = SamplingParams(max_new_tokens=64, ignore_eos=True)
for draft in (None, "ngram"):
    eng = SpecEngine(draft, target, SpecConfig(tree="chain:8", max_batch_size=16, prefix_cache=False, cuda_graphs=True))
    eng.generate(prompts[:16], SamplingParams(max_new_tokens=4, ignore_eos=True))
    res = {"every": [], "finals": []}
    for _r in range(3):
        for mode in ("every", "finals"):
            eng.forget_drafts()
            t = time.perf_counter()
            for i in range(0, 80, 16):
                if mode == "finals":
                    eng.generate(prompts[i:i+16], p)
                else:
                    [o for o in eng.stream(prompts[i:i+16], p) if o.finished]
            res[mode].append(time.perf_counter() - t)
    print(draft, {k: round(statistics.median(v), 3) for k, v in res.items()}, "steps", eng.stats.target_forwards)
