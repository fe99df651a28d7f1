"""Draft-model drafter: chains, static top-k trees and dynamic trees, grown level by level.

The draft writes each tree node's KV once, at the node's slot (position L + i, the same slot
the target uses), and every deeper level reads it through the tree mask.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from specdec.acceptance import shape_probs
from specdec.drafters.base import Drafter, Proposal
from specdec.runner import ModelRunner, RowInput
from specdec.scheduler.request import Request
from specdec.tree import DraftTree, TreeSpec

DRAFT_MODEL_INDEX = 1  # the draft's layers are pool model 1
DYNAMIC_BEAM_MAX = 8  # most nodes added per level of a dynamic tree
DYNAMIC_CANDIDATES = 8  # children considered per expanded node
DYNAMIC_MAX_DEPTH = 10


@dataclass
class _Growth:
    """A row's tree while it grows: level-ordered nodes and the frontier's draft logits."""

    req: Request
    L: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # cumulative draft probability (dynamic)
    dist_rows: list[torch.Tensor] = field(default_factory=list)
    dist_index: list[int] = field(default_factory=list)
    frontier: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (node or -1, logits (V,))
    computed: set[int] = field(default_factory=set)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1: root) -> draft state (EAGLE)

    def add(self, token: int, parent: int, score: float, dist_row: int) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.masks.append((1 << i) | (self.masks[parent] if parent >= 0 else 0))
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 0)
        self.score.append(score)
        self.dist_index.append(dist_row)
        return i


class ModelDrafter(Drafter):
    """Proposes trees of shape ``spec`` with a draft model sharing the target's KV pool."""

    uses_kv = True

    def __init__(self, model, runner: ModelRunner, spec: TreeSpec) -> None:
        self.model, self.runner, self.spec = model, runner, spec
        self.max_nodes = spec.budget
        self._template = spec.template() if spec.is_static else None
        self._child_count = Counter(self._template.parents) if self._template is not None else {}
        self._max_depth = spec.depth if spec.is_static else min(DYNAMIC_MAX_DEPTH, spec.budget)

    def prefill(self, chunks, features=None) -> None:
        rows = [RowInput(c.req, c.req.tokens[c.start:c.end], list(range(c.start, c.end)), c.start, c.end,
                         want_logits="none") for c in chunks]
        if rows:
            self.runner.run(DRAFT_MODEL_INDEX, self.model, rows)
        for c in chunks:
            c.req.num_computed_draft = c.end

    def propose(self, rows: list[Request]) -> Proposal:
        if not rows:
            return Proposal([], [])
        grows = [_Growth(r, len(r.tokens)) for r in rows]
        self._catch_up(grows)
        for level in range(self._max_depth):
            greedy_top = self._greedy_topk(grows)
            new = [self._expand(g, greedy_top.get(i, {})) for i, g in enumerate(grows)]
            if level + 1 == self._max_depth:
                break
            live = [(g, n) for g, n in zip(grows, new) if n and len(g.tokens) < self.node_budget]
            if not live:
                break
            self._forward_level(live)
        return Proposal([self._tree(g) for g in grows], [frozenset(g.computed) for g in grows])

    def _catch_up(self, grows: list[_Growth]) -> None:
        """Draft KV up to each row's last token; the root's draft logits become the frontier."""
        rows = [g.req for g in grows]
        catch_up = [RowInput(r, r.tokens[r.num_computed_draft:], list(range(r.num_computed_draft, len(r.tokens))),
                             r.num_computed_draft, len(r.tokens)) for r in rows]
        for g, lg in zip(grows, self.runner.run(DRAFT_MODEL_INDEX, self.model, catch_up)):
            g.req.num_computed_draft = g.L
            g.frontier = [(-1, lg)]

    def _forward_level(self, live: list[tuple[_Growth, list[int]]]) -> None:
        inputs = [RowInput(g.req, [g.tokens[i] for i in nodes], [g.L + g.depth[i] for i in nodes], g.L,
                           g.L + len(g.tokens), [g.masks[i] for i in nodes], want_logits="all")
                  for g, nodes in live]
        for (g, nodes), lg in zip(live, self.runner.run(DRAFT_MODEL_INDEX, self.model, inputs)):
            g.frontier = [(i, lg[j]) for j, i in enumerate(nodes)]
            g.computed.update(nodes)

    def _children_wanted(self, g: _Growth, parent: int) -> int:
        if self.node_budget - len(g.tokens) <= 0:
            return 0
        if self._template is None:
            return DYNAMIC_CANDIDATES
        return self._child_count.get(parent, 0)

    def _greedy_topk(self, grows: list[_Growth]) -> dict[int, dict[int, tuple[list[int], list[float]]]]:
        """Top draft tokens (and their draft probabilities) of every greedy row's frontier nodes, with one
        top-k over the stacked frontier logits and one device->host read for the whole batch:
        {row: {frontier position: (tokens, probabilities)}}."""
        where, logits, ks = [], [], []
        for gi, g in enumerate(grows):
            if not g.req.params.greedy:
                continue
            for fi, (parent, lg) in enumerate(g.frontier):
                k = self._children_wanted(g, parent)
                if k:
                    where.append((gi, fi))
                    logits.append(lg)
                    ks.append(k)
        if not logits:
            return {}
        kmax = max(ks)
        probs = torch.softmax(torch.stack(logits).float(), dim=-1)  # (F, V)
        top = probs.topk(min(kmax, probs.shape[-1]))
        host = torch.cat([top.indices.double(), top.values.double()], dim=1).tolist()  # (F, 2k): one read
        out: dict[int, dict[int, tuple[list[int], list[float]]]] = {}
        for (gi, fi), k, h in zip(where, ks, host):
            out.setdefault(gi, {})[fi] = ([int(t) for t in h[:k]], h[kmax:kmax + k])
        return out

    def _expand(self, g: _Growth, greedy_top: dict[int, tuple[list[int], list[float]]]) -> list[int]:
        """Add the next level's children of the frontier; return the new node indices. ``greedy_top``
        holds a greedy row's precomputed top tokens per frontier position."""
        p = g.req.params
        budget = self.node_budget - len(g.tokens)
        if budget <= 0 or not g.frontier:
            return []
        if self._template is None:
            return self._expand_dynamic(g, budget, greedy_top)
        new = []
        for fi, (parent, lg) in enumerate(g.frontier):
            want = self._child_count.get(parent, 0)
            if want == 0:
                continue
            if p.greedy:
                toks, row = greedy_top[fi][0], -1
            else:
                q = shape_probs(lg, p.temperature, p.top_k, p.top_p)
                row = len(g.dist_rows)
                g.dist_rows.append(q)
                toks = _sample_children(q, want, self.spec.kind == "chain", g.req.generator)
            new += [g.add(t, parent, 0.0, row) for t in toks]
        return new

    def _expand_dynamic(self, g: _Growth, budget: int, greedy_top) -> list[int]:
        p = g.req.params
        if p.greedy:
            cands = []  # (score, parent, token)
            for fi, (parent, _) in enumerate(g.frontier):
                toks, probs = greedy_top[fi]
                base = g.score[parent] if parent >= 0 else 1.0
                cands += [(base * pr, parent, t) for pr, t in zip(probs, toks) if pr > 0]
        else:
            parents = [parent for parent, _ in g.frontier]
            lg = torch.stack([logits for _, logits in g.frontier])  # (F, V)
            top = shape_probs(lg, p.temperature, p.top_k, p.top_p).topk(min(DYNAMIC_CANDIDATES, lg.shape[-1]))
            base = [g.score[parent] if parent >= 0 else 1.0 for parent in parents]
            cands = [(b * pr, parent, t) for parent, b, prs, ts in zip(parents, base, top.values.tolist(),
                                                                       top.indices.tolist())
                     for pr, t in zip(prs, ts) if pr > 0]  # (score, parent, token)
        cands.sort(key=lambda c: -c[0])
        beam = max(1, min(DYNAMIC_BEAM_MAX, self.max_nodes // 6))
        chosen = sorted(cands[:min(beam, budget)], key=lambda c: (c[1], -c[0]))
        return [g.add(t, parent, s, -1) for s, parent, t in chosen]

    def _tree(self, g: _Growth) -> DraftTree:
        dev = self.runner.device
        if not g.tokens:
            return DraftTree.empty(dev)
        sampled = bool(g.dist_rows)
        mode = "deterministic"
        if sampled:
            mode = "iid" if self.spec.kind == "chain" else "without_replacement"
        return DraftTree.from_parents(
            g.tokens, g.parents, torch.stack(g.dist_rows) if sampled else None,
            g.dist_index if sampled else None, mode, device=dev)


def _sample_children(q: torch.Tensor, k: int, iid: bool, gen: torch.Generator) -> list[int]:
    """k tokens from q: i.i.d. draws, or without replacement (Gumbel top-k)."""
    if iid:
        return torch.multinomial(q, k, replacement=True, generator=gen).tolist()
    u = torch.rand(q.shape, generator=gen, device=q.device, dtype=torch.float64).clamp_min(1e-300)
    keys = q.double().log() - (-u.log()).log()
    return keys.topk(k).indices.tolist()
