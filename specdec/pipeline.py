"""Pipelined steps: the next step's device work is queued before the host reads this one's.

A padded greedy step ends with one device-to-host read; the host then commits the accepted tokens, applies
stop rules and routes outputs while the device waits, and only then prepares the next step. But what the next
step's device work needs is already on the device after this step's verify: each row's accepted path, bonus
token and length, the rows' block tables, and (EAGLE) the kept trees and the verify's target features, or
(n-gram) the next chains the follow-up launch looked up. So right behind verify K and the start of its read,
``StepPipeline.queue`` writes step K + 1's inputs on the device from K's outcome (the proposer's ``hook``),
has the verifier launch its verify, and starts its read. The host waits only for K's read and commits K while
the device runs K + 1.

At the next engine step ``StepPipeline.propose`` adopts the queued step (a ``QueuedStep``) when its rows are
among the queued ones, each at the length the device assumed, under the same budget; otherwise it is dropped:
it wrote KV only past every live row's committed length, in blocks the
rows still hold (the drafter's ``lookahead`` reserves them), so nothing it wrote is read.

One mechanism for every proposer; the hooks differ only in how they write the next step's inputs:
- ``EagleAhead``: the accepted path's KV moves to its final slots, the draft program's catch-up rows are the
  path's tokens and the bonus token with the verify's features as inputs, the next verify's skeleton puts the
  bonus token at L + m as the root; then the draft program replays (``lookahead_ops``, ``kernels/advance.py``);
- ``ChainAhead`` (n-gram chains looked up on the device, and target-only decoding with no chain): the next
  verify's whole bucket from the outcome and the chains (``ngram_ops.ngram_advance_reference``), under any node
  budget n from 0 (a decode step; its follow-up still extends the device n-gram histories) to the longest chain:
  a step verifies in the bucket of n + 1 queries (``min_query``) and its successor is built there, each chain cut
  to n tokens, exactly the chains the drafter proposes under that budget.
Steps with sampled rows (not with a repetition penalty) are queued by both: the sampled rule runs right behind the
verify (its choices read each row's positions from the queued inputs), and the next step is built from its
outcome.

Requests whose prompt a step's prefill finished join the step queued in that same step (``Drafter.joining``; EAGLE
steps, decode steps and n-gram chain steps, whose joining rows' first chains are looked up on the host): each enters
as if it had been a row of verify K that accepted nothing and chose its pending token, an outcome written into a row
of verify K that no one reads (a padding row, or the row of a request that ended). Without that, every admission
would cost one step without overlap: continuous batching admits a few rows at a time when rows end at different
steps, as they do when a draft's acceptance varies. The writers rewrite every part of a live row that a padding row
holds as padding (an EAGLE row's root mask and query count too), since a joining row may take a padding row. Prefill
pieces and draft forwards read inputs of their own (``GraphRunner.side_inputs``), so a prefill between verify K
and the queue leaves verify K's inputs, which the queued step's writer reads, as they were.
Nothing changes in what is computed: the device builds the inputs the host would have built (tests compare
them), so outputs are the same with and without the pipeline.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specdec.drafters.ngram_ops import ngram_advance_reference
from specdec.fused_step import DeviceDraft, shape_rows
from specdec.graphs import GraphCache, cache_for
from specdec.kernels.advance import advance_rows
from specdec.lookahead_ops import advance_rows_reference
from specdec.step_inputs import StepViews

if TYPE_CHECKING:
    from specdec.drafters.base import Proposal
    from specdec.scheduler.request import Request


class _PinnedPair:
    """Two pinned int64 host buffers used in turn, each guarded by the event recorded after the copy that used
    it (CUDA only): a buffer is handed out again only once that copy is done."""

    def __init__(self) -> None:
        self._bufs: list[Tensor] = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0

    def take(self, shape: torch.Size | tuple[int, ...], numel: int) -> tuple[Tensor, torch.cuda.Event]:
        """The next buffer viewed as ``shape`` (``numel`` elements) and the event to record after its copy."""
        i = self._turn
        self._turn ^= 1
        self._events[i].synchronize()
        if self._bufs[i].numel() < numel:
            self._bufs[i] = torch.empty(max(numel, 4096), dtype=torch.int64, pin_memory=True)
        return self._bufs[i][:numel].view(shape), self._events[i]


class HostRead:
    """Device-to-host copies into pinned buffers (CUDA), two in flight at most: ``start`` queues a copy,
    the returned ``wait`` gives the host array once that copy is done, without waiting for later work."""

    def __init__(self, device: torch.device) -> None:
        self._pinned = _PinnedPair() if device.type == "cuda" else None

    def start(self, tensors: list[Tensor]):
        """Queue the copy of ``tensors`` (int64, (R, *) each) joined along dim 1; returns ``wait() -> (R, C)``."""
        joined = torch.cat(tensors, 1) if len(tensors) > 1 else tensors[0]
        if self._pinned is None:
            host = joined.numpy().copy()
            return lambda: host
        buf, event = self._pinned.take(joined.shape, joined.numel())
        buf.copy_(joined, non_blocking=True)
        event.record()

        def wait() -> np.ndarray:
            event.synchronize()
            return buf.numpy().copy()

        return wait


class HostUpload:
    """Host int64 arrays to the device through two pinned buffers (CUDA: a non-blocking copy, no per-call pinning,
    no stream sync); a tensor over the array elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pinned = _PinnedPair() if self.device.type == "cuda" else None

    def __call__(self, array: np.ndarray) -> Tensor:
        if self._pinned is None:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        host, event = self._pinned.take(array.shape, array.size)
        host.numpy()[...] = array
        out = host.to(self.device, non_blocking=True)
        event.record()
        return out


