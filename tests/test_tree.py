"""DraftTree arrays and masks, validation errors, static templates and the spec parser."""

import random

import pytest
import torch

from specdec.tree import MAX_TREE_NODES, DraftTree, HostView
from specdec.tree_spec import TreeSpec, TreeTemplate, chain_template, draw_tree, template_from_spec, topk_template


def _reference(parents):
    """Depth and ancestor sets by walking up, independent of the implementation."""
    depth, anc = [], []
    for i in range(len(parents)):
        chain, j = [], i
        while j != -1:
            chain.append(j)
            j = parents[j]
        depth.append(len(chain) - 1)
        anc.append(set(chain))
    return depth, anc


def _check_tree(tree: DraftTree, parents):
    depth, anc = _reference(parents)
    assert tree.depth.tolist() == depth
    assert tree.parents.tolist() == list(parents)
    for i, m in enumerate(tree.ancestor_mask.tolist()):
        assert {j for j in range(len(parents)) if m >> j & 1} == anc[i]
    vm = tree.verify_tree_mask()
    assert vm.dtype == torch.int64 and vm.shape == (len(parents) + 1,)
    assert tree.verify_rows() == (vm.tolist(), [-1] + [p + 1 for p in parents])  # the host twin agrees
    assert vm[0].item() == 1
    for i in range(len(parents)):
        bits = {j for j in range(64) if (vm[i + 1].item() >> j) & 1}
        assert bits == {0} | {j + 1 for j in anc[i]}  # root + ancestors + itself, shifted by one
        assert tree.path_to(i) == sorted(anc[i])
        assert tree.path_to(i)[-1] == i
    assert tree.max_depth == (max(depth) + 1 if depth else 0)
    kids = {p: [i for i, q in enumerate(parents) if q == p] for p in range(-1, len(parents))}
    assert all(tree.children(p) == kids[p] for p in kids)


def test_chain_tree():
    parents = chain_template(5).parents
    tree = DraftTree.from_parents([7, 3, 3, 9, 1], parents)
    _check_tree(tree, parents)
    assert tree.depth.tolist() == [0, 1, 2, 3, 4]
    assert tree.ancestor_mask.tolist() == [0b1, 0b11, 0b111, 0b1111, 0b11111]
    assert tree.verify_tree_mask().tolist() == [1, 0b11, 0b111, 0b1111, 0b11111, 0b111111]
    assert tree.num_nodes == 5 and tree.max_depth == 5


def test_topk_tree():
    t = topk_template(2, 3)
    assert t.num_nodes == 14
    assert t.parents == (-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5)
    assert t.ranks == (0, 1) * 7
    assert t.depth == (0, 0) + (1,) * 4 + (2,) * 8
    tree = DraftTree.from_parents(list(range(14)), t.parents)
    _check_tree(tree, t.parents)
    assert tree.children(-1) == [0, 1] and tree.children(1) == [4, 5] and tree.children(13) == []


def test_of_parents_equals_from_parents():
    """The host-list tree of a device-drafted dynamic tree: the same arrays as ``from_parents`` (tensors made
    on first use), and a parent that does not precede its child is refused."""
    rng = random.Random(3)
    parents = [-1, -1] + [rng.randrange(i) for i in range(2, MAX_TREE_NODES)]  # 63 nodes: bit 62 at most
    tokens = [rng.randrange(1000) for _ in parents]
    tree, ref = DraftTree.of_parents(tokens, parents), DraftTree.from_parents(tokens, parents)
    assert "parents" not in tree.__dict__ and tree.host == ref.host
    _check_tree(tree, parents)
    for name in ("tokens", "parents", "depth", "ancestor_mask"):
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name
    assert DraftTree.of_parents([], []).num_nodes == 0
    with pytest.raises(ValueError, match=r"parents\[1\] must be in \[-1, 0\]"):
        DraftTree.of_parents([1, 2], [-1, 1])
    with pytest.raises(ValueError, match="one length"):
        DraftTree.of_parents([1, 2], [-1])


