"""EAGLE-style drafting: the draft reads the target's hidden states of the accepted tokens.

Position p of the draft needs the target features of position p - 1. The verify forward returns
them for the pending token and the accepted path; prefill returns them for the prompt. A request's
features wait in this drafter (``FeatureTable``, one device table for the batch) until the next
catch-up consumes them.
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
from specdec.tree import DraftTree, TreeSpec


class FeatureTable:
    """The target features that running requests' drafts have not read yet, for all of them at once.

    Draft position p reads the target features of position p - 1. Every catch-up reads all a request
    holds but the last position's, so a request holds one run of at most ``cap`` rows: the verify step's
    (pending token + accepted path) or a prefill chunk's last position. The runs live in one device table,
    ``cap`` rows per block-table row (a running request's ``bt_row``), plus one zero row (the input of
    position 0, and of any position whose features nobody kept), plus one row per physical KV block (of
    ``blocks``, ``block_size`` positions each): the features of the block's last position, kept when a prefill
    computes it. A block enters the prefix cache only after a prefill computed it, so the first draft position
    after a cached prefix (a prefix hit, a preempted request's restart, a chunk after ``adopt``) reads exactly
    the features the prefix was computed with. Host arrays say which positions each slot holds and for which
    request. Batches are (R, w) grids: row i, column j.
    """

    def __init__(self, rows: int, cap: int, width: int, dtype: torch.dtype, device, *, blocks: int = 0,
                 block_size: int = 1) -> None:
        self.cap, self.zero = cap, rows * cap
        self.block_size, self.block_ends = block_size, rows * cap + 1  # row of block b's last position: + b
        self.data = torch.zeros(rows * cap + 1 + blocks, width, dtype=dtype, device=device)  # (rows*cap+1+blocks, k*H)
        self.start = np.zeros(rows, dtype=np.int64)  # position of each slot's first row
        self.count = np.zeros(rows, dtype=np.int64)  # rows each slot holds
        self.owner: list[Request | None] = [None] * rows
        self._cols = np.arange(cap)

    def sources(self, reqs: list[Request], bt: np.ndarray, begins: np.ndarray, valid: np.ndarray) -> np.ndarray:
        """(R, w) table rows holding the features of positions begins[i] - 1 + j (the input of draft position
        begins[i] + j) of each request ``reqs[i]`` (block-table row ``bt[i]``): from its run, else (the last
        position of a block) the block's row, else (or where not ``valid``) the zero row (R, w)."""
        held = np.where([self.owner[i] is r for i, r in zip(bt.tolist(), reqs)], self.count[bt], 0)  # (R,)
        k = (begins - 1 - self.start[bt])[:, None] + np.arange(valid.shape[1])  # (R, w) index in the slot's run
        ok = valid & (k >= 0) & (k < held[:, None])
        out = np.where(ok, (bt * self.cap)[:, None] + k, self.zero)
        miss = valid & ~ok  # (R, w)
        if miss.any() and self.data.shape[0] > self.block_ends:
            pos = begins[:, None] - 1 + np.arange(valid.shape[1])  # (R, w) the positions read
            for i, j in np.argwhere(miss & (pos >= 0) & (pos % self.block_size == self.block_size - 1)):
                blocks = reqs[i].blocks
                b = pos[i, j] // self.block_size
                if b < len(blocks) and blocks[b] >= 0:  # (a sliding window may have released it)
                    out[i, j] = self.block_ends + blocks[b]
        return out

    def gather(self, index: np.ndarray) -> torch.Tensor:
        """Rows ``index`` of the table (one indexing op)."""
        return self.data[torch.from_numpy(index).to(self.data.device, non_blocking=True)]

    def consumed(self, bt: np.ndarray, ends: np.ndarray) -> None:
        """The drafts of block-table rows ``bt`` have read everything before position ``end - 1``."""
        self.start[bt], self.count[bt] = ends - 1, 0

    def keep_block_ends(self, reqs: list[Request], starts: list[int], feats) -> None:
        """Request i's prefill computed ``feats[i]`` (n_i, k * hidden), the target features of positions
        [starts[i], starts[i] + n_i): keep those of the last position of each block among them."""
        if self.data.shape[0] == self.block_ends:
            return
        bs, picks, dst = self.block_size, [], []
        for r, s, f in zip(reqs, starts, feats):
            first = (bs - 1 - s) % bs  # (the chunk's row of the first block end in it)
            blocks = [r.blocks[p // bs] for p in range(s + first, s + f.shape[0], bs)]
            if blocks and min(blocks) >= 0:  # (a released block never enters the prefix cache)
                picks.append(f[first::bs])
                dst += blocks
        if picks:
            rows = np.array(dst, dtype=np.int64) + self.block_ends  # (n,) one per block end in the chunks
            where = torch.from_numpy(rows).to(self.data.device, non_blocking=True)
            self.data.index_copy_(0, where, torch.cat(picks).to(self.data.dtype))  # (n, k * hidden)

    def store(self, reqs: list[Request], starts: list[int], feats: list[torch.Tensor]) -> None:
        """Request i now holds ``feats[i]`` (n_i, k * hidden): the features of positions [starts[i],
        starts[i] + n_i) (whatever it held before is dropped); n_i <= cap."""
        self.store_packed(reqs, starts, feats[0] if len(feats) == 1 else torch.cat(feats),
                          [f.shape[0] for f in feats])

    def store_packed(self, reqs: list[Request], starts, rows: torch.Tensor, sizes) -> None:
        """``store`` of the features of every request in one tensor ``rows`` (sum(sizes), k * hidden), request
        after request (request i's are ``sizes[i]`` rows; ``starts`` and ``sizes``: lists or int64 arrays)."""
        lengths = np.asarray(sizes, dtype=np.int64)  # (R,)
        if lengths.max(initial=0) > self.cap:
            raise ValueError(f"feats: a request holds at most {self.cap} feature rows, got {lengths.max()}")
        slots = [r.bt_row for r in reqs]
        bt = np.array(slots, dtype=np.int64)  # (R,)
        dst = ((bt * self.cap)[:, None] + self._cols)[self._cols < lengths[:, None]]  # (T,) row-major = packed
        # non_blocking: a blocking upload would wait for every queued step (``specdec.pipeline``)
        where = torch.from_numpy(dst).to(self.data.device, non_blocking=True)
        self.data.index_copy_(0, where, rows.to(self.data.dtype))
        self.start[bt], self.count[bt] = starts, lengths
        for i, r in zip(slots, reqs):
            self.owner[i] = r


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


class EagleDrafter(ModelDrafter):
    """Chains, static top-k trees and dynamic trees from an ``EagleDraft`` sharing the pool."""

    def __init__(self, model: EagleDraft, runner, spec: TreeSpec, vocab_size: int) -> None:
        super().__init__(model, runner, spec)
        self.vocab_size = vocab_size
        self.target_features = model.aux_layers
        width = len(model.aux_layers) * model.config.hidden_size
        # a run is a verify step's pending token + accepted path (<= max_nodes + 1 rows) or one prefill row
        self.features = FeatureTable(runner.tables.host.shape[0], self.max_nodes + 1, width,
                                     next(model.parameters()).dtype, runner.device,  # the device program's dtype
                                     blocks=runner.pool.num_blocks, block_size=runner.pool.block_size)
        self._pending: tuple | None = None  # features ``accepted`` noted but did not store yet
        self.device_loop = None  # a DeviceTreeLoop or DeviceDynamicTree once the graph path is on
        self.fused_verify = False  # device-program steps propose their trees on the device (``DeviceDraft``)
        self.clock = StepClock(runner.device)  # times the draft program of a device proposal
        self.paths: Counter = Counter()  # proposals by path: "device" (the device program) or "host" (by levels);
        #                                  "fused": device proposals verified from the device; "ahead": steps
        #                                  queued one step early and adopted (``pipeline.EagleAhead``),
        #                                  "dropped": queued steps not adopted

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
        self._flush()  # (a queued step was dropped: its catch-up runs again from the table)
        loop = self.device_loop
        if loop is not None and rows:
            spans = _Spans.of(rows, loop.q)
            sizes = spans.ends - spans.begins
            b = loop.bucket(len(rows), int(sizes.max()))
            if b is not None and sizes.min() > 0:
                self.paths["device"] += 1
                return self._propose_on_device(rows, spans, b)
        self.paths["host"] += 1
        return super().propose(rows)

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
        return rows, bt, self.features.sources(reqs, spans.bt, begins, valid)

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

    def _run_positions(self, reqs: list[Request], spans: _Spans, aux: torch.Tensor):
        """Draft KV of each request's span with target features ``aux`` (T, k * hidden): hidden states
        (T, hidden), draft logits (T, N) or None, and the packed row offsets."""
        rows = [RowInput(r, r.tokens[b:e], list(range(b, e)), b, e, want_logits="none")
                for r, b, e in zip(reqs, spans.begins.tolist(), spans.ends.tolist())]
        with torch.inference_mode():
            g = self.model.fuse(aux.to(self.model.fc.weight.dtype))  # (T, hidden)
        hidden, logits = self._hidden(rows, g)
        self._consumed(reqs, spans)
        return hidden, logits, [0] + np.cumsum(spans.ends - spans.begins).tolist()

    def consumed_through(self, reqs: list[Request]) -> None:
        """``_consumed`` of a catch-up that reached each request's length (a pipelined step's, on the device): the
        features of the step before, which it read, are spent (a row of that step not among ``reqs``, not
        scheduled now, keeps its own in the table)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            ids = {id(req) for req in reqs}
            rest = np.fromiter((id(req) not in ids for req in pending[0]), bool, len(pending[0]))
            if rest.any():
                self._store_noted(pending, rest)
        self._consumed(reqs, _Spans.of(reqs, 0))

    def _consumed(self, reqs: list[Request], spans: _Spans) -> None:
        """The draft's KV now reaches each span's end; the features before its last position are spent."""
        self.features.consumed(spans.bt, spans.ends)
        for r, e in zip(reqs, spans.ends.tolist()):
            r.num_computed_draft = e

    def prefill(self, chunks, features=None) -> None:
        self._flush()
        if not chunks:
            return
        if features is None:
            raise ValueError("an eagle draft needs the target features of the prefill (features=None)")
        reqs = [c.req for c in chunks]
        n = len(chunks)
        bt = np.fromiter((r.bt_row for r in reqs), np.int64, n)
        begins = np.fromiter((c.start for c in chunks), np.int64, n)
        ends = np.fromiter((c.end for c in chunks), np.int64, n)
        spans = _Spans(bt, begins, ends, np.arange(int((ends - begins).max())) < (ends - begins)[:, None])
        one = np.ones((n, 1), dtype=bool)
        carry = self.features.gather(self.features.sources(reqs, bt, begins, one)[:, 0])  # (R, k*H): at start - 1
        dtype = self.features.data.dtype
        aux = torch.cat([x for h, f in zip(carry.split(1), features) for x in (h, f[:-1].to(dtype))])  # (T, k*H)
        self._run_positions(reqs, spans, aux)
        self.features.store(reqs, (ends - 1).tolist(), [f[-1:] for f in features])
        self.features.keep_block_ends(reqs, begins.tolist(), features)

    def accepted(self, rows: list[Request], results) -> None:
        """Keep the pending token's and the accepted path's target features of the rows that go on (the next
        catch-up's inputs), from the results' one packed tensor (``VerifyResults``). When the step after this one
        is already queued on the device, its catch-up has read them there: they are only noted (``_pending``),
        stored if that step is dropped (``_flush``, before the table is read or their buffer rewritten) and
        forgotten once it is adopted (``consumed_through``), so a pipelined step copies no features."""
        self._flush()
        sizes = getattr(results, "feature_sizes", None)
        if sizes is None:
            return
        source = getattr(results, "features_source", None)
        live = np.fromiter((not req.finished for req in rows), bool, len(rows))  # (R,)
        keep = None if live.all() else np.repeat(live, sizes)  # (T,) the rows that go on, of the packed ones
        if keep is not None:
            if not keep.any():
                return
            rows, sizes = [req for req, go in zip(rows, live) if go], sizes[live]
        starts = [req.num_computed_draft - 1 for req in rows]
        if source is not None:
            table, flat = source
            self._pending = (rows, starts, table, flat if keep is None else flat[keep], sizes)
            return
        packed = results.packed_features
        if keep is not None:  # some requests ended: the others' rows of the packed tensor, in one gather
            packed = packed[torch.from_numpy(np.flatnonzero(keep)).to(packed.device, non_blocking=True)]
        self.features.store_packed(rows, starts, packed, sizes)

    def _flush(self) -> None:
        """Store the features ``accepted`` only noted (the queued step that read them was not adopted)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._store_noted(pending)

    def _store_noted(self, pending: tuple, which: np.ndarray | None = None) -> None:
        """Store noted features ``pending`` (rows, starts, table, flat, sizes), of the rows ``which`` (R,) bool
        (None: all) only."""
        rows, starts, table, flat, sizes = pending
        if which is not None:
            rows, starts = [r for r, x in zip(rows, which) if x], np.asarray(starts)[which]
            flat, sizes = flat[np.repeat(which, sizes)], sizes[which]
        self.features.store_packed(rows, starts, table.take(flat), sizes)

    def _catch_up(self, grows: list[Growth]) -> None:
        reqs = [g.req for g in grows]
        spans = _Spans.of(reqs)
        aux = self.features.gather(self.features.sources(reqs, spans.bt, spans.begins, spans.valid)[spans.valid])
        hidden, logits, qsl = self._run_positions(reqs, spans, aux)  # aux: (T, k * hidden)
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
