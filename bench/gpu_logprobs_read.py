"""What reading log-probabilities costs a pipelined step, by how the read is made: target-only decoding (bf16) with
every request asking for its top 5 (``SamplingParams.logprobs=5``) against the same engine asking none, in rounds
interleaved in one process, at batch 1 (6 MT-bench first turns) and 16 (32), 128 new tokens each.

    python -P bench/gpu_logprobs_read.py OUT_DIR MODEL PROMPTS

Variants of ``specdec.logprobs``, swapped in between runs of the same engine: ``pinned`` (the code as it is: the one
read into pinned buffers, on a side stream that waits only for the kept logits' copy), ``pageable`` (the read into
pageable memory, ``.cpu()``, as before session 46), ``main_stream`` (the work on the step's own stream, behind the
step queued after the verify) and both changes. Prints, per batch, each variant's median tok/s over the rounds after
the first and its ratio to asking none, then a cProfile of one run of ``pinned`` and ``pageable`` (the host
functions that take the time); writes ``logprobs_read.json`` to OUT_DIR.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import specdec.logprobs as lp_module
from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.loading.registry import load_model

CUDA = torch.cuda.is_available()
PINNED_RANKED, SIDE_STREAM = lp_module._ranked, lp_module._after


@torch.inference_mode()
def pageable_ranked(rows, chosen, ks):
    """``logprobs._ranked`` with its read into pageable memory."""
    read = lp_module._read
    lp_module._read = lambda values: values.cpu().numpy()
    try:
        return PINNED_RANKED(rows, chosen, ks)
    finally:
        lp_module._read = read


@contextlib.contextmanager
def main_stream(ready):
    """``logprobs._after`` that leaves the work on the current stream."""
    yield


VARIANTS = {"none": (PINNED_RANKED, SIDE_STREAM), "pinned": (PINNED_RANKED, SIDE_STREAM),
            "pageable": (pageable_ranked, SIDE_STREAM), "main_stream": (PINNED_RANKED, main_stream),
            "pageable_main_stream": (pageable_ranked, main_stream)}


def run(engine, prompts, variant: str, new_tokens: int) -> float:
    lp_module._ranked, lp_module._after = VARIANTS[variant]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=None if variant == "none" else 5)
    if CUDA:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if CUDA:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if variant != "none":  # (every token has its entry)
        assert all(len(o.outputs[0].logprobs) == len(o.token_ids) for o in outs)
    return sum(len(o.token_ids) for o in outs) / dt


def main() -> None:
    out, model_path, prompt_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    sets = json.loads(Path(prompt_file).read_text())
    dev, dtype = ("cuda", "bfloat16") if CUDA else ("cpu", "float32")
    target = load_model(model_path, dtype=getattr(torch, dtype), device=dev)
    names, result = list(VARIANTS), {}
    new_tokens, rounds = (128, 4) if CUDA else (8, 2)
    for batch in (1, 16):
        engine = SpecEngine(None, target, SpecConfig(device=dev, dtype=dtype, max_batch_size=batch, prefix_cache=False,
                                                     kv_memory_bytes=3 << 30))
        prompts = sets["mtbench"][:(6 if batch == 1 else 32) if CUDA else 2]
        rates = {v: [] for v in names}
        for r in range(rounds):  # (rotating order; the first round is each variant's cold one)
            for v in names[r % len(names):] + names[:r % len(names)]:
                rates[v].append(run(engine, prompts, v, new_tokens))
        medians = {v: statistics.median(x[1:]) for v, x in rates.items()}
        profiles = {}
        for v in ("pinned", "pageable"):
            prof = cProfile.Profile()
            prof.enable()
            run(engine, prompts, v, new_tokens // 2)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            profiles[v] = text.getvalue()
        lp_module._ranked, lp_module._after = PINNED_RANKED, SIDE_STREAM
        result[batch] = {"rates": rates, "median_later": medians, "cprofile": profiles}
        print(f"logprobs_read b{batch}: " + ", ".join(
            f"{v} {m:.0f} tok/s ({m / medians['none']:.3f}x)" for v, m in medians.items()), flush=True)
        for v, text in profiles.items():
            print(f"logprobs_read b{batch} cprofile {v}:\n" + "\n".join(text.splitlines()[4:22]), flush=True)
        (out / "logprobs_read.json").write_text(json.dumps(result, indent=1))
        del engine


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
