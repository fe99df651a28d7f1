"""Host cost of whole EAGLE engine steps with the device work taken out: every graphed forward and the draft's
device program return a cached output of their first run, so the step's Python, numpy and small tensor ops
are all that is left. A tiny random Llama target with a random EAGLE draft (acceptance meaningless), static
tree, steady state (every request prefilled, none finishing). The best of several rounds of steps in this
thread's CPU time (the cores are shared). CPU only: on CUDA captured graphs replay without calling the
forwards (use host_profile.py there).

    OMP_NUM_THREADS=1 python bench/eagle_host_step.py [--batches 1 16 64] [--tree topk:2x3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_profile import eagle_draft  # noqa: E402
from specdec.scheduler.cuda_graphs import GraphRunner  # noqa: E402

from specdec import SamplingParams, SpecConfig, SpecEngine  # noqa: E402
from specdec.config import ModelConfig  # noqa: E402
from specdec.drafters.eagle_device import DeviceTreeLoop  # noqa: E402
from specdec.loading.registry import LoadedModel  # noqa: E402
from specdec.models.llama import LlamaForCausalLM  # noqa: E402


def cached(forward):
    """``forward(self, key)`` that returns its first output for each key from then on."""
    outputs = {}

    def run(self, key):
        if (id(self), key) not in outputs:
            outputs[(id(self), key)] = forward(self, key)
        return outputs[(id(self), key)]

    return run


def measure(batch: int, args) -> dict:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=1, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=16384, tie_word_embeddings=True)
    torch.manual_seed(0)
    target = LoadedModel("tiny", LlamaForCausalLM(cfg).eval().requires_grad_(False), None, cfg)
    eng = SpecEngine(eagle_draft(target), target, SpecConfig(tree=args.tree, max_batch_size=64, cuda_graphs=True,
                                                             num_blocks=16384, prefix_cache=False, adaptive=False))
    g = torch.Generator().manual_seed(1)
    steps = args.warmup + args.rounds * args.steps
    for _ in range(batch):
        eng.add_request(torch.randint(5, 2000, (40,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=2 * steps + 16, ignore_eos=True))
    while eng.scheduler.waiting or any(not r.prefill_done for r in eng.scheduler.running):
        eng.step()
    for _ in range(args.warmup):
        eng.step()
    clock = time.thread_time
    best = float("inf")
    for _ in range(args.rounds):
        t0 = clock()
        for _ in range(args.steps):
            eng.step()
        best = min(best, (clock() - t0) / args.steps)
    if len(eng.scheduler.running) != batch:
        raise RuntimeError("a request finished while timing")
    return {"batch": batch, "tree": args.tree, "host_us_per_step": 1e6 * best, "host_us_per_row": 1e6 * best / batch,
            "proposals": dict(getattr(eng.drafter, "paths", {}))}  # (before the counter existed: {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tree", default="topk:2x3")
    ap.add_argument("--steps", type=int, default=100, help="steps per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    GraphRunner._forward = cached(GraphRunner._forward)
    DeviceTreeLoop._program = cached(DeviceTreeLoop._program)
    results = []
    for b in args.batches:
        results.append(measure(b, args))
        r = results[-1]
        print(f"{args.tree} batch {b}: host {r['host_us_per_step']:.0f} us/step, {r['host_us_per_row']:.1f} us/row "
              f"(proposals {r['proposals']})", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
