"""min-p sampling (``SamplingParams.min_p``): the host and batched shaping drop exactly the tokens below min_p
times the most probable one's probability (after temperature, top-k and top-p), and speculative sampling keeps
the min-p target distribution (chi-square of the first two tokens, with a negative control against the
distribution without min-p)."""

from __future__ import annotations

import pytest
import torch
from test_sampling_power import PROMPT, check_with_control, exact_dists, pair, sample, target_logits  # noqa: F401

from specdec.acceptance import shape_probs
from specdec.row_sampling import sampling_rows, shape_probs_rows
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

SETTINGS = [(1.0, 0, 1.0, 0.1), (0.7, 5, 1.0, 0.3), (1.3, 0, 0.9, 0.05), (1.0, 0, 1.0, 1.0), (0.8, 0, 1.0, 0.0)]


def _brute(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """min-p on top of ``shape_probs`` without it, one row at a time."""
    rows = []
    for p in shape_probs(logits, temperature, top_k, top_p).unbind(0):
        kept = torch.where(p >= min_p * p.max(), p, 0.0)
        rows.append(kept / kept.sum())
    return torch.stack(rows)


@pytest.mark.parametrize("setting", SETTINGS, ids=[f"T{t}-k{k}-p{p}-m{m}" for t, k, p, m in SETTINGS])
def test_min_p_drops_the_tokens_below_its_share_of_the_top(setting):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    got = shape_probs(logits, *setting)
    assert torch.allclose(got, _brute(logits, *setting), rtol=0, atol=1e-12)
    if 0 < setting[3] < 1:  # something is dropped, the top token never
        assert ((got == 0) & (shape_probs(logits, *setting[:3]) > 0)).any()
    assert (got.gather(1, logits.argmax(1, keepdim=True)) > 0).all()


def test_batched_rows_shape_min_p_like_shape_probs():
    """``shape_probs_rows`` with a different min-p (and other filters) per row equals ``shape_probs`` row by row."""
    logits = torch.randn(len(SETTINGS), 3, 40, generator=torch.Generator().manual_seed(5)) * 2  # (B, Q, V)
    rows = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in SETTINGS]
    got = shape_probs_rows(logits, sampling_rows(rows, "cpu"))
    for b, setting in enumerate(SETTINGS):
        assert torch.allclose(got[b], shape_probs(logits[b], *setting), rtol=0, atol=1e-7), setting


CHI_SAMPLES = 3000
MIN_P = 0.25


@pytest.mark.parametrize("proposer,tree,graphs", [("model", "chain:2", None), ("model", "chain:2", True),
                                                  ("ngram", "chain:3", True)])
def test_min_p_sampling_follows_the_min_p_target(pair, target_logits, proposer, tree, graphs):  # noqa: F811
    """CHI_SAMPLES seeded T=1 requests with min_p MIN_P, drafted by a draft model (the host rule; padded: the sampled
    rule) or n-gram chains (padded: the sampled rule): the first two tokens follow the min-p target, never
    take a dropped token (chisquare_p asserts it), and fail the test against the target without min-p."""
    setup = pair if proposer == "model" else (pair[0], pair[1], "ngram")
    prompt = PROMPT if proposer == "model" else [1, 5, 2, 1, 5, 2, 1]
    from test_sampling_power import _prompt_logits

    logits = target_logits if proposer == "model" else _prompt_logits(pair, prompt)
    joint, stats = sample(setup, tree, 1.0, 0, 1.0, CHI_SAMPLES, 9_000, cuda_graphs=graphs, prompt=prompt,
                          params=dict(min_p=MIN_P))
    first, second = logits
    p1 = shape_probs(first, 1.0, 0, 1.0, MIN_P).double()
    exact = p1[:, None] * shape_probs(second, 1.0, 0, 1.0, MIN_P).double()
    _, plain = exact_dists(logits, 1.0, 0, 1.0)
    assert (exact == 0).sum() > (plain == 0).sum(), "min-p drops nothing here: the test would see nothing"
    check_with_control(f"min_p {proposer} graphs={graphs}", joint, stats, p1, exact, plain)


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_greedy_rows_with_min_p_equal_target_only(pair, draft):  # noqa: F811
    """Greedy (temperature 0) ignores min_p, as in vLLM: with speculation on, rows asking for min_p 0.5 give
    target-only greedy output, in one batch with sampled min_p rows (which must not disturb them)."""
    from specdec.engine import SpecConfig, SpecEngine

    _, target, model = pair
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True, min_p=0.5)
    plain = SpecEngine(None, target, SpecConfig(block_size=2)).generate(prompts, SamplingParams(max_new_tokens=10,
                                                                                               ignore_eos=True))
    sampled = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, min_p=0.2, seed=3)
    eng = SpecEngine(model if draft == "model" else "ngram", target, SpecConfig(tree="chain:2", block_size=2))
    outs = eng.generate(prompts + prompts, [greedy] * 3 + [sampled] * 3)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in plain]
