"""Device-side stochastic verification of a padded batch (``accept_stochastic_padded``), on the CPU.

Exactness by chi-square against exact distributions (20k rows in one call), agreement with the host
rule ``verify_stochastic``, greedy and padded rows, and the engine's padded step (``cuda_graphs=True``)
taking sampled rows through the device rule. A CUDA test at the bottom compares the GPU with the CPU
and a captured CUDA graph with eager execution.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec import acceptance
from specdec.acceptance import sample_token, shape_probs, verify_stochastic
from specdec.acceptance_batched import accept_greedy_padded, unpack_greedy
from specdec.acceptance_stochastic import (
    MODE_CODE,
    PaddedTrees,
    RowSampling,
    accept_stochastic_padded,
    draw_uniforms,
    pad_trees,
    sampling_rows,
    shape_probs_rows,
)
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.tree import CHILD_MODES, DraftTree

scipy_stats = pytest.importorskip("scipy.stats")
pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB, START, SAMPLES, P_MIN = 5, 0, 20_000, 1e-3
IRREGULAR = (-1, -1, -1, 0, 0, 1, 3)  # root: 3 children; they have 2, 1, 0; node 3 has one more
SHAPES = {"iid_chain": ((-1, 0, 1), "iid"), "iid_tree": (IRREGULAR, "iid"),
          "wor_tree": (IRREGULAR, "without_replacement"), "det_tree": (IRREGULAR, "deterministic")}
SETTINGS = {"t1": (1.0, 0, 1.0), "t0.7_k4_p0.9": (0.7, 4, 0.9)}


def _tables(seed=7):
    """Bigram 'models' over VOCAB tokens: target and draft logits, (V, V) each (row = previous token)."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(VOCAB, VOCAB, generator=g)
    return target, target + 1.0 * torch.randn(VOCAB, VOCAB, generator=g)


def _sampling(b, temperature, top_k, top_p):
    full = lambda v, dt: torch.full((b,), v, dtype=dt)
    return RowSampling(full(temperature, torch.float64), full(top_k, torch.int64), full(top_p, torch.float64))


def _batch(roots, shape, setting, g):
    """One draft of every row's tree from its root token (children drawn as the mode says), in the padded
    layout: (logits (B, Q, V), PaddedTrees, RowSampling). Built as tensors: no DraftTree per row."""
    parents, mode = SHAPES[shape]
    tl, dl = _tables()
    sampling = _sampling(len(roots), *setting)
    q_table = shape_probs(dl, *setting)  # (V, V) draft distribution after each token
    b, n = len(roots), len(parents)
    toks = torch.zeros(b, n, dtype=torch.int64)
    for par in range(-1, n):
        kids = [i for i, pp in enumerate(parents) if pp == par]
        if not kids:
            continue
        q = q_table[roots if par < 0 else toks[:, par]]  # (B, V)
        if mode == "iid":
            toks[:, kids] = torch.multinomial(q, len(kids), replacement=True, generator=g)
        else:  # exponential race = ordered draw without replacement; deterministic: the draft's top-k
            keys = q if mode == "deterministic" else q / torch.empty_like(q).exponential_(generator=g)
            toks[:, kids] = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, :len(kids)]
    ctx = torch.cat([roots[:, None], toks], 1)  # (B, N+1): the token each verify position follows
    template = DraftTree.from_parents([0] * n, list(parents))
    masks, vparents = template.verify_rows()
    rows = lambda v: torch.tensor(v, dtype=torch.int64).expand(b, n + 1).clone()
    det = mode == "deterministic"
    dist_index = torch.cat([torch.full((b, 1), -1), torch.tensor(vparents[1:]).view(1, -1)
                            + (n + 1) * torch.arange(b).view(-1, 1)], 1)  # node drawn from its parent's row
    trees = PaddedTrees(ctx, rows(vparents), rows(masks), torch.full((b, n + 1), -1) if det else dist_index,
                        torch.full((b,), n + 1), torch.full((b,), MODE_CODE[mode]),
                        None if det else q_table[ctx].reshape(-1, VOCAB), n)
    return tl[ctx], trees, sampling  # logits (B, N+1, V)


def _committed(out, trees):
    """Per row the committed tokens (accepted path tokens + bonus) of a host copy of the output."""
    toks = trees.tokens.tolist()
    res = []
    for row, tk in zip(out.tolist(), toks):
        nodes, bonus = unpack_greedy(row)
        res.append([tk[i + 1] for i in nodes] + [bonus])
    return res


