"""Dynamic-tree expansion on the device equals the host rule, node for node, with one read per level.

The reference below is the drafter's former host implementation, written out in Python: per frontier
node the DYNAMIC_CANDIDATES most probable tokens (equal probabilities: lower token id first), scored
by the parent's cumulative score times the probability; the best min(beam, budget left) by score
(stable: frontier position, then rank) become the level, ordered by (parent, -score).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.acceptance import shape_probs
from specdec.drafters.frontier import top_candidates
from specdec.drafters.model_drafter import DYNAMIC_CANDIDATES, ModelDrafter, _Growth
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.tree import TreeSpec

pytestmark = pytest.mark.usefixtures("single_thread")

SHAPES = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
          SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, top_k=5, top_p=0.8)]


def host_rule(g: _Growth, beam: int, max_nodes: int) -> list[int]:
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
    return [g.add(t, parent, s, -1) for s, parent, t in chosen]


def _drafter(budget: int) -> ModelDrafter:
    return ModelDrafter(None, SimpleNamespace(device=torch.device("cpu")), TreeSpec("dynamic", budget=budget))


def _row(params: SamplingParams, prefilled: int) -> _Growth:
    g = _Growth(SimpleNamespace(params=params), L=10)
    for t in range(prefilled):  # nodes from elsewhere: a smaller budget left
        g.add(t, -1, 1.0, -1)
    return g


def _logits(gen: torch.Generator, n: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "tied":  # few distinct values: equal probabilities within and across nodes
        return torch.randint(0, 3, (1, vocab), generator=gen).float().expand(n, vocab).clone()  # (n, V)
    scale = 40.0 if kind == "peaked" else 3.0  # peaked: many probabilities underflow to 0
    return torch.randn(n, vocab, generator=gen) * scale  # (n, V)


def _grow_both(budget: int, vocab: int, kind: str, rows: int, seed: int) -> list[tuple[_Growth, _Growth]]:
    """Grow the same rows with the drafter's device rule and with host_rule, checking every level."""
    gen = torch.Generator().manual_seed(seed)
    drafter = _drafter(budget)
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
            assert (g.tokens, g.parents, g.score, g.dist_index) == (ref.tokens, ref.parents, ref.score,
                                                                    ref.dist_index)
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


@pytest.mark.parametrize("rows", [1, 5, 24])
def test_one_device_read_per_dynamic_level(rows, count_reads):
    gen = torch.Generator().manual_seed(rows)
    drafter = _drafter(63)
    grows = [_row(SHAPES[r % len(SHAPES)], 0) for r in range(rows)]
    for g in grows:
        g.frontier = [(-1, torch.randn(128, generator=gen))]
    sizes = set()
    for level in range(drafter._max_depth):
        room = any(len(g.tokens) < drafter.max_nodes for g in grows)
        del count_reads[:]
        new = drafter._expand_dynamic(grows)
        assert count_reads == (["tolist"] if room else []), f"level {level}"
        sizes.update(len(n) for n in new)
        for g, nodes in zip(grows, new):
            g.frontier = [(i, torch.randn(128, generator=gen)) for i in nodes]
    assert max(sizes) == drafter._beam  # frontiers of up to beam nodes were expanded


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
        refs = [_Growth(g.req, g.L, list(g.tokens), list(g.parents), list(g.masks), list(g.depth),
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
