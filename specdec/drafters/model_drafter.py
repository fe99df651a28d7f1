"""Draft-model drafter: chains, static top-k trees and dynamic trees, grown level by level.

The draft writes each tree node's KV once, at the node's slot (position L + i, the same slot
the target uses), and every deeper level reads it through the tree mask.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import groupby

import torch

from specdec.acceptance import shape_probs
from specdec.drafters.base import Drafter, Proposal
from specdec.drafters.frontier import FrontierLayout, Shape, pick_children, shaped_probs, top_candidates
from specdec.fault_isolation import distribution_fault
from specdec.kernels.gumbel_noise import gumbel_noise
from specdec.runner import ModelRunner, RowInput
from specdec.scheduler.request import Request
from specdec.step_inputs import DRAFT_MODEL_INDEX
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec

DYNAMIC_BEAM_MAX = 8  # most nodes added per level of a dynamic tree
DYNAMIC_CANDIDATES = 8  # children considered per expanded node
DYNAMIC_MAX_DEPTH = 10


@dataclass
class Growth:
    """A row's tree while it grows: level-ordered nodes and the frontier's draft logits."""

    req: Request
    L: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # cumulative draft probability (dynamic)
    frontier: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (node or -1, logits (V,))
    computed: set[int] = field(default_factory=set)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1: root) -> draft state (EAGLE)
    front_score: torch.Tensor | None = None  # (len(frontier),) float64 scores of the frontier nodes; None: root

    def add(self, token: int, parent: int, score: float) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.masks.append((1 << i) | (self.masks[parent] if parent >= 0 else 0))
        self.depth.append(self.depth[parent] + 1 if parent >= 0 else 0)
        self.score.append(score)
        return i


class ModelDrafter(Drafter):
    """Proposes trees of shape ``spec`` with a draft model sharing the target's KV pool."""

    uses_kv = True

    def __init__(self, model, runner: ModelRunner, spec: TreeSpec) -> None:
        self.model, self.runner, self.spec = model, runner, spec
        self.max_nodes = spec.budget
        self._template = spec.template() if spec.is_static else None
        self._child_count = Counter(self._template.parents) if self._template is not None else {}
        self._max_depth = spec.depth or min(DYNAMIC_MAX_DEPTH, spec.budget)  # dynamic: the spec's levels or all
        self._beam = max(1, min(DYNAMIC_BEAM_MAX, spec.budget // 6))  # dynamic: children per level
        if not spec.is_static and spec.width:  # dynamic:B:KxD: levels of K nodes
            self._beam = spec.width

    def prefill(self, chunks) -> None:
        rows = [RowInput(c.req, c.req.tokens[c.start:c.end], list(range(c.start, c.end)), c.start, c.end,
                         want_logits="none") for c in chunks]
        if rows:
            self.runner.run(DRAFT_MODEL_INDEX, self.model, rows)
        for c in chunks:
            c.req.num_computed_draft = c.end

    def propose(self, rows: list[Request]) -> Proposal:
        if not rows:
            return Proposal([], [])
        grows = [Growth(r, len(r.tokens)) for r in rows]
        self._catch_up(grows)
        for level in range(self._max_depth):
            new = self._expand_level(grows)
            if level + 1 == self._max_depth:
                break
            live = [(g, n) for g, n in zip(grows, new) if n and len(g.tokens) < self.node_budget]
            if not live:
                break
            self._forward_level(live)
        return Proposal([self._tree(g) for g in grows], [frozenset(g.computed) for g in grows])

    def _catch_up(self, grows: list[Growth]) -> None:
        """Draft KV up to each row's last token; the root's draft logits become the frontier."""
        rows = [g.req for g in grows]
        catch_up = [RowInput(r, r.tokens[r.num_computed_draft:], list(range(r.num_computed_draft, len(r.tokens))),
                             r.num_computed_draft, len(r.tokens)) for r in rows]
        for g, lg in zip(grows, self.runner.run(DRAFT_MODEL_INDEX, self.model, catch_up)):
            g.req.num_computed_draft = g.L
            g.frontier = [(-1, lg)]

    def _forward_level(self, live: list[tuple[Growth, list[int]]]) -> None:
        inputs = [RowInput(g.req, [g.tokens[i] for i in nodes], [g.L + g.depth[i] for i in nodes], g.L,
                           g.L + len(g.tokens), [g.masks[i] for i in nodes], want_logits="all")
                  for g, nodes in live]
        for (g, nodes), lg in zip(live, self.runner.run(DRAFT_MODEL_INDEX, self.model, inputs)):
            g.frontier = [(i, lg[j]) for j, i in enumerate(nodes)]
            g.computed.update(nodes)

    def _expand_level(self, grows: list[Growth]) -> list[list[int]]:
        """Add every row's next level; return each row's new node indices."""
        return (self._expand_dynamic if self._template is None else self._expand_static)(grows)

    def _expand_static(self, grows: list[Growth]) -> list[list[int]]:
        """Add the template's children of every frontier node: a greedy row's most probable draft
        tokens (equal probabilities: lower id first), a sampled row's draws from its shaped draft
        distribution coupled with the target's sampling at each position (``_coupled_children``). One device->host
        read."""
        new: list[list[int]] = [[] for _ in grows]
        todo = [(gi, nodes) for gi, g in enumerate(grows) if (nodes := self._static_nodes(g))]
        if not todo:
            return new
        vocab = todo[0][1][0][1].shape[-1]  # the first node's logits (V,)
        k = min(max(self._child_count[parent] for _, nodes in todo for parent, _ in nodes), vocab)  # per node
        greedy, sampled = [], []  # (row, parent) per expanded node, in token-row order
        greedy_logits, tokens = [], []
        for gi, nodes in todo:
            g, p = grows[gi], grows[gi].req.params
            if p.greedy:
                greedy += [(gi, parent) for parent, _ in nodes]
                greedy_logits += [lg for _, lg in nodes]
                continue
            q = shape_probs(torch.stack([lg for _, lg in nodes]), p.temperature, p.top_k, p.top_p, p.min_p)  # (n, V)
            finite = torch.isfinite(q).all(-1, keepdim=True)  # (n, 1): a NaN q is not sampled, its row fails
            sampled += [(gi, parent) for parent, _ in nodes]
            positions = [g.L + (g.depth[parent] + 1 if parent >= 0 else 0) for parent, _ in nodes]
            children = _coupled_children(torch.where(finite, q, 1.0), k, g.req.stream, positions)
            tokens.append(torch.where(finite, children, -1))  # (n, k)
        if greedy_logits:
            probs = torch.softmax(torch.stack(greedy_logits).float(), dim=-1)  # (Fg, V)
            tokens.insert(0, top_candidates(probs, k)[0])  # (Fg, k)
        host = torch.cat(tokens).tolist()  # (F, k): the level's one device->host read
        bad = {grows[gi].req: None for (gi, _), toks in zip(greedy + sampled, host) if toks[0] < 0}
        if bad:
            raise distribution_fault(list(bad), "draft")
        for (gi, parent), toks in zip(greedy + sampled, host, strict=True):
            new[gi] += [grows[gi].add(t, parent, 0.0) for t in toks[:self._child_count[parent]]]
        return new

    def _static_nodes(self, g: Growth) -> list[tuple[int, torch.Tensor]]:
        """g's frontier nodes (node, logits) that get children this level."""
        if len(g.tokens) >= self.node_budget:
            return []
        return [(parent, lg) for parent, lg in g.frontier if self._child_count.get(parent, 0)]

    def _expand_dynamic(self, grows: list[Growth]) -> list[list[int]]:
        """Add each row's next dynamic-tree level: its best min(beam, budget left) candidates over
        (frontier nodes x DYNAMIC_CANDIDATES) by cumulative draft probability (``frontier`` says the
        order and the tie rule). All rows are selected on the device and read with one copy."""
        todo = [i for i, g in enumerate(grows) if g.frontier and len(g.tokens) < self.node_budget]
        new: list[list[int]] = [[] for _ in grows]
        if not todo:
            return new
        todo.sort(key=lambda i: _shape_key(grows[i]))  # rows of one sampling shape are consecutive
        groups = [(shape, sum(len(grows[i].frontier) for i in run))
                  for shape, run in groupby(todo, key=lambda i: _shape(grows[i]))]
        fronts = [grows[i].frontier for i in todo]
        logits = torch.stack([lg for front in fronts for _, lg in front])  # (F, V)
        dev = logits.device
        one = torch.ones(1, dtype=torch.float64, device=dev)
        base = torch.cat([one if grows[i].front_score is None else grows[i].front_score for i in todo])  # (F,)
        f_max = max(len(front) for front in fronts)
        slots = [r * f_max + j for r, front in enumerate(fronts) for j in range(len(front))]
        takes = [min(self._beam, self.node_budget - len(grows[i].tokens)) for i in todo]
        meta = torch.tensor(slots + takes, dtype=torch.int64).to(dev, non_blocking=True)
        layout = FrontierLayout(meta[:len(slots)], meta[len(slots):], len(todo), f_max)
        probs = shaped_probs(logits, groups)  # (F, V)
        cand_tokens, cand_probs = top_candidates(probs, min(DYNAMIC_CANDIDATES, probs.shape[-1]))  # (F, C)
        picked = pick_children(cand_tokens, cand_probs, base, layout, self._beam)  # (R, w, 3)
        for r, (i, rows) in enumerate(zip(todo, picked.tolist())):  # the level's one device->host read
            g = grows[i]
            chosen = [(int(pos), int(tok), score) for pos, tok, score in rows if pos >= 0]
            new[i] = [g.add(tok, g.frontier[pos][0], score) for pos, tok, score in chosen]
            g.front_score = picked[r, :len(chosen), 2]
        return new

    def _tree(self, g: Growth) -> DraftTree:
        dev = self.runner.device
        if not g.tokens:
            return DraftTree.empty(dev)
        return DraftTree.from_parents(g.tokens, g.parents, device=dev)


def _shape(g: Growth) -> Shape:
    p = g.req.params
    return None if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)


def _shape_key(g: Growth) -> tuple:
    shape = _shape(g)
    return (0,) if shape is None else (1, *shape)


def _coupled_children(q: torch.Tensor, k: int, stream, positions: list[int]) -> torch.Tensor:
    """(n, k) children of n nodes from their shaped draft distributions q (n, V): the top k of log q + G, G the
    Gumbel noise the target's sampled rule uses at each child's sequence position (``positions``, n) for the
    request (``stream``'s key). The first child is then a sample of q coupled with the target's own sample at
    that position (the two agree as often as q is close to the target's distribution), the others the next draws
    of q without replacement; verification accepts a child when it equals the target's sample, whatever q."""
    dev = q.device
    key = torch.tensor([stream.key0, stream.key1], dtype=torch.int64, device=dev)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    noise = gumbel_noise(key[0], key[1], pos, torch.arange(q.shape[-1], device=dev))  # (n, V)
    return (q.double().log() + noise).topk(k, dim=-1).indices
