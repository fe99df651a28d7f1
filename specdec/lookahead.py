"""Pipelined fused EAGLE steps: the next step's device work is queued before the host reads this one's.

A fused greedy step (``specdec.fused_step``) ends with one device-to-host read; the host then commits the
accepted tokens, applies stop rules and routes outputs while the GPU waits, and only then prepares the next
step. But everything the next step's device work needs is already on the device after this step's verify:
each row's accepted path (node indices), bonus token and length, the kept tree's tokens, the verify's target
features, the rows' block tables. So right after launching verify K (and its read, into pinned memory), the
host queues step K + 1 built on the device from K's outcome (``advance``):

1. the accepted nodes' KV moves to its final slots (what ``commit_accepted`` does on the host otherwise);
2. the draft program's catch-up inputs: the path's tokens and the bonus token at positions L .. L + m, their
   KV slots, causal masks, and as their target features the verify's features of the pending token and the
   path (draft position p reads the target's features of p - 1);
3. the draft program, then the next verify's skeleton (the bonus token as the root at L + m, its queries'
   slots and lengths), the tree writer and the verify forward, then the read of its outcome.

The host then waits only for step K's read and does K's bookkeeping while the GPU runs step K + 1. At the next
engine step the drafter adopts step K + 1 (``PipelinedSteps._take_ahead``) when its rows are still running in
the state the device assumed, possibly fewer of them (a finished row's results are dropped); otherwise the
queued work is discarded (it only wrote KV past every live row's committed length, in blocks the rows still
hold).

Nothing changes in what is computed: the device builds exactly the inputs the host would have built
(``tests/test_lookahead.py`` compares them), so greedy outputs are identical with and without the pipeline.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specdec.fused_step import shape_rows
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


@torch.inference_mode()
def advance(vv: StepViews, bv: int, qv: int, accept: Tensor, tokens: Tensor, feats: Tensor, bt: Tensor,
            pv: StepViews, bp: int, qp: int, pfeats: Tensor, pool, block_size: int, n: int,
            node_offsets: Tensor | None, rows_op=None) -> None:
    """Write step K + 1's device inputs from verify K's outcome, for the first R rows.

    ``vv``: verify K's bucket (bv, qv) views (its root positions give the rows' lengths; rewritten with the
    next verify's skeleton); ``accept`` (R, qv + 3) its greedy outcome; ``tokens`` (R, n) the kept trees' node
    tokens; ``feats`` (bv * qv, k * H) the verify's target features; ``bt`` (R, W) int64 the rows' current
    block tables. ``pv``/``pfeats``: the draft program's bucket (bp, qp) views and feature buffer, written
    with the catch-up of each row's accepted path and bonus token. ``pool``: the accepted path's KV moves in
    it. ``node_offsets`` (n + 1,): a static tree's root and node positions relative to the root (None: a
    dynamic tree, whose node positions the tree writer derives from the root's). ``rows_op``: what writes the
    integer inputs (``advance_rows_reference``, or the one-launch Triton ``kernels.advance.advance_rows_triton``)."""
    op = rows_op or advance_rows_reference
    fsrc, src, dst = op(vv, bv, qv, accept, tokens, bt, pv, bp, qp, block_size, n, node_offsets)
    pool.move_slots(src, dst)
    # catch-up input j reads the target features of position L + j - 1 (verify query ``fsrc``, -1: none)
    r, width = tokens.shape[0], feats.shape[1]
    rows = torch.arange(r, device=feats.device)[:, None] * qv
    picked = feats.index_select(0, (rows + fsrc.clamp(min=0)).flatten()).view(r, qp, width)
    pfeats[:bp * qp].view(bp, qp, width)[:r] = torch.where((fsrc >= 0)[..., None], picked, 0).to(pfeats.dtype)


class AdvanceGraphs:
    """``advance`` as one CUDA graph replay per shape on CUDA (eagerly it is some 50 small launches, and the
    host launching them was the pipelined step's bottleneck at batch 1), eagerly elsewhere. A graph reads its
    own copies of the outcome, the trees and the block tables; the rest are the same buffers every step."""

    def __init__(self, device: torch.device, rows_op=None, capture: bool | None = None) -> None:
        self.device = torch.device(device)
        self.rows_op = rows_op  # ``advance``'s integer part (``kernels.advance.advance_rows``)
        self.capture = self.device.type == "cuda" if capture is None else capture  # (False: always eagerly)
        self.graphs: dict[tuple, tuple] = {}

    def __call__(self, inputs, vv: StepViews, bv: int, qv: int, accept: Tensor, tokens: Tensor, feats: Tensor,
                 bt: Tensor, pv: StepViews, bp: int, qp: int, pfeats: Tensor, pool, block_size: int, n: int,
                 node_offsets: Tensor | None, capture: bool = True) -> None:
        """``advance`` with the same arguments; ``inputs``: the ``StepInputs`` whose views ``vv`` are. ``capture``
        False (the verify's outputs are not a captured graph's fixed buffers): eagerly."""
        if not (self.capture and capture):
            advance(vv, bv, qv, accept, tokens, feats, bt, pv, bp, qp, pfeats, pool, block_size, n, node_offsets,
                    self.rows_op)
            return
        key = (bv, qv, tokens.shape[0], n, bp, qp, feats.data_ptr(), pfeats.data_ptr(), node_offsets is None)
        entry = self.graphs.get(key)
        if entry is None:
            from specdec.graphs import capture_graph

            # captured over a no-op outcome (nothing accepted: no KV moves); capturing runs it once, and that
            # run rewrites the verify rows it reads, so they are put back; everything else a real replay rewrites
            acc, tok, table = torch.zeros_like(accept), torch.zeros_like(tokens), bt.clone()
            saved = inputs.dev.clone()
            run = functools.partial(advance, vv, bv, qv, acc, tok, feats, table, pv, bp, qp, pfeats, pool,
                                    block_size, n, node_offsets, self.rows_op)
            try:
                graph, _ = capture_graph(run, None, self.device)
            finally:  # (also when capturing fails, e.g. out of memory: the step is retried on these rows)
                inputs.dev.copy_(saved)
            entry = self.graphs[key] = (graph, acc, tok, table, node_offsets)  # (the graph reads this tensor)
        graph, acc, tok, table, _ = entry
        acc.copy_(accept)
        tok.copy_(tokens)
        table.copy_(bt)
        graph.replay()


class Ahead:
    """A fused step queued before the host read the previous one: its rows (in order), verify bucket ``key``,
    budget ``n``, verify result ``fwd`` (device outputs, valid until the bucket's next verify), kept trees
    ``tokens`` (R, k) and ``parents`` ((R, k) device, or a static shape as a host tuple), ``wait() -> (R, C)``
    its host read ([tokens, parents (dynamic), accept]) and ``draft_seconds()`` (after ``wait``). ``accept``:
    its outcome on the device (the verify's greedy acceptance, sampled rows through the rule), which the step
    queued behind it reads; ``counters``: each sampled row's uniform stream and its counter before this step's
    draws (put back when the step is dropped). ``lengths`` (R,): each row's length once the previous step is
    committed (set when that step is read)."""

    def __init__(self, reqs: list, key: tuple, n: int, fwd, tokens: Tensor, parents, wait, draft_seconds,
                 accept: Tensor, counters: list) -> None:
        self.reqs, self.key, self.n, self.fwd = reqs, key, n, fwd
        self.tokens, self.parents, self.wait, self.draft_seconds = tokens, parents, wait, draft_seconds
        self.accept, self.counters = accept, counters
        self.lengths: np.ndarray | None = None

    def give_back_draws(self, kept: list) -> None:
        """Put back the draws of the rows not in ``kept`` (their queued step is not used)."""
        ids = {id(req) for req in kept}
        for req, counter in self.counters:
            if id(req) not in ids:
                req.stream.counter = counter


class PipelinedSteps:
    """The pipeline's part of ``EagleDrafter`` (its fused steps, ``_fused_proposal`` and bookkeeping)."""

    def enable_pipeline(self) -> None:
        """Queue each fused step's successor before the host reads it (``specdec.lookahead``); set before the
        scheduler reads ``lookahead``."""
        self.pipeline = True

    def _launch_ahead(self, key, reqs: list[Request], n: int, fwd, tokens, parents, bt: np.ndarray, accept):
        """Queue the fused step that follows the one just launched (``fwd``, trees ``tokens``/``parents``, outcome
        ``accept`` on the device) for the same rows, built on the device (``lookahead.advance``): its ``Ahead``,
        or None when the pipeline is off or a row lacks the blocks it would write (then nothing is queued)."""
        if not self.pipeline or self.fused is None or fwd.features is None or self.step_prefilled:
            return None  # (after a prefill the shared inputs changed, and a prefilled row may join the next step)
        if any(r.params.penalized for r in reqs):  # a repetition penalty reads the committed tokens on the host
            return None
        bs = self.runner.pool.block_size
        need = max(self.lookahead, 1)
        if any(len(r.blocks) * bs < len(r.tokens) + need for r in reqs):
            return None
        loop, fused = self.device_loop, self.fused
        r, (_, b, q) = len(reqs), key
        dev = self.runner.device
        bt_dev = self.upload(bt)
        k = tokens.shape[1]
        offsets = None if not isinstance(parents, tuple) else _node_offsets(parents, dev)
        inputs = self.runner.graphs.inputs
        self.advance(inputs, inputs.views(b, q), b, q, accept[:r], tokens, fwd.features.table, bt_dev,
                     loop.inputs.views(b, loop.q), b, loop.q, loop.features, self.runner.pool, bs, k, offsets,
                     capture=self.runner.graphs.captured(key))
        start = fused.clock.mark()
        out = loop.replay(b)[:r]
        drafted = fused.clock.mark()
        fwd2, tokens2, parents2, top2 = fused.relaunch(key, r, out, n)
        if parents2 is None:
            parents2 = parents
        counters = [(req, req.stream.counter) for req in reqs if not req.params.greedy]
        accept2 = fused.outcome(key, reqs, fwd2, tokens2.shape[1])  # (sampled rows draw their next numbers)
        wait = self.reader.start(self._read_list(tokens2, parents2, top2, accept2[:r]))
        self.ahead = Ahead(list(reqs), key, n, fwd2, tokens2, parents2, wait,
                           lambda: fused.clock.seconds(start, drafted), accept2, counters)
        return self.ahead

    def _take_ahead(self, rows: list[Request]) -> Proposal | None:
        """The queued step's proposal for ``rows`` when they are all among its rows, in the state it assumed
        (their lengths after the previous step's commit), under the same budget; else None (the queued work is
        dropped). Its successor is queued in turn when the rows are exactly its rows and no prefill ran."""
        a, self.ahead = self.ahead, None
        at = {id(req): i for i, req in enumerate(a.reqs)}
        sel = [at.get(id(req), -1) for req in rows]
        if not rows or min(sel) < 0 or a.lengths is None or a.n != self.node_budget or any(
                len(req.tokens) != a.lengths[i] for req, i in zip(rows, sel)):
            self.paths["dropped"] += 1
            a.give_back_draws([])
            return None
        a.give_back_draws(rows)
        self._consumed_through(rows)  # what the queued catch-up computed
        self.paths["ahead"] += 1
        self.paths["fused"] += 1
        lengths = np.fromiter((len(req.tokens) for req in rows), np.int64, len(rows))
        ahead = None
        exact = sel == list(range(len(a.reqs)))
        if exact:
            self.runner.sync_tables(rows)
            bt = self.runner.tables.host_rows([req.bt_row for req in rows])
            ahead = self._launch_ahead(a.key, rows, a.n, a.fwd, a.tokens, a.parents, bt, a.accept)
        return self._fused_proposal(a.wait(), a.tokens.shape[1], a.parents, a.fwd, a.draft_seconds(), ahead,
                                    lengths, None if exact else np.asarray(sel))


@functools.lru_cache(maxsize=32)
def _node_offsets(parents: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """(n + 1,) positions of a static tree's root and nodes relative to the root's (0, then 1 + depth); made
    outside any capture, so a graph that reads one keeps it (``AdvanceGraphs``' entries)."""
    depth = shape_rows(parents)[0]
    return torch.tensor([0] + (1 + depth).tolist(), dtype=torch.int64, device=device)