@pytest.mark.parametrize("seed", range(20))
def test_random_trees(seed):
    rng = random.Random(seed)
    n = rng.randint(1, MAX_TREE_NODES)
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    tree = DraftTree.from_parents([rng.randrange(100) for _ in range(n)], parents)
    _check_tree(tree, parents)
    assert TreeTemplate(tuple(parents)).depth == tuple(tree.depth.tolist())


def test_full_chain_uses_bit_63():
    tree = DraftTree.from_parents([0] * 63, chain_template(63).parents)
    vm = tree.verify_tree_mask()
    assert vm[-1].item() == -1  # all 64 bits set: int64 wraparound
    assert tree.verify_rows()[0] == vm.tolist()  # the host twin wraps bit 63 the same way
    assert tree.ancestor_mask[-1].item() == (1 << 63) - 1


def test_empty_tree():
    tree = DraftTree.empty()
    assert tree.num_nodes == 0 and tree.max_depth == 0
    assert tree.children(-1) == [] and tree.path_to(-1) == []
    assert tree.verify_tree_mask().tolist() == [1]
    assert tree.tokens.shape == (0,)


def test_to_keeps_the_arrays():
    tree = DraftTree.from_parents([1, 2, 3], [-1, -1, 0])
    moved = tree.to("cpu")
    assert moved.host == tree.host and moved.tokens.tolist() == [1, 2, 3]


def _valid():
    z = lambda v: torch.tensor(v, dtype=torch.int64)
    return dict(tokens=z([5, 6, 7]), parents=z([-1, 0, 0]), depth=z([0, 1, 1]),
                ancestor_mask=z([1, 3, 5]))


@pytest.mark.parametrize("change, field", [
    (dict(tokens=torch.tensor([5.0, 6.0, 7.0])), "tokens"),
    (dict(tokens=torch.zeros(64, dtype=torch.int64)), "tokens"),
    (dict(parents=torch.tensor([-1, 0], dtype=torch.int64)), "parents"),
    (dict(parents=torch.tensor([-1, 2, 0], dtype=torch.int64)), "parents"),
    (dict(parents=torch.tensor([-2, 0, 0], dtype=torch.int64)), "parents"),
    (dict(depth=torch.tensor([0, 1, 2], dtype=torch.int64)), "depth"),
    (dict(ancestor_mask=torch.tensor([1, 3, 7], dtype=torch.int64)), "ancestor_mask"),
    (dict(tokens=torch.tensor([5, -1, 7], dtype=torch.int64)), "tokens"),
])
def test_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        DraftTree(**{**_valid(), **change})


def test_valid_tree_and_query_errors():
    tree = DraftTree(**_valid())
    assert tree.children(0) == [1, 2]
    with pytest.raises(ValueError, match="node index"):
        tree.children(3)
    with pytest.raises(ValueError, match="node index"):
        tree.path_to(-2)
    with pytest.raises(ValueError, match="parents"):
        DraftTree.from_parents([1, 2], [-1, 1])


def test_templates_checked_with_networkx():
    assert chain_template(3).parents == (-1, 0, 1)
    g = topk_template(3, 2).graph()
    assert g.number_of_nodes() == 13 and g.out_degree(-1) == 3
    for bad in [(0,), (-1, 2, 1), (-1, 5), (-3,)]:
        with pytest.raises(ValueError, match="parents"):
            TreeTemplate(bad)
    with pytest.raises(ValueError, match="at most 63"):
        topk_template(2, 6)  # 126 nodes
    with pytest.raises(ValueError, match="chain length k"):
        chain_template(64)
    assert topk_template(2, 5).num_nodes == 62


@pytest.mark.parametrize("text, spec", [
    ("chain:4", TreeSpec("chain", width=1, depth=4, budget=4)),
    ("topk:2x3", TreeSpec("topk", width=2, depth=3, budget=14)),
    (" TOPK:1x1 ", TreeSpec("topk", width=1, depth=1, budget=1)),
    ("dynamic:32", TreeSpec("dynamic", budget=32)),
    ("dynamic:32:8x6", TreeSpec("dynamic", width=8, depth=6, budget=32)),
])
def test_spec_parser(text, spec):
    parsed = template_from_spec(text)
    assert parsed == spec
    assert template_from_spec(str(parsed)) == parsed
    if parsed.is_static:
        assert parsed.template().num_nodes == parsed.budget
    else:
        with pytest.raises(ValueError, match="no static template"):
            parsed.template()
    assert template_from_spec("chain:4").k == 4


