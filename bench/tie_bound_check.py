"""Check the numerical-tie bound against measured rounding: bf16 logits against float32 logits.

Usage: python bench/tie_bound_check.py [--device cuda] [--dataset mtbench] [--num-prompts 8] [--out OUT.json]

For every position of each prompt (chat-templated, full forward), it compares the bf16 logits of the
target with float32 logits of the same weights (the bf16 weights upcast) for the two best float32
tokens, and divides that error by the per-forward error allowance ``E = bound / 2`` of
``specdec.benchmark.divergence.tie_bound`` at that position.  A ratio under 1 everywhere means the bound covers
what one bf16 forward really does; docs/divergence.md quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from specdec.benchmark.data import load_dataset
from specdec.benchmark.divergence import tie_bound
from specdec.benchmark.hf import to_hf_model
from specdec.loading.registry import load_model
from specdec.prompts import to_prompt_ids


@torch.inference_mode()
def ratios(target, ids: list[int]) -> list[tuple[float, float]]:
    """(error / allowance, tie bound) for the two best float32 tokens at every position of ``ids``."""
    bf16 = to_hf_model(target).requires_grad_(False)
    fp32 = to_hf_model(target).float().requires_grad_(False)
    x = torch.tensor([ids], device=target.device)  # (1, T)
    h = fp32.model(input_ids=x).last_hidden_state[0].float()  # (T, d)
    w = fp32.lm_head.weight.float()  # (V, d)
    z32 = h @ w.T  # (T, V)
    z16 = bf16(input_ids=x).logits[0].float()  # (T, V)
    top2 = z32.topk(2, dim=-1).indices  # (T, 2)
    out = []
    for t in range(len(ids)):
        pair = top2[t]
        scale = float(z32[t, pair].abs().max())
        allowance = tie_bound(scale, float(h[t].norm()), float(w[pair].norm(dim=1).max()), h.shape[1],
                              target.config.num_layers, "bfloat16") / 2
        err = float((z16[t, pair] - z32[t, pair]).abs().max())
        out.append((err / allowance, 2 * allowance))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dataset", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    target = load_model(args.target, dtype="bfloat16", device=args.device)
    pairs: list[tuple[float, float]] = []
    for p in load_dataset(args.dataset, args.num_prompts):
        pairs += ratios(target, to_prompt_ids(p.messages if p.messages is not None else p.prompt, target.tokenizer))
    all_r, bounds = sorted(r for r, _ in pairs), sorted(b for _, b in pairs)
    q = lambda xs, f: xs[min(len(xs) - 1, math.floor(f * len(xs)))]
    summary = {"device": args.device, "positions": len(all_r), "ratio_median": q(all_r, 0.5),
               "ratio_p99": q(all_r, 0.99), "ratio_max": all_r[-1], "over_1": sum(r > 1 for r in all_r),
               "bound_min": bounds[0], "bound_median": q(bounds, 0.5), "bound_max": bounds[-1]}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fp:
            json.dump(summary, fp, indent=2)


if __name__ == "__main__":
    main()