class QueuedStep:
    """A verify launched on the device whose host read is pending: its ``rows`` (in order), graph bucket ``key``,
    node budget ``n``, forward result ``fwd`` (device outputs, valid until the bucket's next verify), ``outcome``
    (R', C) on the device ([m, bonus, path..., finite] per row, then any follow-up columns: what the read returns
    and what a successor is built from) and ``wait() -> (R, C)`` its read. ``trees``: an EAGLE step's kept trees
    on the device (tokens, parents, max depths; ``DeviceDraft.launched``), ``draft``: its ``DeviceDraft``.
    ``lengths`` (R,): each row's length once the step before is committed (set by ``assume``);
    ``sel``: adopted by some of its rows, each adopting row's row here (None: all, in order)."""

    def __init__(self, rows: list, key: tuple, n: int, fwd, outcome: Tensor, wait, trees=None,
                 draft: DeviceDraft | None = None) -> None:
        self.rows, self.key, self.n, self.fwd, self.outcome, self.wait = rows, key, n, fwd, outcome, wait
        self.trees, self.draft = trees, draft
        self.lengths: np.ndarray | None = None
        self.sel: np.ndarray | None = None
        self.joined: tuple = ()  # its last rows, which the step before did not have (their prefill had just ended)

    @property
    def draft_seconds(self) -> float | None:
        """Its draft program's device time (an EAGLE step), None when it has none."""
        return None if self.draft is None else self.draft.draft_seconds

    def assume(self, rows: list[Request], accepted: np.ndarray) -> None:
        """The step before, over ``rows`` (this step's rows but the joined ones), was read: ``accepted`` (R,) tokens
        each commits, so each row will be ``len(tokens) + accepted + 1`` long; a joined row keeps its length."""
        lengths = np.fromiter((len(r.tokens) for r in rows), np.int64, len(rows)) + accepted + 1
        joined = np.fromiter((len(r.tokens) for r in self.joined), np.int64, len(self.joined))
        self.lengths = np.concatenate([lengths, joined])

    def read(self) -> np.ndarray:
        """The host read, the adopting rows' rows only."""
        host = self.wait()
        return host if self.sel is None else host[self.sel]


