"""Random mixes of request options and engine configurations, each request's output against target-only decoding of
that request alone (eager, no prefix cache, batch of one). Every option that changes what a row commits
(temperature with top-p/top-k/min-p and a seed, penalties, ``logit_bias``, ``allowed_token_ids``, ``min_tokens``,
stop tokens, ``n``, log-probabilities) meets every proposer and tree kind, padded or eager steps, pipelined or
not, n-gram chains on the device or the host, the budget controller, the prefix cache and preemption: greedy rows
must equal the target's, seeded sampled rows its own keyed draws, whatever batch and path they ran in, and a second
``generate`` of the same batch must give the same output."""

from __future__ import annotations

import random

import pytest

from specdec import SamplingParams, SpecConfig, SpecEngine

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = 10
_REFERENCE: dict = {}  # (prompt, params) -> target-only output, shared by the cases


def _params(rng: random.Random, vocab: int) -> SamplingParams:
    kw = dict(max_new_tokens=rng.randint(1, 20), seed=rng.randrange(1000))
    if rng.random() < 0.5:
        kw["temperature"] = rng.choice([0.5, 1.0, 1.3])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 20])
        if rng.random() < 0.2:
            kw["min_p"] = 0.1
    if rng.random() < 0.2:
        kw["repetition_penalty"] = rng.choice([0.8, 1.2])
    if rng.random() < 0.2:
        kw["presence_penalty"] = rng.choice([-0.5, 0.5])
    if rng.random() < 0.2:
        kw["frequency_penalty"] = 0.5
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-5.0, 3.0]) for _ in range(3)}
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = rng.sample(range(vocab), 20)
    if rng.random() < 0.2:
        kw["ignore_eos"] = True
    if rng.random() < 0.15:
        kw["min_tokens"] = rng.randint(0, kw["max_new_tokens"])
    if rng.random() < 0.15:
        kw["stop_token_ids"] = [rng.randrange(vocab)]
    if rng.random() < 0.1:
        kw["n"] = 2
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 3])
    return SamplingParams(**kw)


def _config(rng: random.Random, proposer: str) -> dict:
    tree = {"model": ["chain:4", "topk:2x3", "dynamic:8", "dynamic:12:3x4"], "ngram": ["chain:4", "chain:8"],
            "none": ["auto"]}[proposer]
    cfg = dict(device="cpu", max_batch_size=rng.choice([1, 3, 8]), prefix_cache=rng.random() < 0.5,
               cuda_graphs=rng.random() < 0.6, tree=rng.choice(tree))
    cfg["pipeline"] = cfg["cuda_graphs"] and rng.random() < 0.7
    if proposer == "ngram" and cfg["cuda_graphs"] and rng.random() < 0.7:
        cfg["ngram_device"] = True
    if proposer != "none" and rng.random() < 0.3:
        cfg["adaptive"] = True
    if rng.random() < 0.3:  # a pool small enough to preempt
        cfg.update(policy="max_utilization", num_blocks=rng.choice([12, 20, 40]))
    return cfg


def _prompts(rng: random.Random, vocab: int) -> list[list[int]]:
    base = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))]  # (some share a prefix)
    out = []
    for _ in range(rng.randint(1, 10)):
        if rng.random() < 0.5:
            out.append(base[:rng.randint(1, len(base))] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 8))])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))])
    return out


def _outputs(outs) -> list[tuple]:
    """Per request: finish reason, each sample's tokens, and each sample's log-probability entries."""
    return [(o.finish_reason, [list(c.token_ids) for c in o.outputs],
             [None if c.logprobs is None else [[(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in c.logprobs]
              for c in o.outputs]) for o in outs]


def _same(a: tuple, b: tuple) -> bool:
    """Equal tokens and finish reasons, the same log-probability entries (tokens and ranks; values to 1e-4: logits
    of differently shaped forwards differ in float32 rounding)."""
    if a[:2] != b[:2]:
        return False
    for x, y in zip(a[2], b[2]):
        if (x is None) != (y is None) or (x is not None and len(x) != len(y)):
            return False
        for ex, ey in zip(x or (), y or ()):
            if [(t, r) for t, _, r in ex] != [(t, r) for t, _, r in ey]:
                return False
            if any(abs(u - v) > 1e-4 for (_, u, _), (_, v, _) in zip(ex, ey)):
                return False
    return True


@pytest.mark.parametrize("case", range(CASES))
def test_random_mix_equals_target_only_alone(case, tiny_target, tiny_draft):
    rng = random.Random(case)
    vocab = tiny_target.config.vocab_size
    proposer = ("model", "ngram", "none", "model", "ngram")[case % 5]
    cfg = _config(rng, proposer)
    prompts = _prompts(rng, vocab)
    params = [_params(rng, vocab) for _ in prompts]
    draft = {"model": tiny_draft, "ngram": "ngram", "none": None}[proposer]
    engine = SpecEngine(draft, tiny_target, SpecConfig(**cfg))
    got = _outputs(engine.generate(prompts, params))
    again = _outputs(engine.generate(prompts, params))
    reference = SpecEngine(None, tiny_target, SpecConfig(device="cpu", max_batch_size=1, prefix_cache=False,
                                                         cuda_graphs=False, pipeline=False))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert got[i][0] != "error", (cfg, i, p)
        assert _same(again[i], got[i]), (cfg, i, p, "a second generate differs")
        key = (tuple(prompt), p)
        if key not in _REFERENCE:
            _REFERENCE[key] = _outputs(reference.generate([prompt], p))[0]
        assert _same(got[i], _REFERENCE[key]), (cfg, i, p, got[i][:2], _REFERENCE[key][:2])
