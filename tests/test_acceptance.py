"""Acceptance rules: shape_probs, greedy verification, and losslessness of stochastic
verification, exactly (enumeration, float64) and by sampling (chi-square)."""

import itertools

import pytest
import torch

from specdec import acceptance
from specdec.acceptance import (
    accept_prob,
    proposals,
    reject_residual,
    shape_probs,
    verify_greedy,
    verify_stochastic,
)
from specdec.tree import DraftTree, chain_template, topk_template
from specdec.uniform_stream import UniformStream

MODES = ("iid", "without_replacement", "deterministic")

# ---------------------------------------------------------------- shape_probs


def test_shape_probs_greedy_and_plain():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    assert shape_probs(logits, 0.0).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]  # first maximum
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    assert torch.allclose(shape_probs(x, 0.5), torch.softmax(x / 0.5, -1), atol=0, rtol=1e-15)
    assert shape_probs(x.half(), 1.0).dtype == torch.float32


def test_shape_probs_top_k_and_top_p():
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    lg = p.log()
    assert torch.allclose(shape_probs(lg, 1.0, top_k=2), torch.tensor([0, 4 / 7, 0, 3 / 7]).double())
    assert torch.allclose(shape_probs(lg, 1.0, top_p=0.69), torch.tensor([0, 4 / 7, 0, 3 / 7]).double())
    assert torch.allclose(shape_probs(lg, 1.0, top_p=0.71), torch.tensor([0, 4 / 9, 2 / 9, 3 / 9]).double())
    assert torch.allclose(shape_probs(lg, 1.0, top_p=0.01), torch.tensor([0, 1.0, 0, 0]).double())
    assert torch.allclose(shape_probs(lg, 1.0, top_k=2, top_p=0.5), torch.tensor([0, 1.0, 0, 0]).double())
    assert torch.equal(shape_probs(lg, 1.0, top_k=0, top_p=1.0), shape_probs(lg, 1.0))
    assert torch.equal(shape_probs(lg, 1.0, top_k=99), shape_probs(lg, 1.0))
    ties = torch.zeros(1, 4)
    assert shape_probs(ties, 1.0, top_k=2).tolist() == [[0.5, 0.5, 0.0, 0.0]]  # lower ids first
    assert shape_probs(ties, 1.0, top_p=0.5).tolist() == [[0.5, 0.5, 0.0, 0.0]]  # mass 0.5 >= 0.5
    assert torch.allclose(shape_probs(ties, 1.0, top_p=0.51), torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
])
def test_shape_probs_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        shape_probs(torch.zeros(4), **kwargs)


# ---------------------------------------------------------------- exact enumeration (float64)


def _draws(mode, q, k):
    """Every ordered draw of k children from q with its probability (independent of the code)."""
    vocab = q.shape[0]
    qs = q.tolist()
    if mode == "deterministic":
        yield sorted(range(vocab), key=lambda t: -qs[t])[:k], 1.0
        yield [(3 * j + 1) % vocab for j in range(k)], 1.0  # any fixed tokens: a second tree
        return
    iid = mode == "iid"
    seqs = itertools.product(range(vocab), repeat=k) if iid else itertools.permutations(range(vocab), k)
    for xs in seqs:
        w, used = 1.0, 0.0
        for j, x in enumerate(xs):
            rest = 1.0 - used if mode == "without_replacement" else 1.0
            # past the end of q's support the remaining draws are arbitrary: take them uniform
            w *= qs[x] / rest if rest > 1e-12 else 1.0 / (vocab - j)
            used += qs[x]
        if w > 0:
            yield list(xs), w


def _exact_first_token(p, q, xs, mode):
    """P(first committed token = y) for one fixed set of children: try_children's loop with
    probabilities instead of coins, over the real step functions (looked up on the module)."""
    out = torch.zeros_like(p)
    reach = 1.0  # probability that x_1..x_{i-1} were all rejected
    for x, q_i in zip(xs, acceptance.proposals(mode, q, xs), strict=True):
        a = acceptance.accept_prob(p, q_i, x)
        out[x] += reach * a
        reach *= 1.0 - a
        p = acceptance.reject_residual(p, q_i, x)
    return out + reach * p  # the bonus is sampled from the final p


