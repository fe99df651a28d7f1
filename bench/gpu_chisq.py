"""Sampling is lossless through the engine's defaults: a chi-square test of the first two sampled tokens.

For the first MT-bench prompt, SAMPLES seeded requests of two new tokens run through ``SpecEngine.generate``
with the shipped draft and the device's defaults (CUDA: graphs, pipelined steps, the epoch budgets, the sampled
rule on the device); the joint counts of (first token, second token) are tested against the exact target
distribution: p(t1) from a dense float32 forward over the prompt, p(t2 | t1) from one over the prompt and t1
for every first token of expected count >= 5 (every other first token is one cell), each shaped by the request's
temperature and top-p (``acceptance.shape_probs``). Cells of expected count below 5 are pooled. float32 throughout,
so the engine's verify logits and the reference differ only by rounding. The negative control runs the same test on
an engine whose sampled rule takes every token with the noise of position 0 (each token's marginal is right, a
request's two tokens are correlated) and must fail it.

    python -P bench/gpu_chisq.py OUT_DIR MODEL PROMPTS [--samples N] [--draft DRAFT] [--batch B] [--device D]

PROMPTS: the prompt file of ``bench/gpu_interleaved.py --prompts`` (its "mtbench" list). Writes OUT_DIR/chisq.json
and prints one line per setting; exits 1 unless every setting passes (p > 1e-3) and the control fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.acceptance import shape_probs
from specdec.loading.registry import load_model

SETTINGS = [(0.7, 0.9), (1.0, 0.9), (1.0, 1.0)]  # (temperature, top_p)
P_MIN = 1e-3
SEED0 = 1_000_003


def chisquare(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of ``counts`` against ``probs`` (same shape; probs sum to 1);
    cells of expected count < 5 pooled into one. A count in a cell of probability 0 fails by itself (p = 0)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return float("inf"), 0.0, 0
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64))) if dof > 0 else 0.0
    return stat, p, dof


def next_logits(model, rows: list[list[int]], device, chunk: int = 64) -> torch.Tensor:
    """(R, V) float64 logits after each of ``rows`` (token id lists of one length): dense causal forwards."""
    from specdec.models.llama import ForwardContext
    from specdec.training.dense_attention import DenseBatch, DenseCausalBackend

    out = []
    for i in range(0, len(rows), chunk):
        ids = torch.tensor(rows[i:i + chunk], device=device)  # (B, S)
        b, s = ids.shape
        ctx = ForwardContext(DenseCausalBackend(), DenseBatch(b, s), [(None, None)] * model.config.num_layers)
        with torch.inference_mode():
            hidden = model(ids.reshape(-1), torch.arange(s, device=device).repeat(b), ctx).view(b, s, -1)
            out.append(model.compute_logits(hidden[:, -1]).double())
    return torch.cat(out)


def joint_test(model, prompt: list[int], pairs: torch.Tensor, temperature: float, top_p: float, device,
               max_firsts: int = 4096) -> dict:
    """The chi-square tests of the first tokens and of the (first, second) pairs ``pairs`` (n, 2) against the
    target's exact distributions after ``prompt``.

    The joint test's cells are fixed before looking at the sample: (t1, t2) for every first token t1 whose
    expected count is at least 5 (at most ``max_firsts`` of them, the most probable), and one cell for "the first
    token is any other". Choosing the first tokens from those drawn instead would leave the undrawn ones' mass in
    a cell observed empty by construction, which fails a long-tailed distribution (T=1.0 without top-p) for no
    fault of the sampler."""
    n = len(pairs)
    p1 = shape_probs(next_logits(model, [prompt], device)[0], temperature, 0, top_p).double().cpu()  # (V,)
    v = p1.numel()
    order = torch.argsort(p1, descending=True, stable=True)
    firsts = order[:max_firsts][p1[order[:max_firsts]] * n >= 5]  # the first tokens with their own rows of cells
    if len(firsts) == 0:
        firsts = order[:1]
    p2 = shape_probs(next_logits(model, [prompt + [int(t)] for t in firsts], device), temperature, 0,
                     top_p).double().cpu()  # (F, V): p(t2 | t1)
    index = torch.full((v,), -1, dtype=torch.int64)
    index[firsts] = torch.arange(len(firsts))
    row = index[pairs[:, 0]]  # (n,) the pair's first-token row, -1: any other first token
    cells = torch.where(row >= 0, row * v + pairs[:, 1], len(firsts) * v)  # the last cell: any other first token
    counts = torch.zeros(len(firsts) * v + 1, dtype=torch.float64)
    counts.index_add_(0, cells, torch.ones(n, dtype=torch.float64))
    probs = torch.cat([(p1[firsts, None] * p2).flatten(), (1 - p1[firsts].sum()).clamp(min=0).view(1)])
    s1, q1, d1 = chisquare(torch.bincount(pairs[:, 0], minlength=v), p1)
    s2, q2, d2 = chisquare(counts, probs)
    return {"chi2_first": s1, "dof_first": d1, "p_first": q1, "chi2_joint": s2, "dof_joint": d2, "p_joint": q2,
            "distinct_first": int(torch.unique(pairs[:, 0]).numel()), "first_rows": len(firsts),
            "distinct_pairs": int((counts[:-1] > 0).sum())}


@contextlib.contextmanager
def one_noise_everywhere():
    """The negative control, while active: the sampled rule takes every token with the noise of position 0, on
    each of its paths (the device rule's unfiltered and Triton filtered choices, the host rule's)."""
    import specdec.sampled_rule
    import specdec.verifier

    patched = [(mod, name, getattr(mod, name)) for mod, name in (
        (specdec.sampled_rule, "choose_tokens"), (specdec.sampled_rule, "choose_filtered_triton"),
        (specdec.verifier, "choose_tokens"))]

    def at_position_0(choose):
        def wrong(x, temperature, key0, key1, position, *args, **kw):
            return choose(x, temperature, key0, key1, torch.zeros_like(position), *args, **kw)
        return wrong

    try:
        for mod, name, choose in patched:
            setattr(mod, name, at_position_0(choose))
        yield
    finally:
        for mod, name, choose in patched:
            setattr(mod, name, choose)


def engine(target, draft, batch: int, device) -> SpecEngine:
    """A new engine of the device's defaults in float32 (its graphs captured and warmed up at construction)."""
    t0 = time.perf_counter()
    eng = SpecEngine(draft, target, SpecConfig(device=device, dtype="float32", max_batch_size=batch))
    print(f"chisq engine built in {time.perf_counter() - t0:.0f} s", flush=True)
    return eng


