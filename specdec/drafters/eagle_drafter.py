"""EAGLE-style drafting: the draft reads the target's hidden states of the accepted tokens.

Position p of the draft needs the target features of position p - 1. Every target forward (verify and
prefill) writes them into the KV slot of their token (``SlotFeatures``), so the draft may fall behind the
target: at budget 0 (plain decoding) it does not run at all, and the next step that speculates catches up
over every position it missed.
Tree nodes get their parent's draft hidden state instead (the root: the last catch-up position).
Tree-node KV is written with those self-features, so it is never adopted: after acceptance the
catch-up recomputes the accepted tokens with the target's features (``draft_computed`` is empty).
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from specdec.adaptive import budget_options, template_trees
from specdec.drafters.base import Proposal
from specdec.drafters.model_drafter import DRAFT_MODEL_INDEX, Growth, ModelDrafter
from specdec.fused_step import DeviceDraft, StepClock
from specdec.lookahead_ops import CAUSAL_BITS
from specdec.models.eagle import EagleDraft
from specdec.runner import RowInput
from specdec.scheduler.request import Request
from specdec.step_inputs import PackedRows
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec


class SlotFeatures:
    """Where a draft position's input is: draft position p reads the target features of position p - 1, which
    every target forward that computes a token's KV also writes into that token's KV slot of the shared pool
    (``KVPool.features``: written inside the verify and prefill graphs, moved with the KV when a path is
    adopted). So a request's features are wherever its KV is: after a prefix hit, a preemption's restart, or any
    number of steps the draft did not follow (budget 0: plain decoding), the draft's catch-up reads exactly the
    features its positions were computed with, and nothing is stored or copied per step. Rows of the table
    (``data``) are slots; ``zero`` is a row of zeros (the input of position 0, of padding, and of a position
    whose block a sliding window released)."""

    def __init__(self, pool, tables) -> None:
        if pool.features is None:
            raise ValueError("an EAGLE draft needs a KV pool that keeps target features (KVPool(feature_width=...))")
        self.pool, self.tables = pool, tables

    @property
    def data(self) -> torch.Tensor:
        return self.pool.features

    @property
    def zero(self) -> int:
        return self.pool.feature_zero

    def sources(self, bt: np.ndarray, begins: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """(R, w) table rows of the features of positions begins[i] - 1 + j (the input of draft position
        begins[i] + j) of the requests on block-table rows ``bt`` (R,) (their host rows synced); the zero row
        where not ``valid``."""
        positions = begins[:, None] - 1 + np.arange(valid.shape[1])  # (R, w)
        rows = self.pool.feature_rows(self.tables.host_rows(bt), positions)
        return np.where(valid, rows, self.zero)

    def gather(self, index: np.ndarray) -> torch.Tensor:
        """Rows ``index`` of the table (one indexing op)."""
        return self.data[torch.from_numpy(index).to(self.data.device, non_blocking=True)]


class _Spans(NamedTuple):
    """Each request's draft positions still to compute, [begins, ends), as a grid of ``width`` columns."""

    bt: np.ndarray  # (R,) block-table rows
    begins: np.ndarray  # (R,)
    ends: np.ndarray  # (R,)
    valid: np.ndarray  # (R, width) bool: column j < ends - begins

    @classmethod
    def of(cls, reqs: list[Request], width: int | None = None) -> _Spans:
        """The spans [num_computed_draft, len(tokens)) of ``reqs``; ``width`` None: the longest."""
        n = len(reqs)
        bt, begins, ends = np.fromiter((x for r in reqs for x in (r.bt_row, r.num_computed_draft, len(r.tokens))),
                                       np.int64, 3 * n).reshape(n, 3).T  # (R,) each
        sizes = ends - begins
        width = int(sizes.max(initial=0)) if width is None else width
        return cls(bt, begins, ends, np.arange(width) < sizes[:, None])

    @classmethod
    def of_range(cls, bt: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> _Spans:
        """The spans [begins, ends) of the rows on block-table rows ``bt``, as wide as the longest."""
        sizes = ends - begins
        return cls(bt, begins, ends, np.arange(int(sizes.max(initial=0))) < sizes[:, None])


class EagleDrafter(ModelDrafter):
    """Chains, static top-k trees and dynamic trees from an ``EagleDraft`` sharing the pool."""

    def __init__(self, model: EagleDraft, runner, spec: TreeSpec, vocab_size: int) -> None:
        super().__init__(model, runner, spec)
        self.vocab_size = vocab_size
        self.target_features = model.aux_layers
        self.features = SlotFeatures(runner.pool, runner.tables)
        self.device_loop = None  # a DeviceTreeLoop or DeviceDynamicTree once the graph path is on
        self.fused_verify = False  # device-program steps propose their trees on the device (``DeviceDraft``)
        self.clock = StepClock(runner.device)  # times the draft program of a device proposal
        self.paths: Counter = Counter()  # proposals by path: "device" (the device program) or "host" (by levels);
        #                                  "fused": device proposals verified from the device; "ahead": steps
        #                                  queued one step early and adopted (``pipeline_hooks.EagleAhead``),
        #                                  "dropped": queued steps not adopted; "decode": budget-0 steps (the
        #                                  draft does not run); "behind": catch-ups of a draft that fell behind

    @property
    def lookahead(self) -> int:
        """The device dynamic tree writes the draft KV of width * (depth - 1) nodes, possibly more than it keeps.
        Pipelined, a step is queued before the previous one's path and bonus token (at most max_nodes + 1) are
        committed, so its rows reserve that much more."""
        shape = getattr(self.device_loop, "shape", None)
        own = self.max_nodes if shape is None else max(self.max_nodes, shape.region)
        return own + (self.max_nodes + 1 if self.pipelined else 0)

    def enable_device_loop(self, graphs) -> None:
        """Draft greedy batches with one device program per batch bucket (captured with ``graphs``, the engine's
        GraphRunner): the static template's levels, or a dynamic tree of ``device_shape(spec)``."""
        from specdec.drafters.eagle_device import DeviceTreeLoop
        from specdec.drafters.eagle_dynamic import DeviceDynamicTree, device_shape
        from specdec.graphs import QUERY_BUCKETS, bucket

        dev, pool, backend = self.runner.device, self.runner.pool, self.runner.backend
        shape = device_shape(self.spec) if self._template is None else None
        depth = self.spec.depth if shape is None else shape.depth
        catch_up = bucket(depth + 1, QUERY_BUCKETS) or depth + 1  # accepted path + bonus
        if shape is not None:
            self.device_loop = DeviceDynamicTree(self.model, pool, backend, shape, graphs.batch_buckets, catch_up,
                                                 graphs.inputs.width, dev)
        else:
            self.device_loop = DeviceTreeLoop(self.model, pool, backend, self._template, graphs.batch_buckets,
                                              catch_up, graphs.inputs.width, dev)
        self.device_loop.set_budgets([o.nodes for o in budget_options(self)])  # each budget's levels are captured
        graphs.programs.append(self.device_loop)

    def program_shape(self) -> tuple[int, int, bool] | None:
        """The device program's trees: nodes per row (N), levels below the root, and whether they are dynamic
        (the fused verify's shape, ``fused_step.FusedVerify``); None without a device program."""
        loop = self.device_loop
        if loop is None:
            return None
        if self._template is None:
            return loop.shape.nodes, loop.shape.depth, True
        return self._template.num_nodes, len(loop.levels), False

    def propose(self, rows: list[Request]) -> Proposal:
        """Budget 0: plain decoding, and the draft does not run (it catches up when a step speculates again: the
        features of what it missed wait in their slots). Else the device program's trees (after a catch-up of a
        draft more positions behind than the program's catch-up holds), or the host levels'."""
        if self.node_budget == 0:
            self.paths["decode"] += 1
            return Proposal([DraftTree.empty("cpu")] * len(rows), [frozenset()] * len(rows))
        loop = self.device_loop
        if loop is not None and rows:
            self._catch_up_behind(rows, loop.q)
            spans = _Spans.of(rows, loop.q)
            sizes = spans.ends - spans.begins
            b = loop.bucket(len(rows), int(sizes.max()))
            if b is not None and sizes.min() > 0:
                self.paths["device"] += 1
                return self._propose_on_device(rows, spans, b)
        self.paths["host"] += 1
        return super().propose(rows)

    def _catch_up_behind(self, rows: list[Request], q: int) -> None:
        """The draft KV of rows more than ``q`` positions behind (after plain-decoding steps), up to their pending
        token (the device program's catch-up computes that one and the root's distribution), in one forward."""
        behind = [r for r in rows if len(r.tokens) - r.num_computed_draft > q]
        if not behind:
            return
        self.paths["behind"] += 1
        spans = _Spans.of(behind)
        self._run_positions(behind, _Spans.of_range(spans.bt, spans.begins, spans.ends - 1))

    def _propose_on_device(self, reqs: list[Request], spans: _Spans, b: int) -> Proposal:
        """The device program's trees: left on the device (a ``DeviceDraft``, verified right behind the program)
        when a verify bucket holds them, else read (one read) and proposed as host trees."""
        loop = self.device_loop
        rows, bt, src = self._catch_up_rows(reqs, spans, loop.q)
        padded = np.full(b * loop.q, self.features.zero, dtype=np.int64)  # (b * q,) padding reads the zero row
        padded[:src.size] = src.ravel()
        n = self.node_budget
        key = self._verify_key(len(reqs), n)
        start = None if key is None else self.clock.mark()
        src = torch.from_numpy(padded).to(self.runner.device, non_blocking=True)
        out = loop.run(b, rows, bt, self.features.data, src, loop.set_rows(reqs), n)[:len(reqs)]
        self._consumed(reqs, spans)
        if key is not None:
            self.paths["fused"] += 1
            parents = None if self._template is None else self._template.parents
            return DeviceDraft(reqs, key, out, n, bt, parents, self.clock, start, self.clock.mark()).proposal(len(reqs))
        host = out.tolist()  # the one read
        if self._template is None:  # (rows, 3, N): tokens, parents, score ranks
            trees = [best_nodes(*row, n) for row in host]
        else:  # (rows, N) tokens
            trees = template_trees(host, self._template, n)
        return Proposal(trees, [frozenset()] * len(reqs))

    def _verify_key(self, rows: int, n: int):
        """The graph bucket of the verify of ``rows`` device trees under budget ``n``, or None (then the trees are
        read and proposed from the host): only with ``fused_verify``."""
        shape = self.program_shape() if self.fused_verify else None
        if shape is None:
            return None
        return self.runner.packed_key(0, rows, min(n, shape[0]) + 1, self.target_features)

    def _catch_up_rows(self, reqs: list[Request], spans: _Spans, q: int) -> tuple[PackedRows, np.ndarray, np.ndarray]:
        """Catch-up rows of each request's span laid out for ``q`` queries per row (causal masks; ``spans`` is
        q columns wide), their block-table rows (R, W) and the (R, q) feature-table rows of their inputs."""
        tables, bs = self.runner.tables, self.runner.pool.block_size
        self.runner.sync_tables(reqs)
        begins, ends, valid = spans.begins, spans.ends, spans.valid
        index = np.flatnonzero(valid)  # (T,) padded position of each query: row * q + j
        row, j = np.divmod(index, q)
        pos = begins[row] + j  # (T,)
        ids = np.array([t for r, b, e in zip(reqs, begins.tolist(), ends.tolist()) for t in r.tokens[b:e]],
                       dtype=np.int64)  # (T,)
        bt = tables.host_rows(spans.bt)  # (R, W) the rows' block tables
        slots = bt[row, pos // bs].astype(np.int64) * bs + pos % bs  # (T,)
        tokens = np.empty((5, len(ids)), dtype=np.int64)  # ids, positions, slots, masks, parents (unused: -1)
        tokens[0], tokens[1], tokens[2], tokens[3], tokens[4] = ids, pos, slots, CAUSAL_BITS[j], -1
        per_row = np.empty((3, len(reqs)), dtype=np.int64)  # prefix_lens, seq_lens, num_tokens
        per_row[0], per_row[1], per_row[2] = begins, ends, ends - begins
        rows = PackedRows(index, tokens, per_row)
        return rows, bt, self.features.sources(spans.bt, begins, valid)

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

    def _run_positions(self, reqs: list[Request], spans: _Spans):
        """Draft KV of each request's span, its inputs the target features of the positions before (from their
        slots): hidden states (T, hidden), draft logits (T, N) or None, and the packed row offsets."""
        rows = [RowInput(r, r.tokens[b:e], list(range(b, e)), b, e, want_logits="none")
                for r, b, e in zip(reqs, spans.begins.tolist(), spans.ends.tolist())]
        self.runner.sync_tables(reqs)
        aux = self.features.gather(self.features.sources(spans.bt, spans.begins, spans.valid)[spans.valid])
        with torch.inference_mode():
            g = self.model.fuse(aux.to(self.model.fc.weight.dtype))  # (T, hidden)
        hidden, logits = self._hidden(rows, g)
        self._consumed(reqs, spans)
        return hidden, logits, [0] + np.cumsum(spans.ends - spans.begins).tolist()

    def consumed_through(self, reqs: list[Request]) -> None:
        """``_consumed`` of a catch-up that reached each request's length (a pipelined step's, on the device)."""
        self._consumed(reqs, _Spans.of(reqs, 0))

    @staticmethod
    def _consumed(reqs: list[Request], spans: _Spans) -> None:
        """The draft's KV now reaches each span's end."""
        for r, e in zip(reqs, spans.ends.tolist()):
            r.num_computed_draft = e

    def prefill(self, chunks) -> None:
        """The draft KV of prefill ``chunks``, reading the features the target's prefill of them (just before) and
        of earlier positions wrote into their slots."""
        if not chunks:
            return
        reqs = [c.req for c in chunks]
        n = len(chunks)
        bt = np.fromiter((r.bt_row for r in reqs), np.int64, n)
        begins = np.fromiter((c.start for c in chunks), np.int64, n)
        ends = np.fromiter((c.end for c in chunks), np.int64, n)
        self._run_positions(reqs, _Spans.of_range(bt, begins, ends))

    def accepted(self, rows: list[Request], results) -> None:
        """(nothing to keep: the verify wrote the accepted tokens' features into their slots)"""

    def _catch_up(self, grows: list[Growth]) -> None:
        reqs = [g.req for g in grows]
        hidden, logits, qsl = self._run_positions(reqs, _Spans.of(reqs))
        last = torch.from_numpy(np.asarray(qsl[1:], dtype=np.int64) - 1).to(hidden.device, non_blocking=True)
        last_hidden = hidden.index_select(0, last)  # (rows, hidden)
        for g, h, lg in zip(grows, last_hidden, self._logits(last_hidden, None if logits is None else
                                                            logits.index_select(0, last))):
            g.hidden[-1] = h
            g.frontier = [(-1, lg)]

    def _forward_level(self, live: list[tuple[Growth, list[int]]]) -> None:
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
