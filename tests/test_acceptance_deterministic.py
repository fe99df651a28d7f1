"""The single-draw rule for trees with deterministic children (``accept_deterministic_padded``) gives the host
walk's outcome (``acceptance.walk_deterministic``, what ``verify_stochastic`` runs for such trees) bit for bit:
random padded batches of chains and branching trees (empty trees and idle rows included), logits with ties and
near-certain tokens, mixed temperature/top-k/top-p and greedy rows, in float32 and float64, with stream
uniforms and with adversarial ones (0, 1 - 2**-53 and the float64 neighbours of CDF steps). Greedy rows equal
the greedy rule; a variant that draws with the next column's uniform differs on most batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec import acceptance_stochastic as rules
from specdec.acceptance import shape_probs, walk_deterministic
from specdec.acceptance_batched import accept_greedy_padded
from specdec.acceptance_stochastic import PaddedTrees, RowSampling
from specdec.tree import DraftTree
from specdec.uniform_stream import padded_uniforms

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = 200  # random batches per (dtype, uniform kind)


def _tree(rng: random.Random, logits: torch.Tensor, q: int) -> DraftTree:
    """A chain or a branching tree of 0..q-1 nodes whose tokens often are the target's argmax at the parent (some
    made near-certain there), siblings distinct as a rank-grown tree's are."""
    parents, tokens = [], []
    chain = rng.random() < 0.4
    for _ in range(rng.randint(0, q - 1)):
        c = len(tokens)
        p = c - 1 if chain or rng.random() < 0.5 else rng.randrange(-1, c)
        taken = {t for t, pp in zip(tokens, parents) if pp == p}
        best = int(logits[p + 1].argmax())
        x = best if rng.random() < 0.6 and best not in taken else rng.randrange(logits.shape[-1])
        if x in taken:
            continue
        if rng.random() < 0.15:
            logits[p + 1, x] += 40.0
        parents.append(p)
        tokens.append(x)
    return DraftTree.from_parents(tokens, parents) if tokens else DraftTree.empty()


def _padded(trees: list[DraftTree], idle: list[bool], q: int) -> PaddedTrees:
    rows = [[0] * 3 * q if off else rules.tree_rows(t, q) for t, off in zip(trees, idle)]
    counts = [0 if off else t.num_nodes + 1 for t, off in zip(trees, idle)]
    host = torch.tensor(rows, dtype=torch.int64).view(len(trees), 3 * q)
    return PaddedTrees(host[:, :q], host[:, q:2 * q], host[:, 2 * q:], torch.full((len(trees), q), -1),
                       torch.tensor(counts), torch.full((len(trees),), rules.MODE_CODE["deterministic"]), None,
                       q - 1, frozenset({"deterministic"}))


def _sampling(rng: random.Random, b: int) -> tuple[RowSampling, list[tuple]]:
    temperature = [rng.choice([0.0, 0.3, 0.7, 1.0, 1.6]) for _ in range(b)]
    top_k = [rng.choice([0, 0, 1, 2, 5]) for _ in range(b)]
    top_p = [rng.choice([1.0, 1.0, 0.5, 0.9]) for _ in range(b)]
    filtered = any(k > 0 or p < 1.0 for k, p in zip(top_k, top_p)) or rng.random() < 0.2
    rows = RowSampling(torch.tensor(temperature, dtype=torch.float64), torch.tensor(top_k),
                       torch.tensor(top_p, dtype=torch.float64), filtered, 0.0 in temperature)
    return rows, list(zip(temperature, top_k, top_p))


def _uniforms(rng: random.Random, probs: torch.Tensor, trees: PaddedTrees, adversarial: bool) -> torch.Tensor:
    """(B, Q) uniforms: a stream's, or per verify token one of 0, 1 - 2**-53, a random number and a CDF step of
    its distribution (normalised) or that step's float64 neighbours."""
    b, q, _ = probs.shape
    keys = torch.tensor([[rng.getrandbits(32) for _ in range(3)] for _ in range(b)])
    u = padded_uniforms(keys[:, 0], keys[:, 1], keys[:, 2], trees.num_tokens, q)
    if not adversarial:
        return u
    cdf = probs.double().cumsum(-1)
    for i in range(b):
        for j in range(q):
            step = float(cdf[i, j, rng.randrange(probs.shape[-1])] / cdf[i, j, -1])
            pick = rng.choice([0.0, 1.0, rng.random(), step, math.nextafter(step, -1.0), math.nextafter(step, 2.0)])
            u[i, j] = min(max(pick, 0.0), 1.0 - 2.0**-53)  # a uniform is in [0, 1)
    return u


