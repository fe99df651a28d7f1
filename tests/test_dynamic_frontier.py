"""Tree expansion batched over rows equals the former per-row host rules, with one read per level.

Dynamic trees: the reference is the drafter's former host implementation, written out in Python: per
frontier node the DYNAMIC_CANDIDATES most probable tokens (equal probabilities: lower token id first),
scored by the parent's cumulative score times the probability; the best min(beam, budget left) by
score (stable: frontier position, then rank) become the level, ordered by (parent, -score).
Static trees: the reference expands one frontier node at a time (greedy: top tokens; sampled: the top
children of log q + G, G the request's Gumbel noise at the child's position, as the target's sampled rule uses).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specdec.kernels.gumbel_noise import gumbel_noise

from specdec.acceptance import shape_probs
from specdec.drafters.frontier import FrontierLayout, pick_children, top_candidates
from specdec.drafters.model_drafter import DYNAMIC_CANDIDATES, Growth, ModelDrafter
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.tree_spec import TreeSpec, template_from_spec
from specdec.uniform_stream import UniformStream

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPES = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, top_k=5, top_p=0.8)]


def host_rule(g: Growth, beam: int, max_nodes: int) -> list[int]:
    """The former host implementation of one dynamic level (reference)."""
    budget = max_nodes - len(g.tokens)
    if budget <= 0 or not g.frontier:
        return []
    p = g.req.params
    cands = []  # (score, parent, token)
    for parent, lg in g.frontier:
        q = torch.softmax(lg.float(), -1) if p.greedy else shape_probs(lg, p.temperature, p.top_k, p.top_p)
        q = q.tolist()
        top = sorted(range(len(q)), key=lambda t: (-q[t], t))[:DYNAMIC_CANDIDATES]
        base = g.score[parent] if parent >= 0 else 1.0
        cands += [(base * q[t], parent, t) for t in top if q[t] > 0]
    cands.sort(key=lambda c: -c[0])
    chosen = sorted(cands[:min(beam, budget)], key=lambda c: (c[1], -c[0]))
    return [g.add(t, parent, s) for s, parent, t in chosen]


def per_node_rule(g: Growth, child_count: dict[int, int]) -> list[int]:
    """One static level node by node (reference): a greedy row's most probable tokens (lower id first on ties),
    a sampled row's top children of log q + G, G the Gumbel noise of the request's key at the child's position."""
    p, new = g.req.params, []
    for parent, lg in g.frontier:
        want = child_count.get(parent, 0)
        if not want:
            continue
        if p.greedy:
            q = torch.softmax(lg.float(), -1).tolist()
            toks = sorted(range(len(q)), key=lambda t: (-q[t], t))[:want]
        else:
            q = shape_probs(lg, p.temperature, p.top_k, p.top_p)
            s = g.req.stream
            pos = g.L + (g.depth[parent] + 1 if parent >= 0 else 0)
            noise = gumbel_noise(torch.tensor(s.key0), torch.tensor(s.key1), torch.tensor(pos),
                                 torch.arange(q.shape[-1]))
            toks = (q.double().log() + noise).topk(want).indices.tolist()
        new += [g.add(t, parent, 0.0) for t in toks]
    return new


def _drafter(spec: TreeSpec) -> ModelDrafter:
    return ModelDrafter(None, SimpleNamespace(device=torch.device("cpu")), spec)


def _row(params: SamplingParams, prefilled: int, seed: int = 0) -> Growth:
    g = Growth(SimpleNamespace(params=params, stream=UniformStream(seed)), L=10)
    for t in range(prefilled):  # nodes from elsewhere: a smaller budget left
        g.add(t, -1, 1.0)
    return g


