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

One mechanism for every proposer; the hooks (``specdec.pipeline_hooks``) differ only in how they write the next
step's inputs: ``EagleAhead`` (the accepted path's KV moved, the draft program's catch-up, the next verify's
skeleton, then the draft program's replay) and ``ChainAhead`` (n-gram chains looked up on the device, and target-only
decoding with no chain: the next verify's whole bucket from the outcome and the chains, under any node budget).
Steps with sampled rows and with rows whose logits processors change are queued by both: the sampled rule runs right
behind the verify (its choices read each row's positions from the queued inputs), and the next step is built from its
outcome. Where a row's processed logits read its context (a penalty, bad words, ``min_tokens``:
``Request.reads_context``), the queued step's rule counts the tokens the step before commits, gathered on the device
from that step's outcome and inputs before the writer overwrites them (``repetition_penalty.committed_ahead``).

Requests that take a decode row at a step (``StepBatch.joining``: their prefill ended in it, or earlier when they
were prefilled ahead of a free row) join the step queued in that same step (``Drafter.joining``; EAGLE steps, decode
steps and n-gram chain steps, whose joining rows' first chains are looked up on the host): each enters as if it had
been a row of verify K that accepted nothing and chose its pending token, an outcome written into a row of verify K
that no one reads (a padding row, or the row of a request that ended). Without that, every admission would cost one
step without overlap: continuous batching admits a few rows at a time when rows end at different steps, as they do
when a draft's acceptance varies. The writers rewrite every part of a live row that a padding row holds as padding
(an EAGLE row's root mask and query count too), since a joining row may take a padding row. Prefill pieces and draft
forwards read inputs of their own (``GraphRunner.side_inputs``), so a prefill between verify K and the queue leaves
verify K's inputs, which the queued step's writer reads, as they were.
Nothing changes in what is computed: the device builds the inputs the host would have built (tests compare
them), so outputs are the same with and without the pipeline.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specdec.fused_step import DeviceDraft
from specdec.graphs import GraphCache
from specdec.repetition_penalty import committed_ahead

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
    on the device (tokens, parents, max depths, score ranks; ``FusedVerify.launch_draft``), ``draft``: its
    ``DeviceDraft``.
    ``lengths`` (R,): each row's length once the step before is committed (set by ``assume``);
    ``sel``: adopted by some of its rows, each adopting row's row here (None: all, in order)."""

    def __init__(self, rows: list, key: tuple, n: int, fwd, outcome: Tensor, wait, trees=None,
                 draft: DeviceDraft | None = None) -> None:
        self.rows, self.key, self.n, self.fwd, self.outcome, self.wait = rows, key, n, fwd, outcome, wait
        self.trees, self.draft = trees, draft
        self.lengths: np.ndarray | None = None
        self.sel: np.ndarray | None = None
        self.joined: tuple = ()  # its last rows, which the step before did not have (they took a row at that step)

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
        """Queue the step after ``step`` (launched, its read started) for ``rows`` (its rows, or those of them that
        adopted it) and the rows that took a decode row at this step (``Drafter.joining``: their prompt is
        done, and they decode from the next step), built on the device, with its verify and read; returns it
        (also ``ahead``), or None when nothing is queued: when joining rows do not fit the bucket, when a row
        lacks the KV blocks the queued step writes, or when the hook declines.

        A joining row enters as if it had been a row of ``step`` whose verify accepted nothing and chose its pending
        token (the prompt's last) as the bonus token: the hook writes such an outcome into a row of ``step`` no one
        reads (a padding row, or the row of one that ended), and the next step's inputs are built from it as from
        the others'."""
        drafter = self.drafter
        joining = list(drafter.joining)  # (set by the engine every step: none when no row took a decode row)
        if joining and (len(rows) + len(joining) > step.key[1] or any(len(r.tokens) < 2 for r in joining)):
            return None
        bs, need, every = self.runner.pool.block_size, drafter.lookahead, rows + joining
        if any(len(r.blocks) * bs < len(r.tokens) + need for r in every) or not self.hook.may_queue(every, step):
            return None
        # the joining rows' rows of ``step``: its padding rows and those of its rows that ended (no one reads them)
        taken = np.zeros(step.key[1], dtype=bool)
        taken[np.arange(len(rows)) if step.sel is None else step.sel] = True
        at = np.flatnonzero(~taken)[:len(joining)]
        ahead = None  # (what ``step`` commits, for rows whose processed logits read it: before the writer
        if any(r.reads_context for r in every):  # overwrites ``step``'s inputs)
            _, b, q = step.key
            ahead = committed_ahead(step.outcome, self.runner.graphs.inputs.views(b, q).ids.view(b, q), len(rows),
                                    step.sel, len(joining))
        nxt = self.hook.write_next(rows, step, self.upload, joining, at)
        if nxt is None:
            return None
        key, draft = nxt
        self.ahead = self.verifier.launch_queued(every, key, drafter.node_budget, draft, ahead)
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