def _host(trees, idle, logits, params, u) -> torch.Tensor:
    """(B, Q + 2) of ``walk_deterministic`` row by row, in the padded layout (idle rows: left as the device's)."""
    b, q, _ = logits.shape
    out = torch.zeros(b, q + 2, dtype=torch.int64)
    for i, (t, off, (temp, k, p)) in enumerate(zip(trees, idle, params)):
        if off:
            continue
        n = t.num_nodes
        probs = shape_probs(logits[i, :n + 1], temp, k, p)  # (N+1, V)
        coins = [float(u[i, c + 1]) for c in range(n)] + [float(u[i, 0])]  # node c: column c + 1, root: 0
        res = walk_deterministic(t, probs, coins)
        path = [c + 1 for c in res.accepted_nodes]
        out[i, 0], out[i, 1] = len(path), res.bonus_token
        out[i, 2:2 + len(path)] = torch.tensor(path, dtype=torch.int64)
    return out


def _mismatches(rule, dtype: torch.dtype, adversarial: bool, stats: dict | None = None) -> list[int]:
    bad = []
    for seed in range(CASES):
        rng = random.Random(seed)
        b, q, vocab = rng.randint(1, 8), rng.randint(1, 9), rng.choice([2, 3, 8, 40])
        logits = rng.choice([0.5, 3.0]) * torch.randn(b, q, vocab, generator=torch.Generator().manual_seed(seed))
        logits = logits.round() if rng.random() < 0.4 else logits  # rounded: many ties
        trees = [_tree(rng, logits[i], q) for i in range(b)]
        logits = logits.to(dtype)
        idle = [rng.random() < 0.1 for _ in range(b)]
        padded = _padded(trees, idle, q)
        sampling, params = _sampling(rng, b)
        u = _uniforms(rng, rules.shape_probs_rows(logits, sampling), padded, adversarial)
        got = rule(logits, padded, sampling, u)
        want = _host(trees, idle, logits, params, u)
        real = torch.tensor([not off for off in idle])
        m = want[:, 0].view(-1, 1)
        cols = torch.arange(q + 2).view(1, -1) < 2 + m  # the count, the bonus and the path
        if not torch.equal(torch.where(cols, got, 0)[real], torch.where(cols, want, 0)[real]):
            bad.append(seed)
        greedy = (sampling.temperature == 0) & real
        g = accept_greedy_padded(padded.tokens, padded.parents, padded.tree_mask, logits.argmax(-1), padded.num_tokens)
        if not torch.equal(torch.where(cols, got, 0)[greedy], torch.where(cols, g, 0)[greedy]):
            bad.append(-seed - 1)
        if stats is not None:
            sampled = (sampling.temperature > 0) & real
            stats["accepted"] += int(want[sampled, 0].sum())
            stats["deep"] += int((want[sampled, 0] >= 3).sum())
            stats["branching"] += sum(1 for t, s in zip(trees, sampled.tolist()) if s and not rules_is_chain(t))
            stats["idle"] += sum(idle)
            stats["greedy"] += int(greedy.sum())
    return bad


def rules_is_chain(tree: DraftTree) -> bool:
    return tree.host.parents == list(range(-1, tree.num_nodes - 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("adversarial", [False, True], ids=["stream", "adversarial"])
def test_single_draw_rule_equals_the_host_walk(dtype, adversarial):
    stats = dict.fromkeys(("accepted", "deep", "branching", "idle", "greedy"), 0)
    assert _mismatches(rules.accept_deterministic_padded, dtype, adversarial, stats) == []
    assert min(stats.values()) >= 20, stats  # every kind of row ran many times


def test_accept_stochastic_padded_takes_the_single_draw_rule_for_deterministic_rows():
    assert _mismatches(rules.accept_stochastic_padded, torch.float64, False) == []


def _levels(trees: PaddedTrees) -> int:
    """The batch's most levels below the root: a node's level is its tree mask's bit count (itself, its ancestors
    and the root) minus 1."""
    bits = sum(((trees.tree_mask >> j) & 1) for j in range(trees.tree_mask.shape[1]))  # (B, Q)
    return int(bits.max()) - 1 if bits.numel() else 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("slack", [0, 2])
def test_walk_equals_the_host_walk(dtype, slack):
    """Drawing only along the walk (``levels`` rounds over (B, V)) gives the host walk's outcome, with the batch's
    exact depth bound and with a looser one."""

    def walk(logits, trees, sampling, u):
        return rules.accept_deterministic_walk(logits, trees, sampling, u, _levels(trees) + slack)

    assert _mismatches(walk, dtype, adversarial=slack == 2) == []


def test_walk_with_a_short_bound_is_caught():
    """Negative control: a walk cut one level short of the deepest tree misses deep paths' bonus tokens."""

    def short(logits, trees, sampling, u):
        return rules.accept_deterministic_walk(logits, trees, sampling, u, max(_levels(trees) - 1, 0))

    assert len(_mismatches(short, torch.float64, False)) > CASES // 10


def test_a_shifted_uniform_is_caught():
    """Negative control: drawing at verify token j with column j + 1's uniform (wrapping) differs on most batches."""

    def shifted(logits, trees, sampling, u):
        return rules.accept_deterministic_padded(logits, trees, sampling, u.roll(-1, dims=1))

    assert len(_mismatches(shifted, torch.float64, False)) > CASES // 3