def _logits(gen: torch.Generator, n: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "tied":  # few distinct values: equal probabilities within and across nodes
        return torch.randint(0, 3, (1, vocab), generator=gen).float().expand(n, vocab).clone()  # (n, V)
    scale = 40.0 if kind == "peaked" else 3.0  # peaked: many probabilities underflow to 0
    return torch.randn(n, vocab, generator=gen) * scale  # (n, V)


def _grow_both(budget: int, vocab: int, kind: str, rows: int, seed: int) -> list[tuple[Growth, Growth]]:
    """Grow the same rows with the drafter's device rule and with host_rule, checking every level."""
    gen = torch.Generator().manual_seed(seed)
    drafter = _drafter(TreeSpec("dynamic", budget=budget))
    pairs = []
    for r in range(rows):
        params, prefilled = SHAPES[r % len(SHAPES)], int(torch.randint(0, budget, (1,), generator=gen))
        pairs.append((_row(params, prefilled), _row(params, prefilled)))
    for g, ref in pairs:
        g.frontier = ref.frontier = [(-1, _logits(gen, 1, vocab, kind)[0])]
    for _ in range(drafter._max_depth):
        new = drafter._expand_dynamic([g for g, _ in pairs])
        for (g, ref), nodes in zip(pairs, new, strict=True):
            assert nodes == host_rule(ref, drafter._beam, budget)
            assert (g.tokens, g.parents, g.score) == (ref.tokens, ref.parents, ref.score)
            lg = _logits(gen, len(nodes), vocab, kind)
            g.frontier = ref.frontier = [(i, lg[j]) for j, i in enumerate(nodes)]
    return pairs


@pytest.mark.parametrize("kind", ["random", "peaked", "tied"])
@pytest.mark.parametrize("budget,vocab", [(5, 6), (16, 64), (40, 64), (63, 48)])
def test_dynamic_levels_equal_host_rule(budget, vocab, kind):
    pairs = _grow_both(budget, vocab, kind, rows=7, seed=budget * 31 + vocab)
    assert all(len(g.tokens) <= budget for g, _ in pairs)
    assert any(len(set(g.depth)) > 1 for g, _ in pairs)  # trees really grew past the first level


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_candidates_break_ties_by_token_id(dtype):
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randint(0, 4, (6, 40), generator=gen).to(dtype), -1)  # (6, 40) many ties
    probs[2] = 0.0
    probs[2, 7] = 1.0  # one non-zero entry: then zeros by token id
    tokens, values = top_candidates(probs, 9)
    for row, toks, vals in zip(probs.tolist(), tokens.tolist(), values.tolist()):
        assert toks == sorted(range(40), key=lambda t: (-row[t], t))[:9]
        assert vals == [row[t] for t in toks]
    with pytest.raises(ValueError, match=r"k must be in \[1, 40\]"):
        top_candidates(probs, 41)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_pick_children_follows_the_tie_rule(device):
    """Rows of tied candidates (equal bases, integer logits): the chosen children are those of the
    stated rule, computed here in Python, on the CPU and on the GPU alike."""
    gen = torch.Generator().manual_seed(2)
    counts, takes, c, beam = [1, 5, 3, 4, 2], [7, 7, 2, 0, 5], 4, 7
    probs = torch.softmax(torch.randint(0, 3, (sum(counts), 12), generator=gen).float(), -1)  # (F, 12)
    probs[0, 5:] = 0.0  # zero-probability candidates are never chosen
    base = torch.tensor([0.5, 0.25], dtype=torch.float64)[torch.randint(0, 2, (sum(counts),), generator=gen)]
    f_max = max(counts)
    slots = [r * f_max + j for r, n in enumerate(counts) for j in range(n)]
    layout = FrontierLayout(torch.tensor(slots, device=device), torch.tensor(takes, device=device),
                            len(counts), f_max)
    tokens, cand = top_candidates(probs.to(device), c)
    got = pick_children(tokens, cand, base.to(device), layout, beam).cpu().tolist()
    node = 0
    for r, n in enumerate(counts):
        cands = []  # (score, position, rank, token)
        for pos in range(n):
            q, b = probs[node].tolist(), base[node].item()
            top = sorted(range(12), key=lambda t: (-q[t], t))[:c]
            cands += [(b * q[t], pos, rank, t) for rank, t in enumerate(top) if q[t] > 0]
            node += 1
        best = sorted(sorted(cands, key=lambda x: (-x[0], x[1], x[2]))[:takes[r]], key=lambda x: (x[1], x[2]))
        want = [[float(pos), float(t), s] for s, pos, _, t in best]
        assert got[r] == want + [[-1.0, 0.0, float("-inf")]] * (beam - len(want)), f"row {r}"


