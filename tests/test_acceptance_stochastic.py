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
from test_acceptance import _draft_batch

from specdec import acceptance
from specdec.acceptance import shape_probs, verify_stochastic
from specdec.acceptance_batched import unpack_greedy
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
from specdec.sampling_params import SamplingParams
from specdec.tree import CHILD_MODES, DraftTree
from specdec.uniform_stream import UniformStream

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
    toks = _draft_batch(roots, parents, mode, q_table, g)  # (B, N); deterministic: the draft's top-k
    ctx = torch.cat([roots[:, None], toks], 1)  # (B, N+1): the token each verify position follows
    template = DraftTree.from_parents([0] * n, list(parents))
    masks, vparents = template.verify_rows()
    rows = lambda v: torch.tensor(v, dtype=torch.int64).expand(b, n + 1).clone()
    det = mode == "deterministic"
    dist_index = torch.cat([torch.full((b, 1), -1), torch.tensor(vparents[1:]).view(1, -1)
                            + (n + 1) * torch.arange(b).view(-1, 1)], 1)  # node drawn from its parent's row
    trees = PaddedTrees(ctx, rows(vparents), rows(masks), torch.full((b, n + 1), -1) if det else dist_index,
                        torch.full((b,), n + 1), torch.full((b,), MODE_CODE[mode]),
                        None if det else q_table[ctx].reshape(-1, VOCAB), n, frozenset({mode}))
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
                        rep(one.num_tokens), rep(one.child_mode), dists, one.max_trials, one.modes)
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


# ---------------------------------------------------------------- (b) agreement with the host rule

K_DRAWS = 600  # draws per random tree for each rule


def _random_tree(rng: random.Random, mode: str, n: int, vocab: int) -> DraftTree:
    parents = [i - 1 if rng.random() < 0.5 else rng.randrange(-1, i) for i in range(n)]  # deep and bushy
    tokens, used = [], {}
    for p in parents:  # siblings drawn without replacement never repeat a token
        taken = used.setdefault(p, set()) if mode == "without_replacement" else set()
        tokens.append(rng.choice([t for t in range(vocab) if t not in taken]))
        taken.add(tokens[-1])
    if mode == "deterministic":
        return DraftTree.from_parents(tokens, parents)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    dists = torch.softmax(2.0 * torch.randn(n + 1, vocab, generator=g), -1)  # (N+1, V), row v+1 under node v
    return DraftTree.from_parents(tokens, parents, dists, [p + 1 for p in parents], mode)


def _random_case(seed: int, vocab: int = 6):
    """Random trees of every mode (one empty), target logits (T, Q, V) and sampling params per tree."""
    rng = random.Random(seed)
    trees = [_random_tree(rng, mode, n, vocab) for mode, n in zip(CHILD_MODES * 3, [7, 5, 9, 3, 8, 6, 0, 4, 10])]
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(len(trees), 12, vocab, generator=g)
    for t, lg in zip(trees, logits):  # the target often agrees with the tree, so paths get deep
        for i, p in enumerate(t.host.parents):
            lg[p + 1, t.host.tokens[i]] += 3.0 * (rng.random() < 0.6)
    params = [SamplingParams(temperature=rng.choice([0.6, 1.0, 1.5]), top_k=rng.choice([0, 3]),
                             top_p=rng.choice([1.0, 0.85]), seed=i) for i in range(len(trees))]
    return trees, logits, params


def _device_outcomes(trees, logits, params, seeds):
    """Outcomes (nodes, bonus) of the device rule, each tree repeated once per seed (one call)."""
    rows = [(t, lg, p, s) for t, lg, p in zip(trees, logits, params) for s in seeds]
    streams = [UniformStream(s) for *_, s in rows]
    q = logits.shape[1]
    padded = pad_trees([r[0] for r in rows], q, "cpu")
    out = accept_stochastic_padded(torch.stack([r[1] for r in rows]), padded,
                                   sampling_rows([r[2] for r in rows], "cpu"),
                                   draw_uniforms(streams, [r[0] for r in rows], q, "cpu"))
    return [unpack_greedy(row) for row in out.tolist()]


def _host_outcomes(trees, logits, params, seeds):
    res = []
    for t, lg, p in zip(trees, logits, params):
        probs = shape_probs(lg[:t.num_nodes + 1], p.temperature, p.top_k, p.top_p)
        for s in seeds:
            r = verify_stochastic(t, probs, UniformStream(s))
            res.append((list(r.accepted_nodes), r.bonus_token))
    return res


def test_same_stream_same_outcome_as_host_rule():
    """Seeded like verify_stochastic, the device rule makes the same choices (the same uniforms; outcomes may
    differ only where a coin lands within float rounding of a threshold)."""
    trees, logits, params = _random_case(3)
    seeds = range(150)
    dev, host = _device_outcomes(trees, logits, params, seeds), _host_outcomes(trees, logits, params, seeds)
    same = sum(d == h for d, h in zip(dev, host)) / len(dev)
    assert same >= 0.995, same
    assert max(len(n) for n, _ in dev) >= 3  # deep paths are exercised


def test_outcome_distribution_matches_host_rule():
    """Independent streams (different seeds): per tree, the (path, bonus) outcomes of the device rule and of
    verify_stochastic are one distribution (two-sample chi-square, sparse outcomes pooled)."""
    trees, logits, params = _random_case(4)
    dev = _device_outcomes(trees, logits, params, range(K_DRAWS))
    host = _host_outcomes(trees, logits, params, range(10**6, 10**6 + K_DRAWS))
    for i in range(len(trees)):
        a = [str(o) for o in dev[i * K_DRAWS:(i + 1) * K_DRAWS]]
        b = [str(o) for o in host[i * K_DRAWS:(i + 1) * K_DRAWS]]
        keys = sorted(set(a) | set(b))
        table = torch.tensor([[a.count(k) for k in keys], [b.count(k) for k in keys]], dtype=torch.float64)
        rare = table.sum(0) < 10
        table = torch.cat([table[:, ~rare], table[:, rare].sum(1, keepdim=True)], 1)
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        assert scipy_stats.chi2_contingency(table.numpy()).pvalue > P_MIN, (i, keys, table)


def test_shape_probs_rows_equals_shape_probs():
    g = torch.Generator().manual_seed(2)
    logits = 3.0 * torch.randn(6, 4, 9, generator=g)
    logits[2, :, 3:5] = logits[2, :, 2:3]  # ties keep the lower ids
    params = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.8), (2.0, 20, 1.0)]
    sampling = sampling_rows([SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in params], "cpu")
    got = shape_probs_rows(logits, sampling)
    for row, (t, k, p) in zip(range(6), params):
        assert torch.allclose(got[row], shape_probs(logits[row], t, k, p), rtol=0, atol=1e-7), row
    plain = sampling_rows([SamplingParams(temperature=1.0)] * 6, "cpu")
    assert not plain.filtered
    assert torch.allclose(shape_probs_rows(logits, plain), torch.softmax(logits, -1), rtol=0, atol=1e-7)
