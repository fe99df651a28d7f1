"""The one-launch tree steps against their torch references (``choose``, ``select_level``), ties and NaN included."""

import os

import torch

if not torch.cuda.is_available():  # CPU: run the Triton kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kernels.topk import topk_reference  # noqa: E402
from specdec.kernels.tree_choose import (  # noqa: E402
    MAX_NODES,
    MAX_WIDTH,
    tree_choose,
    tree_choose_triton,
    tree_level,
    tree_level_triton,
)

from specdec.tree_ops import choose, select_level  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(b: int, m: int, seed: int):
    """Scores with many ties (few values, -0.0 and +0.0, -inf, a NaN), tokens, parents (some not chosen)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 1, (b, m), generator=g).float() / 2
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=g) < 0.5, -0.0, 0.0)
    scores[torch.rand(b, m, generator=g) < 0.1] = float("-inf")
    scores[0, m // 2] = float("nan")
    tokens = torch.randint(0, 50000, (b, m), generator=g)
    parents = torch.randint(-1, m, (b, m), generator=g)
    return scores.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE)


@pytest.mark.parametrize("b,m", [(3, 50), (2, 7), (1, 130)])
def test_tree_choose_equals_choose(b, m):
    scores, tokens, parents = _rows(b, m, seed=m)
    for n in sorted({1, m // 2, m - 1, m}):
        got, want = tree_choose_triton(scores, tokens, parents, n), choose(scores, tokens, parents, n)
        assert torch.equal(got, want), (n, got, want)


def test_grown_tree_rows_and_equal_scores():
    """Rows of one score take the first n nodes in order; a real tree (parents before children) keeps its
    parent links; the op agrees both ways."""
    m, n = 20, 8
    scores = torch.zeros(2, m, device=DEVICE)
    scores[1] = -torch.arange(m, device=DEVICE).float()  # already best first
    tokens = torch.arange(m, device=DEVICE).repeat(2, 1) + 100
    parents = (torch.arange(m, device=DEVICE) - 5).clamp(min=-1).repeat(2, 1)  # node i's parent: i - 5
    got = tree_choose(scores, tokens, parents, n, use_triton=True)
    assert got[:, 0].tolist() == [list(range(100, 100 + n))] * 2
    assert got[:, 1].tolist() == [[-1] * 5 + [0, 1, 2]] * 2 and got[:, 2].tolist() == [list(range(n))] * 2
    assert torch.equal(got, tree_choose(scores, tokens, parents, n, use_triton=False))
    wide = _rows(1, MAX_NODES + 1, seed=1)  # past MAX_NODES the Triton backend takes the torch path
    assert torch.equal(tree_choose(*wide, 3, use_triton=True), choose(*wide, 3))


def _args(m: int = 5, n: int = 2, tokens_m: int | None = None, parents_dtype=torch.int64):
    i64 = dict(dtype=torch.int64, device=DEVICE)
    return (torch.zeros(1, m, device=DEVICE), torch.zeros(1, tokens_m or m, **i64),
            torch.zeros(1, m, dtype=parents_dtype, device=DEVICE), n)


@pytest.mark.parametrize("args,match", [
    (_args(n=6), "n must"), (_args(n=0), "n must"),
    (_args(tokens_m=4), "tokens must have shape"),
    (_args(parents_dtype=torch.float32), "parents must have dtype"),
    (_args(m=MAX_NODES + 1), "scores must have 1 to"),
])
def test_bad_arguments_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        tree_choose_triton(*args)


@pytest.mark.parametrize("b,k", [(3, 10), (2, 4), (1, 16)])
def test_tree_level_equals_select_level_by_the_topk_tie_rule(b, k):
    """Tied candidates (few values, a NaN): the torch reference's top-k with ties to the lower candidate."""
    g = torch.Generator().manual_seed(b * k)
    score = (torch.randint(-3, 1, (b, k), generator=g).float()).to(DEVICE)
    top_val = (torch.randint(-3, 1, (b, k, k), generator=g).float() / 2).to(DEVICE)
    top_val[0, 1, 2] = float("nan")
    top_idx = torch.randint(0, 24576, (b, k, k), generator=g).to(DEVICE)
    masks = torch.randint(0, 1 << 40, (b, k), generator=g).to(DEVICE)
    bits = (1 << torch.arange(k, 2 * k)).to(DEVICE)
    got = tree_level_triton(score, top_val, top_idx, masks, bits)
    order = topk_reference((score.unsqueeze(-1) + top_val).view(b, k * k), k).indices  # ties: lower candidate
    ref = select_level(score, top_val, top_idx, masks, bits)  # torch.topk: the same values
    assert torch.equal(got[0].nan_to_num(), ref[0].nan_to_num()) and got[0][0, 0].isnan()
    assert torch.equal(got[1], order // k) and torch.equal(got[2], top_idx.view(b, -1).gather(1, order))
    assert torch.equal(got[3], masks.gather(1, order // k) | bits)
    distinct = torch.randn(b, k, generator=g).to(DEVICE), torch.randn(b, k, k, generator=g).to(DEVICE)
    both = [f(*distinct, top_idx, masks, bits) for f in (tree_level_triton, select_level)]
    assert all(torch.equal(x, y) for x, y in zip(*both))  # no ties: the torch reference exactly
    for use_triton, want in ((True, tree_level_triton), (False, select_level)):  # the op
        got = tree_level(score, top_val, top_idx, masks, bits, use_triton=use_triton)
        expect = want(score, top_val, top_idx, masks, bits)
        assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(got, expect))
    w = MAX_WIDTH + 1  # past MAX_WIDTH the op takes the torch path on the Triton backend too
    zeros = torch.zeros(1, w, w, device=DEVICE)
    wide = (zeros[:, 0], zeros, zeros.long(), zeros[:, 0].long(), zeros[0, 0].long())
    assert all(torch.equal(x, y) for x, y in zip(tree_level(*wide, use_triton=True), select_level(*wide)))


def test_tree_level_bad_width_names_the_field():
    z = torch.zeros(1, MAX_WIDTH + 1, device=DEVICE)
    with pytest.raises(ValueError, match="score must have 1 to"):
        tree_level_triton(z, z, z.long(), z.long(), z[0].long())
    with pytest.raises(ValueError, match="top_val must have shape"):
        two = torch.zeros(1, 2, device=DEVICE)
        tree_level_triton(two, two, *[two.long()] * 3)
