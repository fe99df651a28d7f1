"""Greedy verify steps queued on the device before the host reads the previous one.

A graphed greedy step ends with one device-to-host read of its outcome; the host then commits the accepted
tokens, applies stop rules and routes outputs while the GPU idles, and only then packs the next step. When
everything the next verify needs follows from this one's outcome and what the host already knows (each row's
length, block table and length limit), the next step can be written and launched on the device right away:
right behind this step's read, one captured launch (``ngram_ops.ngram_advance_reference``) writes the next
verify's whole input bucket from the outcome (the bonus token becomes the pending token, followed by the next
chain when there is one), the verify replays behind it, and its read starts. The host reads and commits this
step while the GPU runs the next.

At the next engine step the drafter adopts the queued verify (``adopt``) when its rows are among the queued
ones, each at the length the device assumed (rows that finished, failed or were preempted are left out and
their results not read; the others' successor is queued in their own bucket); a new row (after a prefill)
drops it. A dropped step wrote KV only past its rows' committed tokens, in blocks they held when it was
queued (the drafter's ``lookahead`` reserves the slots), so nothing it wrote is read.

Two users: the n-gram drafter's device lookups (``drafters.ngram_device.DeviceNgram``: the next chain comes
from the follow-up launch) and target-only decoding (``DecodePipeline``: no chain, the bonus token alone).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from specdec.drafters.ngram_ops import ngram_advance_reference
from specdec.lookahead import HostRead, HostUpload
from specdec.scheduler.request import Request
from specdec.verifier import QueuedVerify


class VerifyPipeline:
    """The queued-verify machinery of a ``Verifier.followup`` whose steps verify chains of up to ``k`` tokens
    (k = 0: decoding); ``drafter``: the drafter (its budget, ``lookahead`` and ``step_prefilled`` flag).
    Subclasses give ``launch`` and ``_follow`` (the device output a step's read returns: the outcome rows, then
    the chain columns if any) and ``_source`` (that output's fixed buffer, for a captured advance)."""

    def __init__(self, runner, drafter, k: int, pipeline: bool) -> None:
        self.runner, self.drafter, self.k, self.pipeline = runner, drafter, k, pipeline
        self.upload = HostUpload(runner.device)
        self.reader = HostRead(runner.device)
        self.capture = runner.device.type == "cuda"  # the advance behind a captured verify is a graph replay
        self.ahead: QueuedVerify | None = None  # the verify queued for the next step
        self.advances: dict[tuple, tuple] = {}  # (bucket, source bucket) -> (graph, tables buffer)
        self.assumed: dict[int, int] = {}  # id(request) -> its length once its last read step is committed
        self.launches = 0
        self.queued = self.adopted = self.dropped = 0  # queued verifies, and how many the next step adopted

    def min_query(self, rows: list[Request]) -> int:
        """Queries per row of a verify over ``rows`` whose successor may be queued: the whole chain's (the queued
        verify runs in the same bucket, whatever its chains' lengths); 0 when nothing would be queued."""
        return self.k + 1 if self.pipeline and all(r.params.plain_greedy for r in rows) else 0

    def consume(self, rows: list[Request], host: list[list[int]]) -> None:
        """A step's read, before its commit: each row's length once committed (its tokens + m accepted + the
        bonus token), the length a verify queued behind it assumed."""
        self.assumed = {id(req): len(req.tokens) + row[0] + 1 for req, row in zip(rows, host)}

    def committed(self, rows: list[Request]) -> None:  # noqa: B027 - optional hook (n-gram histories use it)
        """After the step's commit (``NgramDrafter.accepted``)."""

    def _follow(self, rows: list[Request], key, accept: Tensor) -> Tensor:
        raise NotImplementedError

    def _source(self, key) -> Tensor | None:
        raise NotImplementedError

    def _room(self, rows: list[Request], q: int) -> bool:
        """Whether the rows have room for what a queued step of ``q`` queries per row writes besides KV."""
        return True

    def queue(self, rows: list[Request], key, out: Tensor, sel: np.ndarray | None = None) -> None:
        """Queue the verify that follows the one of bucket ``key`` (whose read output is ``out``, its read already
        started) for ``rows``, built on the device, with its follow-up and read (``ahead``). ``sel``: each row's row
        of ``out`` when ``rows`` are some of that verify's rows (others finished); None: all of them, in order.
        Nothing is queued unpipelined, after a prefill (the rows' KV or lengths may differ from what the outcome
        says), under a budget below the chain, after a verify narrower than the chain, or when a row lacks the KV
        blocks (or other room) the queued step writes."""
        drafter = self.drafter
        if not self.pipeline or drafter.step_prefilled or drafter.node_budget != self.k or key[2] != self.k + 1:
            return
        bs, need = self.runner.pool.block_size, drafter.lookahead
        if any(len(r.blocks) * bs < len(r.tokens) + need for r in rows) or not self._room(rows, key[2]):
            return
        nxt_key = key if sel is None else self.runner.packed_key(0, len(rows), self.k + 1)
        if nxt_key is None or nxt_key[2] != key[2]:
            return
        r, b = len(rows), nxt_key[1]
        bt = self.runner.tables.host_rows([req.bt_row for req in rows])
        tables = np.zeros((b, bt.shape[1] + 4), dtype=np.int64)  # (padding rows: zeros, not live)
        tables[:r, :-4] = bt
        tables[:r, -4] = [len(req.prompt_ids) + req.params.max_new_tokens for req in rows]  # largest length
        tables[:r, -3] = [len(req.tokens) for req in rows]  # length at the verify of ``out``
        tables[:r, -2] = np.arange(r) if sel is None else sel  # row of ``out``
        tables[:r, -1] = 1
        self._advance(nxt_key, key, out, self.upload(tables))
        fwd = self.runner.graphs.replay(nxt_key)
        nxt = self._follow(rows, nxt_key, fwd.accept)
        self.ahead = QueuedVerify(list(rows), nxt_key, fwd, nxt, self.reader.start([nxt]))
        self.queued += 1

    def _advance(self, key, src_key, out: Tensor, tables: Tensor) -> None:
        """``ngram_advance_reference`` into bucket ``key``'s inputs from the read output ``out`` of the verify of
        bucket ``src_key``: one graph replay per (bucket, source bucket) when that output is a fixed buffer
        (``_source``: the captured graph reads it whole), else eagerly."""
        _, b, q = key
        inputs, bs = self.runner.graphs.inputs, self.runner.pool.block_size
        views = inputs.views(b, q)
        source = self._source(src_key) if self.capture and self.runner.graphs.captured(key) else None
        if source is None:
            ngram_advance_reference(views, b, q, out, tables, bs)
            return
        entry = self.advances.get((key, src_key))
        if entry is None:
            from specdec.graphs import capture_graph

            buf = torch.zeros_like(tables)
            saved = inputs.dev.clone()  # capturing runs it once (over a zero table): the inputs are put back
            try:
                graph, _ = capture_graph(functools.partial(ngram_advance_reference, views, b, q, source, buf, bs),
                                         None, self.runner.device)
            finally:
                inputs.dev.copy_(saved)
            entry = self.advances[(key, src_key)] = (graph, buf)
        graph, buf = entry
        buf.copy_(tables)
        graph.replay()

    def adopt(self, rows: list[Request]) -> QueuedVerify | None:
        """The queued verify when ``rows`` are all among its rows (others may have finished, failed or been
        preempted), each with the length the device assumed, with ``sel`` set when they are not exactly its rows
        in order; else None, and it is dropped."""
        queued, self.ahead = self.ahead, None
        if queued is None:
            return None
        at = {id(req): i for i, req in enumerate(queued.rows)}
        sel = [at.get(id(req), -1) for req in rows]
        assumed = self.assumed
        if (not rows or min(sel) < 0 or self.drafter.node_budget != self.k
                or any(assumed.get(id(req)) != len(req.tokens) for req in rows)):
            self.dropped += 1
            return None
        self.adopted += 1
        return queued if sel == list(range(len(queued.rows))) else queued._replace(sel=np.asarray(sel))


class DecodePipeline(VerifyPipeline):
    """Target-only greedy decoding pipelined: each graphed decode step queues the next (the bonus token as the
    next pending token) before the host reads it (``SpecConfig(pipeline=True)`` with no draft)."""

    def __init__(self, runner, drafter) -> None:
        super().__init__(runner, drafter, 0, True)

    def launch(self, rows: list[Request], key, fwd):
        """After the graphed decode ``fwd`` of bucket ``key`` over ``rows`` was launched: queue the next and return
        ``wait() -> (R, 4)``, this step's outcome read; None for sampled rows and eager steps."""
        if key is None or fwd.accept is None or not all(r.params.plain_greedy for r in rows):
            return None
        out = self._follow(rows, key, fwd.accept)
        wait = self.reader.start([out])
        self.queue(rows, key, out)
        return wait

    def _follow(self, rows: list[Request], key, accept: Tensor) -> Tensor:
        self.launches += 1
        return accept[:len(rows)]  # the outcome itself: no chain

    def _source(self, key) -> Tensor | None:
        graph = self.runner.graphs.graphs.get(key)
        return None if graph is None else graph[1].accept  # the captured verify's outcome buffer