def _dist_pairs():
    g = torch.Generator().manual_seed(1)
    rand = lambda: torch.rand(5, generator=g, dtype=torch.float64)
    norm = lambda t: t / t.sum()
    dense_p, dense_q = norm(rand()), norm(rand())
    sparse_p = norm(rand() * torch.tensor([1, 0, 1, 1, 0.0], dtype=torch.float64))
    sparse_q = norm(rand() * torch.tensor([0, 1, 1, 0, 1.0], dtype=torch.float64))
    two = norm(torch.tensor([0, 0.7, 0, 0.3, 0], dtype=torch.float64))
    one_hot = torch.tensor([0, 0, 1.0, 0, 0], dtype=torch.float64)
    return {
        "dense": (dense_p, dense_q), "sparse": (sparse_p, sparse_q), "equal": (dense_p, dense_p.clone()),
        "p_onehot": (one_hot, dense_q), "q_support_2": (dense_p, two), "q_onehot": (sparse_p, one_hot),
        "disjoint": (norm(torch.tensor([1, 1, 0, 0, 0.0], dtype=torch.float64)),
                     norm(torch.tensor([0, 0, 1, 1, 1.0], dtype=torch.float64))),
    }


def _first_token_error(mode, k, case):
    """max_y |P(first token = y) - p(y)| over every draw of k children (each fixed tree if
    deterministic)."""
    p, q = _dist_pairs()[case]
    if mode == "deterministic":
        errs = [(_exact_first_token(p, q, xs, mode) - p).abs().max().item() for xs, _ in _draws(mode, q, k)]
        return max(errs)
    total, mass = torch.zeros_like(p), 0.0
    for xs, w in _draws(mode, q, k):
        total += w * _exact_first_token(p, q, xs, mode)
        mass += w
    assert abs(mass - 1.0) < 1e-12
    return (total - p).abs().max().item()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", list(_dist_pairs()))
def test_first_token_is_exactly_target(mode, k, case):
    assert _first_token_error(mode, k, case) < 1e-15


@pytest.mark.parametrize("mode, name, broken", [
    ("without_replacement", "remove_token", lambda q, x: q.clone().index_fill_(0, torch.tensor([x]), 0.0)),
    ("iid", "reject_residual", lambda p, q, x: (p - q).clamp(min=0.0)),
    ("deterministic", "reject_residual", lambda p, q, x: p),
])
def test_enumeration_catches_a_broken_rule(mode, name, broken, monkeypatch):
    monkeypatch.setattr(acceptance, name, broken)
    assert max(_first_token_error(mode, 2, case) for case in _dist_pairs()) > 1e-3


def test_edge_cases_of_the_step():
    p = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    assert accept_prob(p, q, 0) == 0.0  # q(x) = 0: cannot be accepted
    assert torch.equal(reject_residual(p, torch.zeros(3, dtype=torch.float64), 0), p)  # null proposal
    assert accept_prob(p, q, 2) == 0.0  # p(x) = 0
    assert reject_residual(p, q, 2).tolist() == [1.0, 0.0, 0.0]
    assert accept_prob(p, None, 1) == 0.5 and reject_residual(p, None, 1).tolist() == [1.0, 0.0, 0.0]
    assert torch.equal(reject_residual(p, p.clone(), 1), p)  # zero residual mass: keep p
    wr = list(proposals("without_replacement", q, [1, 2, 0]))
    assert wr[1].tolist() == [0.0, 0.0, 1.0] and wr[2].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="child_mode"):
        list(proposals("beam", q, [1]))


# ---------------------------------------------------------------- greedy


def test_verify_greedy_paths():
    # root -> {0:5, 1:6}; 0 -> {2:7, 3:8}; 3 -> {4:9}
    tree = DraftTree.from_parents([5, 6, 7, 8, 9], [-1, -1, 0, 0, 3])
    arg = lambda *v: torch.tensor(v, dtype=torch.int64)
    r = verify_greedy(tree, arg(5, 8, 0, 0, 9, 4))
    assert (r.accepted_nodes, r.accepted_tokens, r.bonus_token) == ([0, 3, 4], [5, 8, 9], 4)
    assert r.committed_tokens == [5, 8, 9, 4]
    r = verify_greedy(tree, arg(6, 0, 1, 0, 0, 0))
    assert (r.accepted_nodes, r.bonus_token) == ([1], 1)
    r = verify_greedy(tree, arg(4, 0, 0, 0, 0, 0))
    assert (r.accepted_nodes, r.accepted_tokens, r.bonus_token) == ([], [], 4)
    assert verify_greedy(DraftTree.empty(), arg(3)).committed_tokens == [3]
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy(tree, arg(1, 2))


