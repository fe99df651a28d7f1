"""The loop-free rule for chains (``accept_chains_padded``) gives the trial loop's outcome
(``accept_stochastic_padded``) bit for bit: random padded batches of chains of every length (empty trees and
idle rows included), logits with ties and near-certain tokens, mixed temperature/top-k/top-p and greedy rows,
in float32 and float64, with stream uniforms and with adversarial ones (0, 1, and the float64 neighbours of
each node's acceptance probability). A wrong variant (the bonus from p_m without removing the rejected token,
or u <= a for u < a) differs on about a third to a half of these batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec import acceptance_stochastic as rules
from specdec.acceptance_stochastic import PaddedTrees, RowSampling
from specdec.tree import DraftTree
from specdec.uniform_stream import padded_uniforms

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = 300  # random batches per (dtype, uniform kind)


def _trees(rng: random.Random, logits: torch.Tensor) -> PaddedTrees:
    """Padded chains for the rows of ``logits`` (B, Q, V) as ``sampled_rule.step_array`` lays them out: idle rows
    all zeros with num_tokens 0, the rest chains of 0..Q-1 nodes whose tokens often are the parent's argmax, some
    made near-certain (the target all but sure of them)."""
    b, q, vocab = logits.shape
    rows, counts = [], []
    for i in range(b):
        if rng.random() < 0.1:
            rows.append([0] * 3 * q)
            counts.append(0)
            continue
        tokens = []
        for c in range(1, rng.randint(1, q)):
            x = int(logits[i, c - 1].argmax()) if rng.random() < 0.6 else rng.randrange(vocab)
            if rng.random() < 0.15:
                logits[i, c - 1, x] += 40.0
            tokens.append(x)
        rows.append(rules.tree_rows(DraftTree.chain(tokens) if tokens else DraftTree.empty(), q))
        counts.append(len(tokens) + 1)
    host = torch.tensor(rows, dtype=torch.int64).view(b, 3 * q)
    return PaddedTrees(host[:, :q], host[:, q:2 * q], host[:, 2 * q:], torch.full((b, q), -1),
                       torch.tensor(counts), torch.full((b,), rules.MODE_CODE["deterministic"]), None, q - 1,
                       frozenset({"deterministic"}))


def _sampling(rng: random.Random, b: int) -> RowSampling:
    """Per-row temperature (some greedy rows), top-k and top-p; host flags set when needed and sometimes anyway."""
    temperature = [rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]) if rng.random() < 0.9 else 1.0 for _ in range(b)]
    top_k = [rng.choice([0, 0, 1, 2, 5]) for _ in range(b)]
    top_p = [rng.choice([1.0, 1.0, 0.5, 0.9, 1.0 - 1e-9]) for _ in range(b)]
    filtered = any(k > 0 or p < 1.0 for k, p in zip(top_k, top_p)) or rng.random() < 0.2
    any_greedy = 0.0 in temperature or rng.random() < 0.2
    return RowSampling(torch.tensor(temperature, dtype=torch.float64), torch.tensor(top_k),
                       torch.tensor(top_p, dtype=torch.float64), filtered, any_greedy)


def _uniforms(rng: random.Random, logits, trees: PaddedTrees, sampling: RowSampling, adversarial: bool):
    """(B, Q) uniforms: a stream's (``padded_uniforms``), or per node one of 0, 1, a random number and the float64
    acceptance probability p_{c-1}(x_c) or its neighbours (the bonus column: 0, 1 - 2**-53, 1 or random)."""
    b, q, _ = logits.shape
    keys = torch.tensor([[rng.getrandbits(32) for _ in range(3)] for _ in range(b)])  # (B, 3) key0, key1, counter
    u = padded_uniforms(keys[:, 0], keys[:, 1], keys[:, 2], trees.num_tokens, q)
    if not adversarial:
        return u
    probs = rules.shape_probs_rows(logits, sampling).double()  # (B, Q, V)
    for i in range(b):
        u[i, 0] = rng.choice([0.0, 1.0 - 2.0**-53, 1.0, rng.random()])
        for c in range(1, q):
            a = min(1.0, float(probs[i, c - 1, int(trees.tokens[i, c])]))
            below = math.nextafter(a, -1.0)  # (accepts, as 0 does; weighted so that paths get deep)
            u[i, c] = rng.choice([0.0, below, below, 1.0, rng.random(), a, math.nextafter(a, 2.0)])
    return u


def _mismatches(chain_rule, dtype: torch.dtype, adversarial: bool, stats: dict | None = None) -> list[int]:
    """Seeds of the random batches on which ``chain_rule`` differs from the trial loop; ``stats`` counts what the
    batches exercised (accepted nodes, rejections, idle and greedy rows)."""
    bad = []
    for seed in range(CASES):
        rng = random.Random(seed)
        b, q, vocab = rng.randint(1, 10), rng.randint(1, 10), rng.choice([2, 3, 8, 40])
        logits = rng.choice([0.5, 3.0]) * torch.randn(b, q, vocab, generator=torch.Generator().manual_seed(seed))
        logits = (logits.round() if rng.random() < 0.4 else logits).to(dtype)  # rounded: many ties
        trees = _trees(rng, logits)
        sampling = _sampling(rng, b)
        u = _uniforms(rng, logits, trees, sampling, adversarial)
        want = rules.accept_stochastic_padded(logits, trees, sampling, u)  # (B, Q + 2)
        if not torch.equal(chain_rule(logits, trees, sampling, u), want):
            bad.append(seed)
        if stats is not None:
            sampled = (sampling.temperature > 0) & (trees.num_tokens > 0)
            m = want[sampled, 0]
            stats["accepted"] += int(m.sum())
            stats["deep"] += int((m >= 3).sum())
            stats["rejected"] += int((m + 1 < trees.num_tokens[sampled]).sum())
            stats["idle"] += int((trees.num_tokens == 0).sum())
            stats["greedy"] += int(((sampling.temperature == 0) & (trees.num_tokens > 1)).sum())
    return bad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adversarial", [False, True], ids=["stream", "adversarial"])
def test_chain_rule_equals_the_trial_loop(dtype, adversarial):
    stats = dict.fromkeys(("accepted", "deep", "rejected", "idle", "greedy"), 0)
    assert _mismatches(rules.accept_chains_padded, dtype, adversarial, stats) == []
    assert min(stats.values()) >= 20, stats  # every branch of the rule ran many times


def test_is_chain():
    assert rules.is_chain(DraftTree.empty()) and rules.is_chain(DraftTree.chain([4, 2, 2]))
    assert not rules.is_chain(DraftTree.from_parents([1, 2], [-1, -1]))  # siblings
    assert not rules.is_chain(DraftTree.from_parents([1, 2, 3], [-1, 0, 0]))
