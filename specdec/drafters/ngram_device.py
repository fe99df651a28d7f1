"""n-gram drafting on the device, for graphed steps of many rows (greedy and sampled).

On the host an n-gram step looks up every row's chain in dictionaries before the verify can be launched, and
writes the new tokens' n-grams after it: host work on every step's critical path, the largest part of what
makes a host n-gram step dearer than a decode step at large batches.

Here each row's token history also lives in a device buffer (one row per block-table row). Right behind a
graphed verify, one launch (``kernels.ngram_follow``) appends each row's accepted tokens and bonus token
to its history and looks up the row's next chain there; the chains come back in the step's one device-to-host
read, beside the verify's outcome, and the drafter proposes them at the next step without a lookup. A row
whose history is behind (a new request, or after steps that did not run this) is caught up by one upload.

Pipelined (``SpecConfig.pipeline``, on by default on CUDA), the step after is queued right behind the follow-up
(``specdec.pipeline``, ``ChainAhead``), under whatever node budget the step has: its inputs are written on the
device from the outcome and the chains (the bonus token, then the chain cut to the budget and to the tokens still to
come), and its verify and follow-up replay before the host reads this step, so the host commits this step while the
GPU runs the next. The follow-up looks up chains of the longest length (``k``), so the next budget's chains are
ready. A decode step (budget 0) runs no follow-up: its outcome alone is read, as target-only decoding's, and the
histories fall behind; the first step of a budget above 0 (a change of budget drops the queued step, so it is a
fresh step) catches them up in its follow-up launch. When the device serves every step (from one row on:
``NgramDrafter.device_only``) the host indexes no text at all: a row the device has no chain for yet (its first
step, or that first step after decode steps) proposes none.

The device looks only in the row's own text (``ngram_lookup``'s semantics exactly), not in other requests'
(``SharedNgrams``). Unpipelined, the host path with the shared table accepts more per step, which is worth more
than the lookup time at small batches, so the device lookup runs only from ``min_rows`` rows on. Pipelined it runs
at every batch size: overlapping the host's work with the next verify is worth more than the shared table's
longer matches, even at batch 1. Drafts differ from the host's only where the shared table would have found a
longer match; outputs never differ (every chain is verified).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from specdec.graphs import cache_for
from specdec.kernels.ngram_follow import ngram_follow
from specdec.pipeline import HostUpload
from specdec.plan import NGRAM_DEVICE_MIN_ROWS
from specdec.scheduler.request import Request


class DeviceNgram:
    """The device histories and the follow-up launch of an ``NgramDrafter`` (``Verifier.followup``).

    ``chains``: per request, (the token count its chain was looked up at, the chain); the drafter proposes a
    chain when the request still has that many tokens. ``launches`` counts follow-up launches."""

    def __init__(self, runner, max_rows: int, max_len: int, k: int, max_n: int, min_n: int,
                 min_rows: int = NGRAM_DEVICE_MIN_ROWS, budget=None) -> None:
        self.runner, self.k, self.max_n, self.min_n, self.min_rows = runner, k, max_n, min_n, min_rows
        self.budget = budget  # () -> the step's node budget (the drafter's); at 0 nothing runs behind the verify
        self.upload = HostUpload(runner.device)
        self.capture = runner.device.type == "cuda"  # the follow-up behind a captured verify is a graph replay
        self.launches = 0
        self.hist = torch.zeros(max_rows, max_len, dtype=torch.int32, device=runner.device)  # (rows, W) tokens
        self.held: dict[Request, int] = {}  # request -> tokens its history row holds (while it owns the row)
        self.owner: list[Request | None] = [None] * max_rows  # block-table row -> the request whose history it holds
        self.chains: dict[Request, tuple[int, list[int]]] = {}
        # (b, q) -> [graph, rows buffer, output, the rows it holds]
        self.graphs = cache_for(runner.graphs, "n-gram follow-up", self.hist.device)
        self._prune_at = 4 * max_rows

    def launch(self, rows: list[Request], key, fwd) -> Tensor | None:
        """After the graphed verify ``fwd`` of bucket ``key`` over ``rows`` was launched: launch the follow-up and
        return its output (R, Q + 4 + k) on the device (the outcome rows first), to read instead of ``fwd.accept``
        (sampled rows' outcome already there: the verifier launches this behind them only when pipelined); None when
        it does not apply (too few rows not yet on the device, a row longer than the history buffer, or an eager
        step)."""
        if key is None or fwd.accept is None:
            return None
        if self.decoding:  # (the outcome itself, as target-only decoding reads it: no history read or written)
            return self.follow(rows, key, fwd.accept)
        if not self.serves(rows, key[2]):
            return None
        if len(rows) < self.min_rows and not all(self.owner[r.bt_row] is r for r in rows):
            return None
        self._catch_up(rows)
        return self.follow(rows, key, fwd.accept)

    def serves(self, rows: list[Request], q: int) -> bool:
        """The follow-up can run behind a verify of ``rows`` with ``q`` queries per row: every row's history row
        holds its tokens and the verify's (else the host path)."""
        return max(len(r.tokens) for r in rows) + q <= self.hist.shape[1]

    @property
    def decoding(self) -> bool:
        """This step's budget is 0: no chain is proposed next, so no follow-up runs (``follow``)."""
        return self.budget is not None and self.budget() == 0

    def follow(self, rows: list[Request], key, accept: Tensor) -> Tensor:
        """The follow-up of the verify of bucket ``key`` whose outcome is ``accept``: (R, Q + 4 + k) on the device;
        at budget 0 the outcome itself (R, Q + 3), as target-only decoding reads it."""
        _, b, q = key
        r = len(rows)
        self.launches += 1
        if self.decoding:
            return accept[:r]
        if self.capture and self.runner.graphs.captured(key):  # the verify's outputs are fixed buffers
            return self._replay(b, q, rows, accept)
        views = self.runner.graphs.inputs.views(b, q)
        bt_rows = self.upload(np.fromiter((req.bt_row for req in rows), np.int64, r))
        return ngram_follow(self.hist, bt_rows, views.ids.view(b, q)[:r], views.positions.view(b, q)[:r], accept[:r],
                            self.k, self.max_n, self.min_n, use_triton=self.runner.backend.uses_triton)

    def room(self, rows: list[Request], q: int) -> bool:
        """The history rows hold what a queued step appends (two verifies' worth past the rows' tokens)."""
        return self.decoding or max(len(r.tokens) for r in rows) + 2 * q <= self.hist.shape[1]

    def source(self, key) -> Tensor | None:
        """The follow-up graph's whole output behind the verify of bucket ``key`` (a fixed buffer), or None; at
        budget 0 the verify's outcome buffer (its bucket, of one query, is only ever verified at budget 0)."""
        if self.decoding:
            return self.runner.graphs.outcome_buffer(key)
        entry = self.graphs.get(key[1:])
        return None if entry is None else entry[2]  # the follow-up graph's whole output

    def _replay(self, b: int, q: int, rows: list[Request], accept: Tensor) -> Tensor:
        """The follow-up of bucket (b, q) as a graph replay (captured at its first use, over the bucket's input
        views, the verify graph's outcome buffer ``accept`` and a rows buffer padded with -1)."""
        entry = self.graphs.get((b, q))
        if entry is None:
            views = self.runner.graphs.inputs.views(b, q)
            rows_buf = torch.full((b,), -1, dtype=torch.int64, device=self.hist.device)  # -1: nothing is written
            run = functools.partial(ngram_follow, self.hist, rows_buf, views.ids.view(b, q), views.positions.view(b, q),
                                    accept, self.k, self.max_n, self.min_n, use_triton=self.runner.backend.uses_triton)
            graph, out = self.graphs.capture(run)
            entry = self.graphs[(b, q)] = [graph, rows_buf, out, None]
        graph, rows_buf, out, last = entry
        padded = np.full(b, -1, dtype=np.int64)
        padded[:len(rows)] = [req.bt_row for req in rows]
        if last is None or not np.array_equal(padded, last):  # (pipelined steps replay the same rows: no upload)
            rows_buf.copy_(self.upload(padded))
            entry[3] = padded
        graph.replay()
        return out[:len(rows)]

    def join(self, rows: list[Request], chains: list[list[int]]) -> None:
        """Rows whose prefill just ended join a queued chain step (``pipeline_hooks.ChainAhead``) with ``chains`` (their
        first, looked up on the host): their histories are uploaded now (the queued step's follow-up appends to them
        and looks their next chains up), and the drafter proposes them the chains that step verifies."""
        self._catch_up(rows)
        self.chains.update((req, (len(req.tokens), chain)) for req, chain in zip(rows, chains))

    def _catch_up(self, rows: list[Request]) -> None:
        """Upload the tokens each row's device history lacks (all of them for a request new to its block-table row:
        a new request, or one that was preempted and got a row back), up to the pending token, in one copy and one
        scatter."""
        held, owner, parts = self.held, self.owner, []
        for req in rows:
            if owner[req.bt_row] is req:
                n = min(held[req], len(req.tokens))
            else:
                n, owner[req.bt_row] = 0, req
            if n < len(req.tokens):
                toks = req.tokens[n:]
                parts.append(np.array([[req.bt_row] * len(toks), range(n, len(req.tokens)), toks], dtype=np.int64))
                held[req] = len(req.tokens)
        if parts:
            where = self.upload(np.concatenate(parts, 1))  # (3, T): rows, positions, tokens
            self.hist[where[0], where[1]] = where[2].to(self.hist.dtype)

    def consume(self, rows: list[Request], host: list[list[int]]) -> None:
        """Record, from the follow-up's output read as ``host`` (row i: the outcome [m, bonus, ...], then
        [count, tokens...]), each row's chain and what its history holds: its tokens before the step (called before
        the commit) + m accepted + the bonus token (``committed`` corrects it when the commit was cut short). At
        budget 0 (``host`` is the outcome alone) nothing: the histories fell behind."""
        if self.decoding:
            return
        held, chains = self.held, self.chains
        for req, row in zip(rows, host):
            n, c = len(req.tokens) + row[0] + 1, len(row) - 1 - self.k  # c: the count's column
            held[req] = n
            chains[req] = (n, row[c + 1:c + 1 + row[c]])
        if len(held) > self._prune_at:
            for old in [r for r in held if r.finished]:
                held.pop(old, None)
                chains.pop(old, None)
            self._prune_at = 2 * len(held) + 64

    def committed(self, rows: list[Request]) -> None:
        """After the step's commit: a commit cut short (a stop ends the row inside the accepted tokens) leaves the
        history's valid prefix, so a row that goes on is caught up from there. Nothing at budget 0: ``consume``
        recorded nothing, so no history holds more than its row's tokens."""
        if self.decoding:
            return
        held = self.held
        for req in rows:
            n = held.get(req)
            if n is not None and len(req.tokens) < n:
                held[req] = len(req.tokens)