def test_spec_greedy_equals_target_greedy():
    """A toy bigram target + different draft: speculative greedy reproduces plain greedy."""
    g = torch.Generator().manual_seed(3)
    vocab = 16
    target = torch.randn(vocab, vocab, generator=g)
    draft = target + 1.5 * torch.randn(vocab, vocab, generator=g)
    plain = [0]
    for _ in range(40):
        plain.append(int(target[plain[-1]].argmax()))
    tpl = topk_template(2, 3)
    seq = [0]
    while len(seq) < 41:
        toks = []
        for i, par in enumerate(tpl.parents):
            ctx = seq[-1] if par < 0 else toks[par]
            toks.append(int(draft[ctx].argsort(descending=True, stable=True)[tpl.ranks[i]]))
        tree = DraftTree.from_parents(toks, tpl.parents)
        ctx = torch.tensor([seq[-1], *toks])
        seq += verify_greedy(tree, target[ctx].argmax(-1)).committed_tokens
    assert seq[:41] == plain


def test_stochastic_at_temperature_zero_is_greedy():
    """One-hot target and draft: stochastic verification makes greedy's choices."""
    g = torch.Generator().manual_seed(4)
    vocab = 10
    target, draft = torch.randn(vocab, vocab, generator=g), torch.randn(vocab, vocab, generator=g)
    parents = [-1, -1, 0, 0, 1, 2, 5]
    for _ in range(30):
        fixed = torch.randint(0, vocab, (7,), generator=g).tolist()
        drawn = []  # iid children of a one-hot draft: the draft argmax at the parent
        for par in parents:
            drawn.append(int(draft[2 if par < 0 else drawn[par]].argmax()))
        for mode, toks in (("deterministic", fixed), ("iid", drawn)):
            ctx = torch.tensor([2, *toks])
            tree = DraftTree.from_parents(toks, parents, shape_probs(draft[ctx], 0.0),
                                          [p + 1 for p in parents], mode)
            got = verify_stochastic(tree, shape_probs(target[ctx], 0.0), UniformStream(4))
            assert got == verify_greedy(tree, target[ctx].argmax(-1))


def test_stochastic_errors_and_determinism():
    tree = DraftTree.from_parents([1, 2], [-1, 0], torch.full((2, 4), 0.25), [0, 1], "iid")
    with pytest.raises(ValueError, match="target_probs"):
        verify_stochastic(tree, torch.full((2, 4), 0.25), UniformStream(0))
    with pytest.raises(ValueError, match="V=5"):
        verify_stochastic(tree, torch.full((3, 5), 0.2), UniformStream(0))
    p = torch.softmax(torch.randn(3, 4), -1)
    streams = [UniformStream(9), UniformStream(9), UniformStream(10)]
    runs = [[verify_stochastic(tree, p, s) for _ in range(20)] for s in streams]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert streams[0].counter == 20 * 3  # n + 1 draws per call
    bonus = verify_stochastic(DraftTree.empty(), torch.tensor([[0.0, 0.0, 1.0, 0.0]]), UniformStream(0))
    assert bonus.committed_tokens == [2]


# ---------------------------------------------------------------- chi-square on a toy model

VOCAB, START, SAMPLES = 12, 0, 20_000
IRREGULAR = (-1, -1, -1, 0, 0, 1)  # root: 3 children; they have 2, 1 and 0 children
SHAPES = {  # name: (parents, child_mode); deterministic children are the draft's top-k by rank
    "chain": (chain_template(3).parents, "iid"),
    "iid_tree": (IRREGULAR, "iid"),
    "wor_tree": (IRREGULAR, "without_replacement"),
    "topk_tree": (IRREGULAR, "deterministic"),
}
SAMPLING = {"t0.7_p0.9": (0.7, 0.9), "t1.0": (1.0, 1.0)}


