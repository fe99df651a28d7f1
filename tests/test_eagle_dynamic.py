"""The device dynamic tree's selection rule (``specdec.drafters.eagle_dynamic``) against a plain-Python
reference of the same rule, on a synthetic draft whose children depend on the node and its parent."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.eagle_drafter import best_nodes
from specdec.drafters.eagle_dynamic import DEVICE_DEPTH, DEVICE_WIDTH, DynamicShape, choose, device_shape, grow
from specdec.tree import DraftTree
from specdec.tree_spec import template_from_spec

V = 40


class _Draft:
    """Children's log probabilities log_softmax(A[token] + B[parent token] + C[row]): a node's state is its
    token, like a draft state read by the children. ``masks`` records each level's ancestor bitmasks."""

    def __init__(self, b: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a, self.b_, self.c = (torch.randn(n, V, generator=g) * 3 for n in (V, V, b))
        self.root_tok = torch.randint(0, V, (b,), generator=g)
        self.root = torch.log_softmax(torch.randn(b, V, generator=g) * 3, dim=-1)  # (b, V)
        self.state = self.root_tok.view(b, 1)
        self.masks: list[torch.Tensor] = []

    def logp(self, row: int, tok: int, parent_tok: int) -> torch.Tensor:
        return torch.log_softmax(self.a[tok] + self.b_[parent_tok] + self.c[row], dim=-1)  # (V,)

    def expand(self, level: int, toks, ppos, masks):
        assert len(self.masks) == level
        self.masks.append(masks.clone())
        parent_tok = self.state.gather(1, ppos)  # (b, K)
        self.state = toks
        return torch.log_softmax(self.a[toks] + self.b_[parent_tok] + self.c[:, None], dim=-1)  # (b, K, V)


def _reference(d: _Draft, row: int, shape: DynamicShape):
    """Per row in Python: (tokens, parents, ranks) of the chosen nodes in level order, and each forwarded
    level's ancestor bitmasks. Nodes are (score, token, parent region index, parent token)."""
    k, depth, n = shape
    lp = d.root[row]
    level = [(lp[t], t, -1, int(d.root_tok[row])) for t in sorted(range(V), key=lambda t: -lp[t])[:k]]
    nodes, masks = list(level), [[1 << j for j in range(k)]]
    for lv in range(1, depth):
        cands = []
        for j, (score, tok, _, ptok) in enumerate(level):
            lp = d.logp(row, tok, ptok)
            cands += [(score + lp[t], t, (lv - 1) * k + j, tok) for t in sorted(range(V), key=lambda t: -lp[t])[:k]]
        level = sorted(cands, key=lambda c: -c[0])[:k]
        nodes += level
        if lv + 1 < depth:
            masks.append([masks[-1][c[2] - (lv - 1) * k] | (1 << (lv * k + j)) for j, c in enumerate(level)])
    best = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))[:n]
    chosen = sorted(best)
    where = {r: i for i, r in enumerate(chosen)}
    tokens = [nodes[r][1] for r in chosen]
    parents = [where[nodes[r][2]] if nodes[r][2] >= 0 else -1 for r in chosen]
    return (tokens, parents, [best.index(r) for r in chosen]), masks


def _check_tree(tokens, parents, ranks, n):
    """N nodes, parents precede children and rank better, ranks a permutation; it builds a DraftTree."""
    assert len(tokens) == len(parents) == len(ranks) == n
    assert sorted(ranks) == list(range(n))
    for i, p in enumerate(parents):
        assert -1 <= p < i and (p < 0 or ranks[p] < ranks[i])
    return DraftTree.of_parents(tokens, parents)


@pytest.mark.parametrize("shape", [DynamicShape(4, 4, 10), DynamicShape(3, 5, 15), DynamicShape(8, 3, 20),
                                   DynamicShape(1, 6, 4)])
def test_grow_equals_the_python_reference(shape):
    b = 3
    d = _Draft(b, seed=sum(shape))
    out = grow(d.root, d.expand, shape)  # (b, 3, N)
    assert out.shape == (b, 3, shape.nodes) and out.dtype == torch.int64
    assert len(d.masks) == shape.depth - 1
    for row in range(b):
        got = out[row].tolist()
        want, masks = _reference(d, row, shape)
        assert got == [list(w) for w in want]
        assert [m[row].tolist() for m in d.masks] == masks
        _check_tree(*got, shape.nodes)