class StepPipeline:
    """The overlap of one step's host work with the next step's device work, wrapped around the proposer of every
    kind: the step proposes through it (``propose`` adopts the queued step or asks the drafter; ``budget`` is the
    drafter's), and the verifier calls ``queue`` right behind each verify it launches. ``hook``: the proposer's part
    (``EagleAhead`` or ``ChainAhead``). Counts ``queued``, ``adopted``, ``dropped``."""

    def __init__(self, runner, drafter, verifier, hook) -> None:
        self.runner, self.drafter, self.verifier, self.hook = runner, drafter, verifier, hook
        self.upload = HostUpload(runner.device)  # a queued step's block tables
        self.ahead: QueuedStep | None = None
        self.queued = self.adopted = self.dropped = self.joined = 0  # (joined: rows a queued step took in)

    @property
    def budget(self) -> int | None:
        """The drafter's node budget for this step (``Drafter.budget``)."""
        return self.drafter.budget

    @budget.setter
    def budget(self, nodes: int | None) -> None:
        self.drafter.budget = nodes

    def propose(self, rows: list[Request]) -> Proposal:
        """The proposal of this step: the queued step when ``adopt`` takes it, else the drafter's."""
        queued = None if self.ahead is None else self.adopt(rows)
        return self.drafter.propose(rows) if queued is None else self.hook.proposal(rows, queued)

    def adopt(self, rows: list[Request]) -> QueuedStep | None:
        """The queued step when ``rows`` are all among its rows (others may have finished, failed or been
        preempted), each with the length the device assumed, under the same budget (``sel`` set when they are not
        exactly its rows in order); else None, and it is dropped."""
        a, self.ahead = self.ahead, None
        at = {id(req): i for i, req in enumerate(a.rows)}
        sel = [at.get(id(req), -1) for req in rows]
        if (not rows or min(sel) < 0 or a.lengths is None or a.n != self.drafter.node_budget
                or any(len(req.tokens) != a.lengths[i] for req, i in zip(rows, sel))):
            self.dropped += 1
            self.hook.dropped()
            return None
        self.adopted += 1
        if sel != list(range(len(a.rows))):
            a.sel = np.asarray(sel)
        return a

    def min_query(self, rows: list[Request]) -> int:
        """Queries per row a verify over ``rows`` needs so that its successor may be queued in its bucket."""
        return self.hook.min_query(rows)

    def queue(self, rows: list[Request], step: QueuedStep) -> QueuedStep | None:
        """Queue the step after ``step`` (launched, its read started) for ``rows`` (its rows, or those of them
        that adopted it) and the rows whose prefill this step finished (``Drafter.joining``: they decode from the
        next step), built on the device, with its verify and read; returns it (also ``ahead``), or None when
        nothing is queued: when joining rows do not fit the bucket, when a row lacks the KV blocks the queued step
        writes, or when the hook declines.

        A joining row enters as if it had been a row of ``step`` whose verify accepted nothing and chose its pending
        token (the prompt's last) as the bonus token: the hook writes such an outcome into a row of ``step`` no one
        reads (a padding row, or the row of one that ended), and the next step's inputs are built from it as from
        the others'."""
        drafter = self.drafter
        joining = list(drafter.joining)  # (set by the engine every step: none without a prefill)
        if joining and (len(rows) + len(joining) > step.key[1] or any(len(r.tokens) < 2 for r in joining)):
            return None
        bs, need, every = self.runner.pool.block_size, drafter.lookahead, rows + joining
        if any(len(r.blocks) * bs < len(r.tokens) + need for r in every) or not self.hook.may_queue(every, step):
            return None
        # the joining rows' rows of ``step``: its padding rows and those of its rows that ended (no one reads them)
        taken = np.zeros(step.key[1], dtype=bool)
        taken[np.arange(len(rows)) if step.sel is None else step.sel] = True
        at = np.flatnonzero(~taken)[:len(joining)]
        nxt = self.hook.write_next(rows, step, self.upload, joining, at)
        if nxt is None:
            return None
        key, draft = nxt
        self.ahead = self.verifier.launch_queued(every, key, drafter.node_budget, draft)
        self.ahead.joined = tuple(joining)
        self.queued += 1
        self.joined += len(joining)
        return self.ahead


