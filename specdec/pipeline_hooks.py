"""The hooks of ``pipeline.StepPipeline``: how each proposer writes the step queued behind a verify on the device.

- ``EagleAhead``: the accepted path's KV moves to its final slots, the draft program's catch-up rows are the
  path's tokens and the bonus token with the verify's features as inputs, the next verify's skeleton puts the
  bonus token at L + m as the root; then the draft program replays (``advance``: ``lookahead_ops``,
  ``kernels/advance.py``); at budget 0 its steps are queued as plain decoding's (a ``ChainAhead`` of no chain);
- ``ChainAhead``: n-gram chains looked up on the device (``drafters.ngram_device.DeviceNgram``) and target-only
  decoding (``DecodeFollow``: no chain): the next verify's whole bucket from the outcome and the chains;
- ``join_outcome``: rows whose prefill just ended enter a queued step as rows of the verify before it that
  accepted nothing.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specdec.drafters.ngram_ops import ngram_advance_reference
from specdec.fused_step import DeviceDraft
from specdec.graphs import cache_for
from specdec.kernels.advance import advance_rows
from specdec.lookahead_ops import advance_rows_reference
from specdec.pipeline import AdvanceGraphs, QueuedStep
from specdec.step_inputs import StepViews
from specdec.tree_writer import shape_rows

if TYPE_CHECKING:
    from specdec.drafters.base import Proposal
    from specdec.scheduler.request import Request


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
        target features), adopted by all its rows or some (those that go on are gathered from their rows of it)."""
        if self.decoding:
            return step.trees is None and self.decode.may_queue(rows, step)
        return step.trees is not None and step.fwd.features is not None

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
        tokens, parents = step.trees[:2]
        offsets = None if not isinstance(parents, tuple) else node_offsets(parents, runner.device)
        inputs, pool, bs, k = runner.graphs.inputs, runner.pool, runner.pool.block_size, tokens.shape[1]
        vv, pv, feats, pfeats = inputs.views(b, q), loop.inputs.views(b, loop.q), step.fwd.features.table, loop.features
        if joining:  # each as a row ``at`` of ``step`` whose verify (root at L - 2) accepted nothing, chose L - 1
            n = len(joining)
            if tokens.shape[0] < step.key[1]:  # (their trees: none; the rows read past ``step``'s own)
                tokens = torch.cat([tokens, tokens.new_zeros(step.key[1] - tokens.shape[0], k)])
            before = np.fromiter((len(req.tokens) - 2 for req in joining), np.int64, n)
            dev = join_outcome(step.outcome, at, joining, q, upload,
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
        """The budget's queries (n + 1: the queued verify runs in the same bucket, whatever its chains' lengths),
        greedy and sampled rows alike, processed or not (the queued step's rule applies their processors too)."""
        return self.nodes + 1

    def may_queue(self, rows: list[Request], step: QueuedStep) -> bool:
        """Behind a verify in its budget's bucket, with room in the n-gram histories for what the queued step
        appends."""
        key = self.runner.packed_key(0, len(step.rows), self.nodes + 1, self.drafter.target_features)
        return key is not None and step.key[2] == key[2] and self.follow.room(rows, step.key[2])

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
            join_outcome(outcome, at, joining, q, upload, chains=chains)
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
def join_outcome(outcome: Tensor, at: np.ndarray, joining: list[Request], q: int, upload,
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
def node_offsets(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(n + 1,) positions of a static tree's root and nodes relative to the root's (0, then 1 + depth); made
    outside any capture, so a graph that reads one keeps it (``AdvanceGraphs``' entries keep their builder)."""
    depth = shape_rows(parents)[0]
    return torch.tensor([0] + (1 + depth).tolist(), dtype=torch.int64, device=device)
