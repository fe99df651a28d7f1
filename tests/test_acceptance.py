"""``specdec.acceptance``: shape_probs and greedy verification (the sampled rule's losslessness, by chi-square
with negative controls, is tests/test_sampling_power.py's)."""

import pytest
import torch

from specdec.acceptance import shape_probs, verify_greedy
from specdec.tree import DraftTree
from specdec.tree_spec import topk_template

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