def chisquare_p(counts, probs):
    """Chi-square p-value of counts against probs (flattened); zero-probability cells must be empty,
    cells with expected < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    zero = probs == 0
    assert counts[zero].sum() == 0, "an outcome of probability 0 was sampled"
    counts, expected = counts[~zero], probs[~zero] / probs[~zero].sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(scipy_stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


# ---------------------------------------------------------------- (a) exactness against the target


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_first_two_tokens_follow_the_target(shape, setting):
    """SAMPLES rows in one call: the first committed token ~ p(. | START) and the first two ~ p(x1) p(x2 | x1)
    (rows that commit one token take a second step from it, as the engine would)."""
    g = torch.Generator().manual_seed(11)
    tl, _ = _tables()
    exact = shape_probs(tl.double(), *SETTINGS[setting])  # (V, V) p(next | previous)
    roots = torch.full((SAMPLES,), START)
    logits, trees, sampling = _batch(roots, shape, SETTINGS[setting], g)
    first = _committed(accept_stochastic_padded(logits, trees, sampling, _uniforms(trees, g)), trees)
    short = [s for s, c in enumerate(first) if len(c) == 1]
    logits, trees, sampling = _batch(torch.tensor([first[s][0] for s in short], dtype=torch.int64), shape,
                                     SETTINGS[setting], g)
    second = _committed(accept_stochastic_padded(logits, trees, sampling, _uniforms(trees, g)), trees)
    for s, c in zip(short, second, strict=True):
        first[s] = first[s] + c[:1]
    x1, x2 = torch.tensor([c[0] for c in first]), torch.tensor([c[1] for c in first])
    assert len(short) < 0.9 * SAMPLES  # draft tokens are accepted often enough to matter
    assert chisquare_p(torch.bincount(x1, minlength=VOCAB), exact[START]) > P_MIN
    joint = exact[START][:, None] * exact  # (V, V)
    assert chisquare_p(torch.bincount(x1 * VOCAB + x2, minlength=VOCAB**2), joint) > P_MIN


def _uniforms(trees, g):
    return torch.rand(trees.tokens.shape, dtype=torch.float64, generator=g)


def _exact_outcomes(parents, tokens, p_rows, q_rows, mode):
    """(N+1, V) probability of each (deepest accepted verify index, bonus token) for one fixed tree, from the
    host step functions of specdec.acceptance (checked exactly by enumeration in test_acceptance.py)."""
    n = len(parents)
    out = torch.zeros(n + 1, VOCAB, dtype=torch.float64)

    def walk(v, reach):  # v: verify index reached with probability `reach`
        kids = [i + 1 for i, pp in enumerate(parents) if pp + 1 == v]
        p = p_rows[v]
        xs = [tokens[k] for k in kids]
        for k, x, q_i in zip(kids, xs, acceptance.proposals(mode, q_rows[v], xs)):
            a = acceptance.accept_prob(p, q_i, x)
            walk(k, reach * a)
            reach *= 1.0 - a
            p = acceptance.reject_residual(p, q_i, x)
        out[v] += reach * p

    walk(0, 1.0)
    return out


@pytest.mark.parametrize("shape", ["iid_tree", "wor_tree", "det_tree"])
def test_outcome_of_a_fixed_tree_is_exact(shape):
    """The joint (accepted path, bonus) of one fixed draft, SAMPLES times in one call, against its exact
    distribution; a wrong residual in the device rule would fail this (see the negative control)."""
    g = torch.Generator().manual_seed(5)
    counts, exact = _fixed_tree_counts(shape, g)
    assert (exact > 0.01).sum() >= 6  # deep paths and several bonus tokens carry mass
    assert chisquare_p(counts, exact) > P_MIN


def _fixed_tree_counts(shape, g):
    """(counts, exact) over (deepest accepted verify index, bonus) of one fixed draft from START, SAMPLES rows."""
    parents, mode = SHAPES[shape]
    n = len(parents)
    logits, one, _ = _batch(torch.full((1,), START), shape, SETTINGS["t1"], g)
    b = SAMPLES
    rep = lambda t: t.expand(b, *t.shape[1:]).clone()
    shift = (one.dist_index >= 0) * (n + 1) * torch.arange(b).view(-1, 1)  # each row its own copy of the dists
    dists = None if one.dists is None else one.dists.repeat(b, 1)
    trees = PaddedTrees(rep(one.tokens), rep(one.parents), rep(one.tree_mask), rep(one.dist_index) + shift,
                        rep(one.num_tokens), rep(one.child_mode), dists, one.max_trials)
    out = accept_stochastic_padded(rep(logits), trees, _sampling(b, *SETTINGS["t1"]), _uniforms(trees, g))
    m = out[:, :1]
    deepest = torch.where(m > 0, out.gather(1, (m + 1).clamp(min=2)), 0).view(-1)  # last accepted verify index
    counts = torch.bincount(deepest * VOCAB + out[:, 1], minlength=(n + 1) * VOCAB)
    p_rows = shape_probs(logits[0].double(), *SETTINGS["t1"])  # (N+1, V)
    q_at = []  # per verify index: the draft distribution its children were drawn from
    for v in range(n + 1):
        kid = next((i + 1 for i, pp in enumerate(parents) if pp + 1 == v), None)
        q_at.append(None if one.dists is None or kid is None else one.dists[one.dist_index[0, kid]].double())
    return counts, _exact_outcomes(parents, one.tokens[0].tolist(), p_rows, q_at, mode)


def test_negative_control_unnormalised_residual_fails(monkeypatch):
    """A device rule that forgets to renormalise the residual max(p - q, 0) fails the same test."""
    import specdec.acceptance_stochastic as mod

    monkeypatch.setattr(mod, "_residual", lambda p, q_i: (p - q_i).clamp(min=0.0))
    counts, exact = _fixed_tree_counts("iid_tree", torch.Generator().manual_seed(5))
    assert chisquare_p(counts, exact) < P_MIN
