"""Losslessness of sampling with the shipped EAGLE draft on the real target, by a chi-square test.

For the first MT-bench prompt (a wide next-token distribution), N seeded requests of that prompt each
sample their first token through speculative decoding (the draft's tree verified by the lossless rule:
accepted draft token or residual bonus); the counts are tested against the exact target distribution of
that position (a float32 target forward over the prompt, shaped by ``shape_probs``). Cells whose expected
count is below 5 are pooled. float32 throughout: the verify logits and the reference differ by rounding.

    python -P bench/chisq_real_draft.py OUT_DIR MODEL PROMPTS [SAMPLES] [TREE ...]

PROMPTS: the pre-tokenised MT-bench file of bench/gpu_fastpath.py. Writes OUT_DIR/chisq.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.acceptance import shape_probs
from specdec.loading.registry import load_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BATCH = int(os.environ.get("CHISQ_BATCH", "64"))  # rows per step (CPU runs are faster with more)
SETTINGS = [(0.7, 0, 1.0), (0.7, 0, 0.9)]  # (temperature, top_k, top_p)


def chisquare(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of ``counts`` against ``probs``; cells of expected count
    < 5 pooled into one. A sampled token of target probability 0 is a failure by itself (p = 0)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 0.0, 0
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p, dof


def main() -> None:
    out, model_path, prompt_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    samples = int(sys.argv[4]) if len(sys.argv) > 4 else 20000
    trees = sys.argv[5:] or ["dynamic:15"]
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompt_file).read_text())["mtbench"][:1]
    target = load_model(model_path, dtype=torch.float32, device=DEV)
    draft = load_model("smollm2-135m-draft", dtype=torch.float32, device=DEV, target=target)
    results = []
    for pi, prompt in enumerate(prompts):
        ref_logits = _last_logits(target.model, prompt)  # (V,)
        for tree in trees:
            eng = SpecEngine(draft, target, SpecConfig(device=DEV, dtype="float32", tree=tree, max_batch_size=BATCH))
            for t, k, top_p in SETTINGS:
                t0 = time.perf_counter()
                params = [SamplingParams(temperature=t, top_k=k, top_p=top_p, seed=1_000_003 * pi + s,
                                         max_new_tokens=1, ignore_eos=True) for s in range(samples)]
                eng.stats = type(eng.stats)()
                outs = eng.generate([prompt] * samples, params)
                first = torch.tensor([o.token_ids[0] for o in outs])
                counts = torch.bincount(first, minlength=ref_logits.numel())
                probs = shape_probs(ref_logits, t, k, top_p).cpu()
                stat, p, dof = chisquare(counts, probs)
                r = {"prompt": pi, "tree": tree, "temperature": t, "top_k": k, "top_p": top_p, "samples": samples,
                     "chi2": stat, "dof": dof, "p_value": p, "passes_at_1e-3": dof >= 1 and p > 1e-3,
                     # forwards whose first token was an accepted draft token (not the bonus)
                     "first_token_from_draft": eng.stats.depth_accepted[0] if eng.stats.depth_accepted else 0,
                     "target_forwards": eng.stats.target_forwards,
                     "seconds": time.perf_counter() - t0, "distinct_tokens": int((counts > 0).sum())}
                results.append(r)
                print(json.dumps(r), flush=True)
                (out / "chisq.json").write_text(json.dumps(results, indent=1))
    ok = all(r["passes_at_1e-3"] for r in results)
    print(f"chi-square with the real draft: {sum(r['passes_at_1e-3'] for r in results)}/{len(results)} pass "
          f"(p > 1e-3) at {samples} samples each")
    sys.exit(0 if ok else 1)


def _last_logits(model, prompt: list[int]) -> torch.Tensor:
    """float64 copy of the target's float32 logits after ``prompt`` (one dense causal forward)."""
    from specdec.models.llama import ForwardContext
    from specdec.training.dense_attention import DenseBatch, DenseCausalBackend

    n = len(prompt)
    ctx = ForwardContext(DenseCausalBackend(), DenseBatch(1, n), [(None, None)] * model.config.num_layers)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt, device=DEV), torch.arange(n, device=DEV), ctx)
        return model.compute_logits(hidden[-1:])[0].double()


if __name__ == "__main__":
    main()