def test_ties_keep_the_chosen_set_a_tree():
    """Children of probability 1 score like their parent and uniform children tie with each other: the chosen
    set still holds every chosen node's parent, and parents come first."""
    b, shape = 2, DynamicShape(4, 5, 17)
    root = torch.zeros(b, V)  # uniform (ties everywhere)

    def expand(level, toks, ppos, masks):
        out = torch.full((b, shape.width, V), -30.0)
        out[..., 0] = 0.0  # token 0 has probability 1 (float32): child score == parent score
        out[:, 1::2] = -1.0  # odd frontier positions: all their children tie
        return out

    out = grow(torch.log_softmax(root, dim=-1), expand, shape)
    for row in out.tolist():
        _check_tree(*row, shape.nodes)


def test_choose_breaks_ties_by_level_then_position():
    scores = torch.tensor([[0.0, 0.0, -1.0, 0.0, -1.0]])  # nodes 0, 1: level 0; 2..4: children
    parents = torch.tensor([[-1, -1, 0, 1, 0]])
    out = choose(scores, torch.arange(5).view(1, 5) + 10, parents, 3).tolist()[0]
    assert out == [[10, 11, 13], [-1, -1, 1], [0, 1, 2]]


def test_budget_cut_keeps_the_best_nodes():
    d = _Draft(1, seed=3)
    shape = DynamicShape(4, 4, 12)
    tokens, parents, ranks = grow(d.root, d.expand, shape)[0].tolist()
    for n in (0, 1, 5, 12, 20):
        tree = best_nodes(tokens, parents, ranks, n)
        keep = [i for i in range(12) if ranks[i] < n]
        assert tree.host.tokens == [tokens[i] for i in keep]
        for i, p in zip(keep, tree.host.parents):
            assert p == (-1 if parents[i] < 0 else keep.index(parents[i]))


def test_device_shapes_of_specs():
    assert device_shape(template_from_spec("dynamic:63")) == (DEVICE_WIDTH, DEVICE_DEPTH,
                                                              min(63, DEVICE_WIDTH * DEVICE_DEPTH))
    assert device_shape(template_from_spec("dynamic:5")) == (5, DEVICE_DEPTH, 5)
    assert device_shape(template_from_spec("dynamic:20:4x7")) == (4, 7, 20)
    assert device_shape(template_from_spec("dynamic:20:4x7")).region == 24
    with pytest.raises(ValueError, match="dynamic"):
        device_shape(template_from_spec("topk:2x2"))
    with pytest.raises(ValueError, match="width must be in"):
        grow(torch.zeros(1, 3), None, DynamicShape(4, 2, 4))


@pytest.mark.slow
def test_shipped_draft_device_dynamic_tree_equals_target_only(smollm2, smollm2_target_only, chat_prompt_ids,
                                                             smollm2_new_tokens, tree="dynamic:31"):
    """The shipped EAGLE draft on the real SmolLM2 target (float32, the graph path's padded step run eagerly on
    the CPU): every step's dynamic tree comes from the device program and greedy output equals target-only."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.loading.registry import load_model
    from specdec.sampling_params import SamplingParams

    draft = load_model("smollm2-135m-draft", target=smollm2)
    eng = SpecEngine(draft, smollm2, SpecConfig(tree=tree, num_blocks=256, max_batch_size=8, cuda_graphs=True,
                                                adaptive=False))
    loop, calls = eng.drafter.device_loop, []
    run = loop.run
    loop.run = lambda *a: calls.append(1) or run(*a)
    outs = eng.generate(chat_prompt_ids, SamplingParams(max_new_tokens=smollm2_new_tokens))
    for i, (out, ref) in enumerate(zip(outs, smollm2_target_only, strict=True)):
        assert out.token_ids == ref.token_ids, f"prompt {i}"
        assert out.finish_reason == ref.finish_reason
    assert len(calls) > 0 and eng.stats.accepted > 0 and eng.all_blocks_free()
