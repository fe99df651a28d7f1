"""Divergence analysis of ``specdec bench``: where greedy outputs part, numerical tie or mismatch.

A divergence is forced on the tiny random target: its target-only greedy output is taken as the
reference, and a "speculative" output is made from it by changing one token.  A forced tie copies
the LM-head row of the greedy token at that position onto another token, so the two tokens' float32
logits are exactly equal there; a forced mismatch uses the token the target ranks last.
"""

from __future__ import annotations

import pytest
import torch

from specdec.benchmark.data import BenchPrompt
from specdec.benchmark.divergence import (
    MISMATCH,
    NUMERICAL_TIE,
    Divergence,
    classify_divergences,
    first_divergence,
    float32_reference,
    tie_bound,
)
from specdec.cli.bench import _cached, run_batch_size
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

POS = 3
PROMPTS = [[5, 17, 99, 42, 8], [7, 7, 120, 33, 61, 90, 12]]


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == Divergence(1, 2, 5)
    assert first_divergence([1, 2], [1, 2, 9]) == Divergence(2, None, 9)
    assert first_divergence([], [4]) == Divergence(0, None, 4)


def test_tie_bound_scales_and_rejects_bad_input():
    args = dict(hidden_norm=20.0, weight_norm=1.5, hidden_size=576, num_layers=30)
    assert tie_bound(15.0, **args, dtype="float32") == 0.0
    bf16, fp16 = tie_bound(15.0, **args, dtype="bfloat16"), tie_bound(15.0, **args, dtype="float16")
    assert bf16 == pytest.approx(8 * fp16)  # the unit roundoff is 2**-8 against 2**-11
    assert tie_bound(30.0, **args, dtype="bfloat16") > bf16
    with pytest.raises(ValueError, match="dtype"):
        tie_bound(1.0, **args, dtype="int8")
    with pytest.raises(ValueError, match="num_layers"):
        tie_bound(1.0, 1.0, 1.0, 64, 0, "bfloat16")


@pytest.fixture(scope="module")
def forced(tiny_dirs):
    """(target whose LM head ties the greedy token at POS of prompt 0 with another token, target-only
    outputs, the tied token, the token ranked last there)."""
    target = load_model(tiny_dirs["llama"])  # a private copy: its LM head is edited below
    engine = SpecEngine(None, target, SpecConfig(prefix_cache=False))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True))
    ref_ids = [o.token_ids for o in outs]
    greedy = ref_ids[0][POS]
    tied = (greedy + 1) % target.config.vocab_size
    with torch.no_grad():
        target.model.lm_head.weight[tied] = target.model.lm_head.weight[greedy]
    ref = float32_reference(target)
    with torch.inference_mode():
        logits = ref(torch.tensor([PROMPTS[0] + ref_ids[0][:POS]])).logits[0, -1]  # (V,)
    assert logits[tied] == logits[greedy]
    return target, ref, ref_ids, tied, int(logits.argmin())


def _records(ref_ids, spec0, greedy=True):
    def rec(i, spec):
        return {"id": str(i), "greedy": greedy, "spec": {"token_ids": spec},
                "target_only": {"token_ids": ref_ids[i]}}

    return [rec(0, spec0), rec(1, list(ref_ids[1]))]


@pytest.mark.parametrize("dtype,expected", [("bfloat16", NUMERICAL_TIE), ("float32", MISMATCH)])
def test_exact_tie_is_a_numerical_tie_only_in_bf16(forced, dtype, expected):
    target, ref, ref_ids, tied, _ = forced
    spec = ref_ids[0][:POS] + [tied] + ref_ids[0][POS + 1:]
    recs = classify_divergences(_records(ref_ids, spec), PROMPTS, ref, dtype, target.config.num_layers)
    div = recs[0]["divergence"]
    assert div["class"] == expected
    assert (div["position"], div["spec_token"], div["target_token"]) == (POS, tied, ref_ids[0][POS])
    assert div["logit_gap"] == 0.0 and div["top_gap"] == 0.0
    assert (div["bound"] > 0) == (dtype == "bfloat16")
    assert recs[1]["divergence"] is None  # identical record