@pytest.fixture
def count_reads(monkeypatch):
    """A list that records every device->host read (tolist, item, bool/int/float of a tensor)."""
    reads = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, _name=name, **kw):
            reads.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return reads


@pytest.mark.parametrize("tree", ["chain:4", "topk:3x3"])
def test_static_levels_equal_per_node_rule(tree):
    """Sampled rows draw all their nodes' children at once with the request's noise at each child's position: the
    trees equal the node-by-node reference exactly."""
    spec = template_from_spec(tree)
    drafter, gen = _drafter(spec), torch.Generator().manual_seed(5)
    pairs = [(_row(SHAPES[r % len(SHAPES)], 0, seed=r), _row(SHAPES[r % len(SHAPES)], 0, seed=r)) for r in range(7)]
    for g, ref in pairs:
        g.frontier = ref.frontier = [(-1, torch.randn(64, generator=gen) * 2)]
    for _ in range(drafter._max_depth):
        new = drafter._expand_level([g for g, _ in pairs])
        for (g, ref), nodes in zip(pairs, new, strict=True):
            assert nodes == per_node_rule(ref, drafter._child_count)
            assert (g.tokens, g.parents) == (ref.tokens, ref.parents)
            lg = torch.randn(len(nodes), 64, generator=gen) * 2
            g.frontier = ref.frontier = [(i, lg[j]) for j, i in enumerate(nodes)]
    assert all(len(g.tokens) == spec.budget for g, _ in pairs)


@pytest.mark.parametrize("tree", ["dynamic:63", "topk:3x3", "chain:4"])
@pytest.mark.parametrize("rows", [1, 5, 24])
def test_one_device_read_per_level(tree, rows, count_reads):
    gen = torch.Generator().manual_seed(rows)
    drafter = _drafter(template_from_spec(tree))
    grows = [_row(SHAPES[r % len(SHAPES)], 0, seed=r) for r in range(rows)]
    for g in grows:
        g.frontier = [(-1, torch.randn(128, generator=gen))]
    for level in range(drafter._max_depth):
        room = any(len(g.tokens) < drafter.max_nodes for g in grows)
        del count_reads[:]
        new = drafter._expand_level(grows)
        assert count_reads == (["tolist"] if room else []), f"level {level}"
        for g, nodes in zip(grows, new):
            g.frontier = [(i, torch.randn(128, generator=gen)) for i in nodes]
    assert all(len(g.tokens) == drafter.max_nodes for g in grows)  # every level really expanded


def test_engine_dynamic_trees_equal_host_rule(tiny_target, tiny_draft):
    """In an engine run with greedy and sampled rows in one batch, every level the drafter adds equals
    host_rule on the same state, and the greedy rows' outputs equal target-only decoding."""
    prompts = [[5, 9, 33, 70, 12], list(range(40, 61)), [200, 3, 3, 17], list(range(90, 98)), [7] * 9]
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_new_tokens=14, ignore_eos=True),
              SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=12, seed=4, max_new_tokens=14, ignore_eos=True),
              SamplingParams(max_new_tokens=14, ignore_eos=True)]
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="dynamic:16", num_blocks=256, block_size=8))
    drafter, levels = eng.drafter, []
    device_rule = drafter._expand_dynamic

    def checked(grows):
        refs = [Growth(g.req, g.L, list(g.tokens), list(g.parents), list(g.masks), list(g.depth),
                        list(g.score), frontier=list(g.frontier)) for g in grows]
        new = device_rule(grows)
        for g, ref, nodes in zip(grows, refs, new, strict=True):
            assert nodes == host_rule(ref, drafter._beam, drafter.max_nodes)
            assert (g.tokens, g.parents, g.score) == (ref.tokens, ref.parents, ref.score)
        levels.append(len(grows))
        return new

    drafter._expand_dynamic = checked
    outs = eng.generate(prompts, params)
    ref_eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=8))
    greedy = [i for i, p in enumerate(params) if p.greedy]
    expect = ref_eng.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [outs[i].token_ids for i in greedy] == [o.token_ids for o in expect]
    assert max(levels) == len(prompts) and len(levels) > 10
    assert eng.stats.accepted > 0 and eng.all_blocks_free()