def _toy_tables(temperature, top_p):
    """Bigram 'models': row t is the shaped next-token distribution after token t, (V, V)."""
    g = torch.Generator().manual_seed(7)
    target = 2.0 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    draft = target + 1.5 * torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)
    return shape_probs(target, temperature, None, top_p), shape_probs(draft, temperature, None, top_p)


def _draft_batch(roots, parents, mode, q_table, g):
    """(B,) root tokens -> (B, N) draft tokens, children of each node drawn as `mode` says."""
    toks = torch.zeros(len(roots), len(parents), dtype=torch.int64)
    for par in range(-1, len(parents)):
        kids = [i for i, pp in enumerate(parents) if pp == par]
        if not kids:
            continue
        q = q_table[roots if par < 0 else toks[:, par]]  # (B, V)
        if mode == "iid":
            toks[:, kids] = torch.multinomial(q, len(kids), replacement=True, generator=g)
        else:  # exponential race = ordered sample without replacement; zero-q tokens come last
            keys = q if mode == "deterministic" else q / torch.empty_like(q).exponential_(generator=g)
            toks[:, kids] = torch.sort(keys, dim=-1, descending=True, stable=True)[1][:, : len(kids)]
    return toks


def _steps(roots, shape, target, draft, g, stream):
    """One draft+verify step for each root; returns each step's committed tokens."""
    parents, mode = SHAPES[shape]
    base = DraftTree.from_parents([0] * len(parents), parents)
    dist_index = base.parents + 1  # row 0: the root's distribution, row i+1: node i's
    toks = _draft_batch(roots, parents, mode, draft, g)  # (B, N)
    ctx = torch.cat([roots[:, None], toks], 1)  # (B, N+1) context token of each verify row
    q_rows, p_rows = draft[ctx], target[ctx]  # (B, N+1, V)
    out = []
    for b in range(len(roots)):
        tree = DraftTree(toks[b], base.parents, base.depth, base.ancestor_mask, q_rows[b], dist_index, mode)
        out.append(verify_stochastic(tree, p_rows[b], stream).committed_tokens)
    return out


def _sample_two_tokens(shape, target, draft, seed, two=True):
    """SAMPLES runs of the engine loop from START: (S,) first tokens and (S,) second tokens."""
    g, stream = torch.Generator().manual_seed(seed), UniformStream(seed)  # drafts, verification
    with torch.inference_mode():
        first = _steps(torch.full((SAMPLES,), START), shape, target, draft, g, stream)
        need = [s for s, c in enumerate(first) if len(c) == 1] if two else []
        if need:
            more = _steps(torch.tensor([first[s][0] for s in need]), shape, target, draft, g, stream)
            for s, c in zip(need, more, strict=True):
                first[s] = first[s] + c[:1]
    x1 = torch.tensor([c[0] for c in first])
    x2 = torch.tensor([c[1] for c in first]) if two else None
    return x1, x2


def _chi2_pvalue(samples, probs):
    """Goodness of fit of integer samples to probs (flattened); bins expected < 5 pooled."""
    from scipy.stats import chisquare

    probs = probs.flatten().double()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs * samples.numel()
    assert counts[expected == 0].sum() == 0, "an impossible outcome was sampled"
    small = (expected < 5) & (expected > 0)
    obs = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    exp = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_chi_square_first_two_tokens(shape, sampling):
    target, draft = _toy_tables(*SAMPLING[sampling])
    x1, x2 = _sample_two_tokens(shape, target, draft, seed=11)
    joint = target[START][:, None] * target  # p(x1) p(x2 | x1), (V, V)
    assert _chi2_pvalue(x1, target[START]) > 1e-3
    assert _chi2_pvalue(x1 * VOCAB + x2, joint) > 1e-3


@pytest.mark.parametrize("bias", ["always_accept", "unnormalized_residual"])
def test_chi_square_catches_a_biased_verifier(bias, monkeypatch):
    broken = {
        "always_accept": ("accept_prob", lambda p, q, x: 1.0),
        "unnormalized_residual": ("reject_residual",
                                  lambda p, q, x: p if q is None else (p - q).clamp(min=0.0)),
    }[bias]
    monkeypatch.setattr(acceptance, *broken)
    target, draft = _toy_tables(*SAMPLING["t1.0"])
    x1, _ = _sample_two_tokens("iid_tree", target, draft, seed=11, two=False)
    assert _chi2_pvalue(x1, target[START]) < 1e-3