def test_last_ranked_token_is_a_mismatch_in_bf16(forced):
    target, ref, ref_ids, _, worst = forced
    spec = ref_ids[0][:POS] + [worst] + ref_ids[0][POS + 1:]
    div = classify_divergences(_records(ref_ids, spec), PROMPTS, ref, "bfloat16",
                               target.config.num_layers)[0]["divergence"]
    assert div["class"] == MISMATCH
    assert div["logit_gap"] > div["bound"] > 0
    assert div["fp32_top_token"] == ref_ids[0][POS]


def test_reference_built_only_when_needed(forced):
    _, _, ref_ids, tied, _ = forced

    def no_reference():
        raise AssertionError("the float32 reference was built although nothing diverged")

    recs = classify_divergences(_records(ref_ids, list(ref_ids[0])), PROMPTS, no_reference, "bfloat16", 3)
    assert [r["divergence"] for r in recs] == [None, None]
    sampled = classify_divergences(_records(ref_ids, [tied] * 10, greedy=False), PROMPTS, no_reference,
                                   "bfloat16", 3)
    assert sampled[0]["divergence"] is None


def test_cached_makes_once():
    made = []
    get = _cached(lambda: made.append(1) or len(made))
    assert get() == get() == 1 and made == [1]


def test_run_batch_size_records_every_prompt(tiny_target, tiny_draft):
    """One batch size of the bench loop on the tiny pair (no transformers baselines)."""
    cfg = SpecConfig(tree="chain:4", prefix_cache=False)
    engines = (SpecEngine(tiny_draft, tiny_target, cfg), SpecEngine(None, tiny_target, cfg))
    prompts = [BenchPrompt(id=str(i), category="c", prompt="x") for i in range(len(PROMPTS))]
    params = SamplingParams(max_new_tokens=8)
    recs = run_batch_size(engines, None, prompts, PROMPTS, params, 2, tiny_target, "float32")
    assert [r["id"] for r in recs] == ["0", "1"]
    for r in recs:
        assert r["spec"]["token_ids"] == r["target_only"]["token_ids"]  # float32 greedy is lossless
        assert r["divergence"] is None and r["hf"] is None and r["hf_static"] is None
        assert r["spec"]["target_forwards"] >= 1 and len(r["spec"]["per_depth_drafted"]) == 4


def test_run_batch_size_continuous_schedule(tiny_target, tiny_draft):
    """``--schedule continuous``: each engine gets every prompt in one generate call and never runs more than
    the batch size at once (6 prompts, batch 2: rows refilled as others finish); greedy float32 outputs equal
    target-only's and the waves schedule's; the engines' own batch limit is restored afterwards."""
    cfg = SpecConfig(tree="chain:4", prefix_cache=False, max_batch_size=8)
    engines = (SpecEngine(tiny_draft, tiny_target, cfg), SpecEngine(None, tiny_target, cfg))
    ids = [p + [i + 3] * (i + 1) for i in range(3) for p in PROMPTS]  # 6 distinct prompts
    prompts = [BenchPrompt(id=str(i), category="c", prompt="x") for i in range(len(ids))]
    params = SamplingParams(max_new_tokens=4 + len(ids), ignore_eos=True)
    seen, calls = [], []
    for eng in engines:
        step, generate = eng.step, eng.generate
        eng.step = lambda s=step, e=eng: seen.append(len(e.scheduler.running)) or s()
        eng.generate = lambda group, p, g=generate: calls.append(len(group)) or g(group, p)
    recs = run_batch_size(engines, None, prompts, ids, params, 2, tiny_target, "float32", schedule="continuous")
    # the two warm-ups (one batch), the target-only probe, one call per engine with every prompt, the probe again
    assert calls == [2, 2, 2, 6, 6, 2]
    assert max(seen) == 2 and all(e.scheduler.cfg.max_batch_size == 8 for e in engines)
    waves = run_batch_size(engines, None, prompts, ids, params, 2, tiny_target, "float32")
    assert calls[6:] == [2, 2, 2] + [2] * 6 + [2]  # waves: warm-ups, probe, three calls of two per engine, probe
    for r, w in zip(recs, waves):
        assert r["spec"]["token_ids"] == r["target_only"]["token_ids"] == w["spec"]["token_ids"]