def run(eng: SpecEngine, target, prompt: list[int], temperature: float, top_p: float, samples: int, device) -> dict:
    """Draw ``samples`` seeded requests of two tokens through ``eng``; test them."""
    eng.stats = type(eng.stats)()  # (this setting's acceptance alone)
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=SEED0 + s, max_new_tokens=2, ignore_eos=True)
              for s in range(samples)]
    t0 = time.perf_counter()
    outs = eng.generate([prompt] * samples, params)
    bad = [o.error for o in outs if o.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]!r}")
    pairs = torch.tensor([o.token_ids[:2] for o in outs])  # (n, 2)
    generated = time.perf_counter() - t0
    result = joint_test(target.model, prompt, pairs, temperature, top_p, device)
    return {"temperature": temperature, "top_p": top_p, "samples": samples, "seconds": time.perf_counter() - t0,
            "generate_seconds": generated,
            "mean_accepted_length": eng.stats.mean_accepted_length, "accepted": eng.stats.accepted,
            "plan": eng.plan.as_dict(), **result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("model")
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--draft", default="smollm2-135m-draft", help="a draft name or folder, ngram, or none")
    # 64 rows: a pipelined engine's warm-up runs every row count up to max_batch_size, so 256 took minutes
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--control-only", action="store_true",
                    help="only the negative control (after a run whose settings passed but whose control was wrong)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    prompt = json.loads(args.prompts.read_text())["mtbench"][0]
    target = load_model(args.model, dtype=torch.float32, device=args.device)
    if args.draft in ("ngram", "none"):
        draft = None if args.draft == "none" else "ngram"
    else:
        draft = load_model(args.draft, dtype=torch.float32, device=args.device, target=target)
    results = []
    eng = None if args.control_only else engine(target, draft, args.batch, args.device)  # one for every setting
    settings = [] if args.control_only else [(f"T={t} top-p {p}", (t, p)) for t, p in SETTINGS]
    for label, (temperature, top_p) in settings + [("negative control", SETTINGS[0])]:
        with one_noise_everywhere() if label == "negative control" else contextlib.nullcontext():
            if label == "negative control":  # a new engine, whose graphs capture the wrong noise
                del eng
                eng = engine(target, draft, args.batch, args.device)
            r = run(eng, target, prompt, temperature, top_p, args.samples, args.device)
        r = {"label": label, **r}
        r["passes"] = r["p_first"] > P_MIN and r["p_joint"] > P_MIN
        results.append(r)
        (args.out / "chisq.json").write_text(json.dumps(results, indent=1))
        print(f"chisq {label}: {r['samples']} samples, p(first) {r['p_first']:.3g} (dof {r['dof_first']}), "
              f"p(first two) {r['p_joint']:.3g} (dof {r['dof_joint']}), MAL {r['mean_accepted_length']:.2f}, "
              f"{r['seconds']:.0f} s", flush=True)
    ok = all(r["passes"] for r in results[:-1]) and results[-1]["p_joint"] < P_MIN  # (control only: it fails)
    print(f"chisq: {'PASS' if ok else 'FAIL'}: every setting p > {P_MIN:g}, the negative control below it")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
