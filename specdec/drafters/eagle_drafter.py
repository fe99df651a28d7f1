"""EAGLE-style drafting: the draft reads the target's hidden states of the accepted tokens.

Position p of the draft needs the target features of position p - 1. The verify forward returns
them for the pending token and the accepted path; prefill returns them for the prompt. A request's
features wait in this drafter (keyed weakly by the request) until the next catch-up consumes them.
Tree nodes get their parent's draft hidden state instead (the root: the last catch-up position).
Tree-node KV is written with those self-features, so it is never adopted: after acceptance the
catch-up recomputes the accepted tokens with the target's features (``draft_computed`` is empty).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdec.adaptive import template_tree
from specdec.drafters.base import Proposal
from specdec.drafters.model_drafter import DRAFT_MODEL_INDEX, ModelDrafter, _Growth
from specdec.runner import RowInput
from specdec.scheduler.request import Request
from specdec.training.eagle import EagleDraft
from specdec.tree import DraftTree, TreeSpec


@dataclass
class _Features:
    """Target features of positions [start, start + len(rows)) of one request."""

    start: int
    rows: torch.Tensor  # (n, k * hidden)

    def put(self, start: int, rows: torch.Tensor) -> None:
        if start == self.start + len(self.rows) and len(self.rows):
            self.rows = torch.cat([self.rows, rows])
        else:
            self.start, self.rows = start, rows

    def before(self, begin: int, end: int) -> torch.Tensor:
        """Features of positions [begin - 1, end - 1) (the inputs of draft positions [begin, end));
        zeros where none is known (a prefix-cache hit or a preempted request's restart)."""
        if self.start == begin - 1 and len(self.rows) >= end - begin:  # the usual case: all known, no copy
            return self.rows[:end - begin]
        out = self.rows.new_zeros(end - begin, self.rows.shape[1])  # (end - begin, k * hidden)
        lo, hi = max(begin - 1, self.start), min(end - 1, self.start + len(self.rows))
        if lo < hi:
            out[lo - begin + 1:hi - begin + 1] = self.rows[lo - self.start:hi - self.start]
        return out

    def drop_before(self, pos: int) -> None:
        cut = min(max(0, pos - self.start), len(self.rows))
        self.start, self.rows = self.start + cut, self.rows[cut:]


class EagleDrafter(ModelDrafter):
    """Chains, static top-k trees and dynamic trees from an ``EagleDraft`` sharing the pool."""

    def __init__(self, model: EagleDraft, runner, spec: TreeSpec, vocab_size: int) -> None:
        super().__init__(model, runner, spec)
        self.vocab_size = vocab_size
        self.target_features = model.aux_layers
        self._feats: weakref.WeakKeyDictionary[Request, _Features] = weakref.WeakKeyDictionary()
        self.device_loop = None  # a DeviceTreeLoop or DeviceDynamicTree once the graph path is on

    @property
    def lookahead(self) -> int:
        """The device dynamic tree writes the draft KV of width * (depth - 1) nodes, possibly more than it keeps."""
        shape = getattr(self.device_loop, "shape", None)
        return self.max_nodes if shape is None else max(self.max_nodes, shape.region)

    def enable_device_loop(self, graphs) -> None:
        """Draft greedy batches with one device program per batch bucket (captured with ``graphs``, the engine's
        GraphRunner): the static template's levels, or a dynamic tree of ``device_shape(spec)``."""
        from specdec.drafters.eagle_device import DeviceTreeLoop
        from specdec.drafters.eagle_dynamic import DeviceDynamicTree, device_shape
        from specdec.scheduler.cuda_graphs import QUERY_BUCKETS, bucket

        dev, pool, backend = self.runner.device, self.runner.pool, self.runner.backend
        if self._template is None:
            shape = device_shape(self.spec)
            catch_up = bucket(shape.depth + 1, QUERY_BUCKETS) or shape.depth + 1  # accepted path + bonus
            self.device_loop = DeviceDynamicTree(self.model, pool, backend, shape, graphs.batch_buckets, catch_up,
                                                 graphs.inputs.width, dev)
        else:
            catch_up = bucket(self.spec.depth + 1, QUERY_BUCKETS) or self.spec.depth + 1
            self.device_loop = DeviceTreeLoop(self.model, pool, backend, self._template, graphs.batch_buckets,
                                              catch_up, graphs.inputs.width, dev)
        graphs.programs.append(self.device_loop)

    def propose(self, rows: list[Request]) -> Proposal:
        loop = self.device_loop
        if loop is not None and rows and all(r.params.greedy for r in rows):
            spans = [(r.num_computed_draft, len(r.tokens)) for r in rows]
            sizes = [e - b for b, e in spans]
            b = loop.bucket(len(rows), max(sizes))
            if b is not None and min(sizes) > 0:
                return self._propose_on_device(rows, spans, b)
        return super().propose(rows)

    def _propose_on_device(self, reqs: list[Request], spans: list[tuple[int, int]], b: int) -> Proposal:
        loop, runner = self.device_loop, self.runner
        rows, aux = self._catch_up_inputs(reqs, spans)
        where = runner.padded_index(rows, loop.q)
        out = loop.run(b, *runner.padded_inputs(rows, loop.q), where, aux)[:len(reqs)].tolist()  # the one read
        self._caught_up(reqs, spans)
        n = self.node_budget
        if self._template is None:  # (rows, 3, N): tokens, parents, score ranks
            trees = [best_nodes(*row, n) for row in out]
        else:  # (rows, N) tokens
            trees = [template_tree(row, self._template, n) for row in out]
        return Proposal(trees, [frozenset()] * len(reqs))

    def _state(self, req: Request) -> _Features:
        if req not in self._feats:
            width = len(self.model.aux_layers) * self.model.config.hidden_size
            self._feats[req] = _Features(0, torch.zeros(0, width, dtype=self.model.fc.weight.dtype,
                                                         device=self.runner.device))
        return self._feats[req]

    def _hidden(self, rows: list[RowInput], g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft hidden states (T, hidden) of the packed rows with features ``g`` (T, hidden), and their
        draft-vocabulary logits (T, N) when the forward was graphed (else None: ``_logits`` computes them)."""
        return self.runner.run_with_features(DRAFT_MODEL_INDEX, self.model, rows, g)

    def _logits(self, hidden: torch.Tensor, draft_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Target-vocabulary logits (n, V) of draft states ``hidden`` (or of their draft logits, when known)."""
        with torch.inference_mode():
            if draft_logits is None:
                draft_logits = self.model.compute_logits(hidden)
            return self.model.full_logits(draft_logits, self.vocab_size)  # (n, V)

    def _run_positions(self, reqs: list[Request], spans: list[tuple[int, int]]):
        """Draft KV of positions [b, e) of each request from its stored target features: hidden states
        (T, hidden), draft logits (T, N) or None, and the packed row offsets."""
        rows, aux = self._catch_up_inputs(reqs, spans)
        with torch.inference_mode():
            g = self.model.fuse(aux.to(self.model.fc.weight.dtype))  # (T, hidden)
        hidden, logits = self._hidden(rows, g)
        self._caught_up(reqs, spans)
        qsl = [0]
        for b, e in spans:
            qsl.append(qsl[-1] + e - b)
        return hidden, logits, qsl

    def _catch_up_inputs(self, reqs: list[Request], spans: list[tuple[int, int]]):
        """Rows of draft positions [b, e) of each request and their stored target features (T, k * hidden)."""
        rows = [RowInput(r, r.tokens[b:e], list(range(b, e)), b, e, want_logits="none") for r, (b, e) in
                zip(reqs, spans)]
        return rows, torch.cat([self._state(r).before(b, e) for r, (b, e) in zip(reqs, spans)])

    def _caught_up(self, reqs: list[Request], spans: list[tuple[int, int]]) -> None:
        """The draft's KV now reaches each span's end; features before its last position are spent."""
        for r, (_, e) in zip(reqs, spans):
            r.num_computed_draft = e
            self._state(r).drop_before(e - 1)

    def prefill(self, chunks, features=None) -> None:
        if not chunks:
            return
        if features is None:
            raise ValueError("an eagle draft needs the target features of the prefill (features=None)")
        for c, f in zip(chunks, features):
            self._state(c.req).put(c.start, f)
        self._run_positions([c.req for c in chunks], [(c.start, c.end) for c in chunks])

    def accepted(self, rows: list[Request], results) -> None:
        for req, res in zip(rows, results):
            if not req.finished:
                self._state(req).put(req.num_computed_draft - 1, res.features)

    def _catch_up(self, grows: list[_Growth]) -> None:
        reqs = [g.req for g in grows]
        hidden, logits, qsl = self._run_positions(reqs, [(r.num_computed_draft, len(r.tokens)) for r in reqs])
        ends = torch.tensor([e - 1 for e in qsl[1:]], dtype=torch.int64, device=hidden.device)
        last = hidden.index_select(0, ends)  # (rows, hidden)
        for g, h, lg in zip(grows, last, self._logits(last, None if logits is None else logits.index_select(0, ends))):
            g.hidden[-1] = h
            g.frontier = [(-1, lg)]

    def _forward_level(self, live: list[tuple[_Growth, list[int]]]) -> None:
        rows = [RowInput(g.req, [g.tokens[i] for i in nodes], [g.L + g.depth[i] for i in nodes], g.L,
                         g.L + len(g.tokens), [g.masks[i] for i in nodes], want_logits="none")
                for g, nodes in live]
        feats = torch.stack([g.hidden[g.parents[i]] for g, nodes in live for i in nodes])  # (T, hidden)
        hidden, draft_logits = self._hidden(rows, feats)
        logits = self._logits(hidden, draft_logits)  # (T, V)
        j = 0
        for g, nodes in live:
            g.frontier = [(i, logits[j + n]) for n, i in enumerate(nodes)]
            g.hidden.update((i, hidden[j + n]) for n, i in enumerate(nodes))
            j += len(nodes)


def best_nodes(tokens: list[int], parents: list[int], ranks: list[int], n: int) -> DraftTree:
    """The tree of a device dynamic tree's nodes (level order; ``parents`` among them, -1 the root) whose
    score ``ranks`` are below ``n`` (the adaptive budget; the best n nodes of a tree form a tree)."""
    if n >= len(tokens):
        return DraftTree.of_parents(tokens, parents)
    keep = [i for i, r in enumerate(ranks) if r < n]
    index = {j: i for i, j in enumerate(keep)}
    return DraftTree.of_parents([tokens[j] for j in keep], [index.get(parents[j], -1) for j in keep])