class AdvanceGraphs:
    """A queued step's input writer as one CUDA graph replay per key on CUDA (eagerly it is tens of small launches,
    and the host launching them was the pipelined step's bottleneck at batch 1), eagerly elsewhere. A graph reads
    its own copies of the per-step tensors; the rest are the same buffers every step."""

    def __init__(self, device: torch.device, capture: bool | None = None, graphs: GraphCache | None = None) -> None:
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture  # (False: always eagerly)
        self.graphs = graphs if graphs is not None else GraphCache("queued-step writer", self.device)

    def __call__(self, key: tuple, build, copied: tuple[Tensor, ...], inputs, capture: bool = True,
                 rows: int | None = None) -> None:
        """``build(*copied)``, as the replay of ``key``'s graph when capturing. ``inputs``: the ``StepInputs``
        ``build`` writes; capturing runs it once over a zero copy of ``copied`` (nothing accepted: no KV moves),
        and that run's writes to ``inputs`` are put back. The entry keeps ``build`` (and what it binds, such as a
        static tree's node offsets) alive as long as its graph. ``rows``: the graph's own copies are that many rows
        tall (a bucket's), and each step's ``copied`` fills their first rows (the rest is padding, which ``build``
        must leave alone); None: as tall as ``copied``."""
        if not (self.capture and capture):
            build(*copied)
            return
        entry = self.graphs.get(key)
        if entry is None:
            own = tuple(torch.zeros((rows or t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
                        for t in copied)
            saved = inputs.dev.clone()
            try:
                graph, _ = self.graphs.capture(functools.partial(build, *own))
            finally:  # (also when capturing fails, e.g. out of memory: the step is retried on these rows)
                inputs.dev.copy_(saved)
            entry = self.graphs[key] = (graph, own, build)
        graph, own, _ = entry
        for mine, t in zip(own, copied):
            mine[:t.shape[0]].copy_(t)
        graph.replay()


class EagleAhead:
    """The EAGLE drafter's part of a queued step: writes step K + 1's draft-program catch-up and verify skeleton
    from step K's outcome (``advance``) and replays the draft program; adopted, its rows' draft KV is computed.
    At budget 0 the draft does not run (``EagleDrafter.propose``): steps are queued as target-only decoding's are,
    by ``decode`` (a ``ChainAhead`` of no chain), and the draft catches up once a step speculates again."""

    def __init__(self, drafter, decode: ChainAhead) -> None:
        self.drafter, self.decode = drafter, decode
        runner = drafter.runner
        self.rows_op = functools.partial(advance_rows, use_triton=runner.backend.uses_triton)
        self.advance = AdvanceGraphs(runner.device,
                                     graphs=cache_for(runner.graphs, "queued-step writer", runner.device))

    @property
    def decoding(self) -> bool:
        """This step's budget is 0: plain decoding."""
        return self.drafter.node_budget == 0

    @property
    def follows_bucket(self) -> bool:
        """The queued step's writer graph is keyed by the bucket of the step it follows too: at budget 0 only
        (``decode``'s); a fused step's writer is keyed by its own bucket."""
        return self.decoding

    def min_query(self, rows: list[Request]) -> int:
        """(decoding: one query; else 0: only fused steps are queued, in their tree's bucket)"""
        return self.decode.min_query(rows) if self.decoding else 0

    def may_queue(self, rows: list[Request], step: QueuedStep) -> bool:
        """Decoding: behind a decode step, as ``ChainAhead``. Else only behind a fused step (trees on the device,
        target features), adopted by all its rows or some (those that go on are gathered from their rows of it),
        and not for a row with a repetition penalty (it reads the committed tokens on the host)."""
        if self.decoding:
            return step.trees is None and self.decode.may_queue(rows, step)
        return (step.trees is not None and step.fwd.features is not None
                and not any(r.params.penalized for r in rows))

    def write_next(self, rows: list[Request], step: QueuedStep, upload, joining: list[Request] = (),
                   at: np.ndarray | None = None) -> tuple[tuple, DeviceDraft | None] | None:
        if self.decoding:
            return self.decode.write_next(rows, step, upload, joining, at)
        d = self.drafter
        runner, loop = d.runner, d.device_loop
        every = list(rows) + list(joining)
        r, (_, b, q) = len(every), step.key
        bt = None if joining or step.draft is None or step.sel is not None else step.draft.bt
        if bt is None:
            runner.sync_tables(every)
            bt = runner.tables.host_rows([req.bt_row for req in every])
        tokens, parents, _ = step.trees
        offsets = None if not isinstance(parents, tuple) else _node_offsets(parents, runner.device)
        inputs, pool, bs, k = runner.graphs.inputs, runner.pool, runner.pool.block_size, tokens.shape[1]
        vv, pv, feats, pfeats = inputs.views(b, q), loop.inputs.views(b, loop.q), step.fwd.features.table, loop.features
        if joining:  # each as a row ``at`` of ``step`` whose verify (root at L - 2) accepted nothing, chose L - 1
            n = len(joining)
            if tokens.shape[0] < step.key[1]:  # (their trees: none; the rows read past ``step``'s own)
                tokens = torch.cat([tokens, tokens.new_zeros(step.key[1] - tokens.shape[0], k)])
            before = np.fromiter((len(req.tokens) - 2 for req in joining), np.int64, n)
            dev = _join_outcome(step.outcome, at, joining, q, upload,
                                np.stack([at * q, before, pool.feature_rows(bt[len(rows):], before)], 1))
            with torch.inference_mode():  # its root (L - 2) and the target features there, as verify query 0
                vv.positions.index_copy_(0, dev[:, 0], dev[:, 1])
                feats.index_copy_(0, dev[:, 0], pool.features.index_select(0, dev[:, 2]).to(feats.dtype))

        def build(acc: Tensor, tok: Tensor, table: Tensor) -> None:
            # table: each row's block table, its row of ``step`` (outcome, tree, verify inputs), its live flag
            src = table[:, -2]
            advance(vv, b, q, acc.index_select(0, src), tok.index_select(0, src), feats, table[:, :-2], pv, b,
                    loop.q, pfeats, pool, bs, k, offsets, self.rows_op, live=table[:, -1], src=src)

        # all the bucket's rows, one graph per bucket whatever its live rows: those that go on (gathered from their
        # rows of ``step``: some of its requests may have ended), then padding (live flag 0), written as padding
        table = np.zeros((b, bt.shape[1] + 2), dtype=np.int64)
        table[:r, :-2], table[:r, -1] = bt, 1
        table[:len(rows), -2] = np.arange(len(rows)) if step.sel is None else step.sel
        table[len(rows):r, -2] = () if at is None else at
        key = (b, q, k, b, loop.q, feats.data_ptr(), pfeats.data_ptr(), offsets is None)
        captured = runner.graphs.captured(step.key)
        self.advance(key, build, (step.outcome, tokens, upload(table)), inputs, captured, rows=b)
        start = d.clock.mark()
        out = loop.replay(b, loop.set_rows(every), step.n)[:r]
        return step.key, DeviceDraft(every, step.key, out, step.n, None, parents if offsets is not None else None,
                                     d.clock, start, d.clock.mark())

    def proposal(self, rows: list[Request], queued: QueuedStep) -> Proposal:
        """The proposal of an adopted queued step: its draft ran on the device (its catch-up covered the rows), or
        (a decode step) it had none."""
        if queued.draft is None:
            return self.decode.proposal(rows, queued)
        d = self.drafter
        d.consumed_through(rows)
        d.paths["ahead"] += 1
        d.paths["fused"] += 1
        return queued.draft.proposal(len(rows), queued)

    def dropped(self) -> None:
        self.drafter.paths["dropped"] += 1


class ChainAhead:
    """The part of a queued step for chains known on the device: the n-gram drafter's device lookups (``follow``,
    a ``drafters.ngram_device.DeviceNgram``: the next chain comes from its follow-up launch) and target-only
    decoding (``follow`` a ``DecodeFollow``: no chain, the bonus token alone); ``k``: the longest chain (the
    drafter's ``max_nodes``; 0: decoding). Under a node budget n (0..k) a step verifies in the bucket of n + 1
    queries, and the step queued behind it is built in the same bucket: the bonus token, then the chain cut to n
    tokens and to the tokens still to come (n = 0: a decode step, whose follow-up still extends the device
    histories). It writes the next verify's whole bucket from the outcome and the chains, and the rows' lengths,
    block tables and length limits. Sampled rows' outcome is the sampled rule's, written into the verify's outcome
    buffer before the follow-up reads it (``Verifier.launch_queued``). A row whose prefill just ended joins with its
    first chain (``NgramDrafter.first_chain``: none when the device serves it, else the host's), written into its
    outcome row as the follow-up's, its history sent to the device with it (``DeviceNgram.join``)."""

    def __init__(self, drafter, runner, k: int, follow) -> None:
        self.drafter, self.runner, self.k, self.follow = drafter, runner, k, follow
        self.advance = AdvanceGraphs(runner.device,
                                     graphs=cache_for(runner.graphs, "queued-step writer", runner.device))

    follows_bucket = True  # its writer graph reads the follow-up's buffer of the step it follows: keyed by both buckets

    @property
    def nodes(self) -> int:
        """This step's node budget: the most chain tokens its verify and the one queued behind it hold."""
        return min(self.drafter.node_budget, self.k)

    def min_query(self, rows: list[Request]) -> int:
        """The budget's queries (n + 1: the queued verify runs in the same bucket, whatever its chains' lengths)
        when no row has a repetition penalty, greedy and sampled rows alike; else 0 (nothing is queued, and the
        verify keeps its own bucket)."""
        return 0 if any(r.params.penalized for r in rows) else self.nodes + 1

    def may_queue(self, rows: list[Request], step: QueuedStep) -> bool:
        """Behind a verify in its budget's bucket, of rows greedy or sampled but without a repetition penalty (a
        queued step would need the penalty of tokens not committed yet), with room in the n-gram histories for what
        the queued step appends."""
        key = self.runner.packed_key(0, len(step.rows), self.nodes + 1, self.drafter.target_features)
        return (key is not None and step.key[2] == key[2] and not any(r.params.penalized for r in rows)
                and self.follow.room(rows, step.key[2]))

    def write_next(self, rows: list[Request], step: QueuedStep, upload, joining: list[Request] = (),
                   at: np.ndarray | None = None) -> tuple[tuple, None] | None:
        """Write the next verify of ``rows`` and ``joining`` (``StepPipeline.queue``) into its bucket: ``step``'s
        own, or a smaller one when only some of its rows go on (None when none fits)."""
        n, every = self.nodes, list(rows) + list(joining)
        key = step.key if step.sel is None and not joining else self.runner.packed_key(
            0, len(every), n + 1, self.drafter.target_features)
        if key is None or key[2] != step.key[2]:
            return None
        r, (_, b, q) = len(every), key
        graphs, bs = self.runner.graphs, self.runner.pool.block_size
        source = self.follow.source(step.key) if self.advance.capture and graphs.captured(key) else None
        outcome = step.outcome
        if joining:  # each as a row ``at`` of ``step`` that accepted nothing and chose its pending token
            self.runner.sync_tables(joining)
            chains = None
            if self.follow.decoding:  # (the verify's whole outcome buffer: no chain columns)
                outcome = step.fwd.accept
            else:  # (the follow-up's whole output: its graph's, or an eager one's rows padded to the bucket) and the
                # row's first chain as the unpipelined step would look it up on the host
                outcome = source if source is not None else torch.cat(
                    [outcome, outcome.new_zeros(step.key[1] - outcome.shape[0], outcome.shape[1])])
                chains = [self.drafter.first_chain(req, n) for req in joining]
                self.follow.join(joining, chains)
            _join_outcome(outcome, at, joining, q, upload, chains=chains)
        bt = self.runner.tables.host_rows([req.bt_row for req in every])
        tables = np.zeros((b, bt.shape[1] + 5), dtype=np.int64)  # (padding rows: zeros, not live)
        tables[:r, :-5] = bt
        tables[:r, -5] = [len(req.prompt_ids) + req.params.max_new_tokens for req in every]  # largest length
        tables[:r, -4] = n  # most chain tokens
        tables[:r, -3] = [len(req.tokens) for req in rows] + [len(req.tokens) - 1 for req in joining]  # L at ``step``
        tables[:len(rows), -2] = np.arange(len(rows)) if step.sel is None else step.sel  # row of ``step``'s outcome
        tables[len(rows):r, -2] = () if at is None else at
        tables[:r, -1] = 1
        views = graphs.inputs.views(b, q)
        if source is None:  # eagerly, from the outcome as read (joining rows: the bucket's whole outcome)
            ngram_advance_reference(views, b, q, outcome, upload(tables), bs)
        else:  # a graph per (bucket, source bucket), reading the source's fixed buffer whole
            build = functools.partial(ngram_advance_reference, views, b, q, source, block_size=bs)
            self.advance((key, step.key), build, (upload(tables),), graphs.inputs)
        return key, None

    def proposal(self, rows: list[Request], queued: QueuedStep) -> Proposal:
        """The drafter's chains (those the device looked up, which the queued verify holds), already verified."""
        return self.drafter.propose(rows)._replace(device=queued)

    def dropped(self) -> None:
        """(nothing to undo: the host keeps no state for a queued chain step)"""


class DecodeFollow:
    """The ``Verifier.followup`` of pipelined target-only decoding: nothing runs behind a decode's verify; its outcome
    is read, and the queued decode is built from it (``ChainAhead``). ``launches`` counts the steps read so."""

    decoding = True  # (no chain: every step is a decode step, built from the outcome alone)

    def __init__(self, runner) -> None:
        self.runner, self.launches = runner, 0

    def launch(self, rows: list[Request], key, fwd) -> Tensor:
        return self.follow(rows, key, fwd.accept)

    def follow(self, rows: list[Request], key, accept: Tensor) -> Tensor:
        self.launches += 1
        return accept[:len(rows)]  # the outcome itself: no chain

    def consume(self, rows: list[Request], host: list[list[int]]) -> None:
        """(nothing to record: the next decode's input is the bonus token)"""

    def room(self, rows: list[Request], q: int) -> bool:
        return True

    def source(self, key) -> Tensor | None:
        """The captured verify's outcome buffer of bucket ``key``, or None."""
        return self.runner.graphs.outcome_buffer(key)


@torch.inference_mode()
def advance(vv: StepViews, bv: int, qv: int, accept: Tensor, tokens: Tensor, feats: Tensor, bt: Tensor,
            pv: StepViews, bp: int, qp: int, pfeats: Tensor, pool, block_size: int, n: int,
            node_offsets: Tensor | None, rows_op=None, live: Tensor | None = None, src: Tensor | None = None) -> None:
    """Write an EAGLE step K + 1's device inputs from verify K's outcome, for the first R rows: those whose
    ``live`` flag (R,) is nonzero (None: all), the others written as padding in both buckets.
    ``src`` (R,): the row of verify K each row was (its root position and features there; ``accept`` and
    ``tokens`` already come in the new order); None: the same row.

    ``vv``: verify K's bucket (bv, qv) views (its root positions give the rows' lengths; rewritten with the
    next verify's skeleton); ``accept`` (R, qv + 3) its outcome; ``tokens`` (R, n) the kept trees' node
    tokens; ``feats`` (bv * qv, k * H) the verify's target features; ``bt`` (R, W) int64 the rows' current
    block tables. ``pv``/``pfeats``: the draft program's bucket (bp, qp) views and feature buffer, written
    with the catch-up of each row's accepted path and bonus token. ``pool``: the accepted path's KV moves in
    it. ``node_offsets`` (n + 1,): a static tree's root and node positions relative to the root (None: a
    dynamic tree, whose node positions the tree writer derives from the root's). ``rows_op``: what writes the
    integer inputs (``advance_rows_reference``, or the one-launch Triton ``kernels.advance.advance_rows_triton``)."""
    op = rows_op or advance_rows_reference
    fsrc, moved_from, moved_to = op(vv, bv, qv, accept, tokens, bt, pv, bp, qp, block_size, n, node_offsets, live,
                                    src)
    pool.move_slots(moved_from, moved_to)
    # catch-up input j reads the target features of position L + j - 1 (verify query ``fsrc``, -1: none)
    r, width = tokens.shape[0], feats.shape[1]
    rows = (torch.arange(r, device=feats.device) if src is None else src)[:, None] * qv
    picked = feats.index_select(0, (rows + fsrc.clamp(min=0)).flatten()).view(r, qp, width)
    pfeats[:bp * qp].view(bp, qp, width)[:r] = torch.where((fsrc >= 0)[..., None], picked, 0).to(pfeats.dtype)


@torch.inference_mode()
def _join_outcome(outcome: Tensor, at: np.ndarray, joining: list[Request], q: int, upload,
                  more: np.ndarray | None = None, chains: list[list[int]] | None = None) -> Tensor | None:
    """Rows ``at`` of a verify's ``outcome`` (B, C; q queries per row) as the outcome of a verify of each
    ``joining`` request that accepted nothing and chose its pending token (its prompt's last): m 0, that bonus
    token, no path, finite; with ``chains``, a follow-up's output (C = q + 4 + k) that found those chains. No one
    else reads those rows (padding, or a row that ended). ``more`` (n, k) int64: columns uploaded with them (one
    copy: a third upload in a step would wait for the first's copy, queued behind the verify), returned on the
    device."""
    c = outcome.shape[1]
    host = np.zeros((len(joining), c + 1 + (0 if more is None else more.shape[1])), dtype=np.int64)
    host[:, 1] = [req.tokens[-1] for req in joining]
    host[:, q + 2] = 1
    for row, chain in enumerate(chains or ()):  # (the follow-up's count column, then the chain)
        host[row, q + 3] = len(chain)
        host[row, q + 4:q + 4 + len(chain)] = chain
    host[:, c] = at
    if more is not None:
        host[:, c + 1:] = more
    dev = upload(host)
    outcome.index_copy_(0, dev[:, c], dev[:, :c].to(outcome.dtype))
    return None if more is None else dev[:, c + 1:]


@functools.lru_cache(maxsize=32)
def _node_offsets(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(n + 1,) positions of a static tree's root and nodes relative to the root's (0, then 1 + depth); made
    outside any capture, so a graph that reads one keeps it (``AdvanceGraphs``' entries keep their builder)."""
    depth = shape_rows(parents)[0]
    return torch.tensor([0] + (1 + depth).tolist(), dtype=torch.int64, device=device)