@pytest.mark.parametrize("text", ["chain", "chain:x", "topk:2", "topk:2x", "tree:4", "", "chain:-1",
                                  "topk:2x3x4", "dynamic:8:4", "dynamic:8x4"])
def test_spec_parser_rejects_malformed(text):
    with pytest.raises(ValueError, match=r"allowed forms: 'chain:K', 'topk:WxD', 'dynamic:B' or 'dynamic:B:KxD'"):
        template_from_spec(text)


@pytest.mark.parametrize("text, field", [("chain:0", "chain length k"), ("chain:64", "chain length k"),
                                         ("dynamic:0", "budget"), ("dynamic:64", "budget"),
                                         ("topk:2x6", "at most 63"), ("topk:0x3", "width and depth"),
                                         ("dynamic:8:0x3", "width of a dynamic"),
                                         ("dynamic:8:17x2", "width of a dynamic"),
                                         ("dynamic:8:8x10", r"depth of a dynamic tree of width 8 must be in \[1, 8\]"),
                                         ("dynamic:40:8x4", r"budget of dynamic 8x4 must be in \[1, 32\]")])
def test_spec_parser_rejects_out_of_range(text, field):
    with pytest.raises(ValueError, match=field):
        template_from_spec(text)


def test_spec_validation():
    with pytest.raises(ValueError, match="kind"):
        TreeSpec("beam", width=2, depth=2)
    with pytest.raises(ValueError, match="budget"):
        TreeSpec("topk", width=2, depth=2, budget=5)
    with pytest.raises(ValueError, match="width of a chain"):
        TreeSpec("chain", width=2, depth=3)
    assert TreeSpec("chain", depth=3).budget == 3


def test_draw_tree(tmp_path):
    pytest.importorskip("matplotlib")
    tree = DraftTree.from_parents([11, 12, 13, 14], [-1, -1, 0, 2])
    out = draw_tree(tree, tmp_path / "tree.png", accepted=[0, 2], title="tree")
    assert out.exists() and out.stat().st_size > 0
    assert draw_tree(topk_template(2, 2), tmp_path / "t.png").stat().st_size > 0


@pytest.mark.parametrize("n", [0, 1, 2, 8, 63])
def test_shared_shape_trees_equal_validated_trees(n):
    """``DraftTree.chain`` and ``of_template`` (shared shape arrays, no validation) equal the validated
    ``from_parents`` tree in every array, host list, verify row and ``max_depth``."""
    tokens = [(7 * i + 3) % 50 for i in range(n)]
    parents = list(range(-1, n - 1))
    built = [DraftTree.chain(tokens)] + ([DraftTree.of_template(tokens, chain_template(n))] if n else [])
    want = DraftTree.from_parents(tokens, parents) if n else DraftTree.empty()
    for tree in built:
        assert type(tree.host) is HostView and tree.host == want.host
        assert tree.verify_rows() == want.verify_rows() and tree.max_depth == want.max_depth == n
        for name in ("tokens", "parents", "depth", "ancestor_mask"):
            assert torch.equal(getattr(tree, name), getattr(want, name)), name
    top = topk_template(2, 3)
    tree, want = DraftTree.of_template(list(range(14)), top), DraftTree.from_parents(list(range(14)), top.parents)
    assert tree.host == want.host and tree.max_depth == want.max_depth == 3


def test_chains_equal_chain_of_each_row():
    rows = [[4, 5, 6], [], [9], [1, 2, 3], list(range(63))]
    trees = DraftTree.chains(rows)
    assert [t.host for t in trees] == [DraftTree.chain(r).host for r in rows]
    assert [t.max_depth for t in trees] == [3, 0, 1, 3, 63] and trees[1] is DraftTree.empty()
    rows[0].append(7)  # a tree keeps its own copy of the tokens
    assert trees[0].host.tokens == [4, 5, 6]
    with pytest.raises(ValueError, match="at most 63 nodes"):
        DraftTree.chains([[1], list(range(64))])
