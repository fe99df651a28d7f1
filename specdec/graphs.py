"""The graph service: every CUDA graph of a step is captured here (``capture_graph``), on memory pools this module
hands out, and reads constants whose lifetime it keeps (``graph_constant``).

``GraphRunner`` captures and replays model forwards per (model, batch bucket, query bucket) at engine start;
the parts of a step captured on first use (a queued step's input writer, the tree writer, the n-gram follow-up,
the sampled rule) keep their graphs in a ``GraphCache`` the runner made, so its report counts them too.

Every graphed forward reads the persistent inputs of ``StepInputs`` and writes a fixed-size
output: logits of every padded token and, for the target, the greedy acceptance of the whole
batch (``kernels.greedy_head`` and ``kernels.greedy_accept``: ``greedy_step_outcome``). Capture goes
largest bucket first into one shared memory pool; replay = fill the inputs (one copy),
``graph.replay()``. A step whose shape fits no bucket runs eagerly. Without CUDA (tests) the same
padded step runs eagerly over the same buffers, so everything but the capture itself is exercised
on the CPU.
"""

from __future__ import annotations

import functools
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from specdec.attention.base import AttnMetadata
from specdec.kernels.greedy_accept import greedy_accept
from specdec.kernels.greedy_head import greedy_head
from specdec.models.llama import ForwardContext
from specdec.step_inputs import DRAFT_MODEL_INDEX, PREFILL, PREFILL_QUERY, PackedRows, StepInputs, pack_rows

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_TREE_REGION = 64  # one int64 bitmask per query


@dataclass
class CaptureCount:
    """Every ``capture_graph`` call of this process: how many, and the seconds they took (warm-up forward, sync and
    capture). A benchmark reads it around a timed run: a capture there is one that engine start did not make."""

    graphs: int = 0
    seconds: float = 0.0


CAPTURED = CaptureCount()


def query_buckets_for(max_query: int) -> tuple[int, ...]:
    """Query buckets of a model whose steps have at most ``max_query`` tokens per row: the ``QUERY_BUCKETS``
    below it, then ``max_query`` itself (a chain:8 verify of 9 tokens per row pads to 9, not to 16)."""
    top = max(1, max_query)
    return tuple(q for q in QUERY_BUCKETS if q < top) + (top,)


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= n, or None when n exceeds them all."""
    return next((x for x in buckets if x >= n), None)


def capture_graph(forward, pool, device) -> tuple[torch.cuda.CUDAGraph, object]:
    """``forward()`` run once (it compiles the kernels of its shapes), then captured into a CUDA graph on
    memory pool ``pool``: (the graph, the output its replays rewrite).

    The garbage collector is held during the capture: a dead engine in a reference cycle, collected in the middle
    of a capture, would free its graphs and pinned buffers there and invalidate the capture (seen once on the
    H200: cudaErrorStreamCaptureInvalidated on the fifth engine of one process). Lazy captures (a pipelined
    step's advance, the tree writer, the n-gram follow-up) are held like the start-up ones."""
    start = time.perf_counter()
    forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    finally:
        if was_enabled:
            gc.enable()
    CAPTURED.graphs += 1
    CAPTURED.seconds += time.perf_counter() - start
    return graph, out


T = TypeVar("T")


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def graph_constant(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache(maxsize)`` for functions of hashable arguments returning read-only tensors, whose
    entries returned during a stream capture are never evicted (``held`` lists them).

    A captured graph replays the addresses its kernels read, and it does not keep the tensors behind them alive. A
    tensor from a plain ``functools.lru_cache`` that a graph read is freed when the cache evicts it; the allocator
    then hands its memory to other tensors and every later replay reads their bytes. (At batch 64 several engines
    in one process made more tree shapes than such a cache held; captured steps then read tree depths and masks
    from freed memory and faulted.) So every entry returned while a stream is being captured is kept for as long as
    the process lives; the rest are evicted as usual."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        held: dict[tuple, T] = {}

        @functools.wraps(fn)
        def get(*args):
            if args in held:
                return held[args]
            value = cached(*args)
            if capturing():
                held[args] = value
            return value

        get.held = held
        get.cache_info = cached.cache_info
        get.cache_clear = cached.cache_clear  # (the held entries stay: a graph may still read them)
        return get

    return wrap


class GraphCache(dict):
    """The graphs one part of a step captures on first use: key -> the part's entry (the graph and the buffers its
    replays read and write, kept alive as long as the graph). ``capture`` captures on the cache's pool: None, a
    private pool per graph; "own", one pool for all of this cache's graphs. Made by ``GraphRunner.cache`` (its
    report counts the cache), or alone for a part that runs without a runner."""

    def __init__(self, name: str, device, pool=None) -> None:
        super().__init__()
        self.name, self.device, self.pool = name, torch.device(device), pool

    def capture(self, forward) -> tuple[torch.cuda.CUDAGraph, object]:
        """``capture_graph(forward)`` on this cache's pool: (the graph, the output its replays rewrite); the
        caller stores its entry under its key."""
        if self.pool == "own":  # (made at the first capture; a CPU stand-in capture takes none)
            self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        return capture_graph(forward, self.pool, self.device)


def cache_for(graphs: GraphRunner | None, name: str, device, pool=None) -> GraphCache:
    """The ``GraphCache`` of part ``name``: made by ``graphs`` (counted in its report), or alone without one."""
    return graphs.cache(name, pool) if graphs is not None else GraphCache(name, device, pool)


class _TimingRow(NamedTuple):
    """A synthetic verify row (the fields ``StepInputs.fill`` reads) for ``GraphRunner.measure_costs``."""

    token_ids: list[int]
    positions: list[int]
    prefix_len: int
    seq_len: int
    tree_mask: list[int] | None
    parents: list[int]


class GraphOutput(NamedTuple):
    logits: torch.Tensor | None  # (B*Q, V) padded layout: the target's in its dtype (read rows as float32), a
    # draft's float32 (a feature-reading draft: its own vocabulary); a prefill: None
    accept: torch.Tensor | None  # (B, Q + 3) int64: greedy acceptance, then 1 if the row's logits are finite
    features: torch.Tensor | None = None  # target: (B*Q, k * hidden) outputs of its aux layers, if any
    hidden: torch.Tensor | None = None  # feature-reading draft: (B*Q, hidden) states, its children's input


@dataclass
class CaptureReport:
    """What capturing cost: graphs, seconds and bytes of the shared memory pool; ``warm_up_seconds``: the
    engine's warm-up run, which captures the graphs keyed by what a step holds (``specdec.warm_up``)."""

    graphs: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    warm_up_seconds: float = 0.0
    parts: dict[str, int] = field(default_factory=dict)  # graphs of the parts captured on first use, by part

    def __str__(self) -> str:
        parts = ", ".join(f"{n} {name}" for name, n in self.parts.items() if n)
        return (f"{self.graphs} CUDA graphs captured in {self.seconds:.2f} s, pool {self.pool_bytes / 2**20:.0f} MiB, "
                f"warm-up {self.warm_up_seconds:.2f} s" + (f" (it captured {parts})" if parts else ""))


class GraphRunner:
    """Replays captured forwards of the models in ``models`` (pool model index -> model).

    ``aux_layers``: the target (model 0) also returns the outputs of these decoder layers (the
    features an EAGLE draft reads). A model with ``reads_features`` (an EAGLE draft) takes, besides
    ids and positions, one feature row per token, written into its graph input by ``run``.
    """

    def __init__(self, models: dict, pool, backend, max_batch: int, max_query: dict[int, int],
                 bt_width: int, device: torch.device, aux_layers: tuple[int, ...] = ()) -> None:
        self.models, self.pool, self.backend = models, pool, backend
        self.aux_layers = tuple(aux_layers)
        self.device = torch.device(device)
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (bucket(max_batch, BATCH_BUCKETS)
                                                                              or max_batch,)
        self.query_buckets = {m: query_buckets_for(mq) for m, mq in max_query.items()}
        if 0 in models:  # prompts are prefilled in pieces of PREFILL_QUERY tokens, as rows of one replay
            self.query_buckets[PREFILL] = (PREFILL_QUERY,)
        self._batch_of = [bucket(n, self.batch_buckets) for n in range(max(self.batch_buckets) + 1)]
        self._query_of = {m: [bucket(n, qs) for n in range(max(qs) + 1)] for m, qs in self.query_buckets.items()}
        top_q = {m: max(qs) for m, qs in self.query_buckets.items()}
        self.inputs = StepInputs(max(self.batch_buckets), top_q.get(0, 1), bt_width, self.device)  # target steps
        # prefill pieces and draft forwards write inputs of their own: a prefill between a verify and the step
        # queued behind it leaves the verify's inputs (which the queued step's writer reads) as they were
        side_q = max((q for m, q in top_q.items() if m != 0), default=1)
        self.side_inputs = StepInputs(max(self.batch_buckets), side_q, bt_width, self.device)
        self.max_seq_len = bt_width * pool.block_size
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, GraphOutput]] = {}
        self.programs: list = []  # more device programs captured with these graphs (``capture(pool) -> (n, s)``)
        self.caches: list[GraphCache] = []  # the parts of a step captured on first use
        self.report = CaptureReport()
        top_t = max(self.batch_buckets) * side_q  # (draft models' keys)
        self.feature_inputs = {m: torch.zeros(top_t, model.config.hidden_size, device=self.device,
                                              dtype=next(model.parameters()).dtype)
                               for m, model in models.items() if getattr(model, "reads_features", False)}

    def cache(self, name: str, pool=None) -> GraphCache:
        """A new ``GraphCache`` for the part of a step called ``name``, counted in ``parts``."""
        cache = GraphCache(name, self.device, pool)
        self.caches.append(cache)
        return cache

    def parts(self) -> dict[str, int]:
        """Graphs captured so far by the parts captured on first use, by part name."""
        counts: dict[str, int] = {}
        for c in self.caches:
            counts[c.name] = counts.get(c.name, 0) + len(c)
        return counts

    def key_for(self, model_idx: int, rows) -> tuple[int, int, int] | None:
        """(model, B bucket, Q bucket) for these rows, or None when they must run eagerly."""
        longest = max(len(r.token_ids) for r in rows)
        if longest > 1 and any(r.seq_len - r.prefix_len > MAX_TREE_REGION for r in rows):
            return None
        return self.key_of(model_idx, len(rows), longest)

    def key_of(self, model_idx: int, n_rows: int, longest: int) -> tuple[int, int, int] | None:
        """``key_for`` of ``n_rows`` rows of at most ``longest`` queries whose masked regions are at most
        ``MAX_TREE_REGION`` tokens long (verify rows always are)."""
        query_of = self._query_of.get(model_idx)
        if query_of is None or n_rows >= len(self._batch_of) or longest >= len(query_of):
            return None
        return model_idx, self._batch_of[n_rows], query_of[longest]

    def run(self, key: tuple[int, int, int], rows, slots, bt_rows, features=None) -> GraphOutput:
        """Fill the inputs of ``key`` with ``rows`` and run its forward (replayed when captured).
        ``features``: a feature-reading model's (index (T,) of each packed token in the padded layout,
        feature rows (T, hidden))."""
        return self.run_packed(key, pack_rows(rows, slots, key[2]), bt_rows, features)

    def run_packed(self, key: tuple[int, int, int], packed: PackedRows, bt_rows, features=None,
                   on_device=None) -> GraphOutput:
        """``run`` for rows already flattened into ``packed`` (laid out for ``key``'s query bucket);
        ``on_device(views)`` may write more of the inputs on the device (after the host copy) first."""
        m, b, q = key
        inputs = self.inputs_of(m)
        inputs.fill_packed(b, q, packed, bt_rows)
        if on_device is not None:
            on_device(inputs.views(b, q))
        if m in self.feature_inputs:
            where, g = features
            self.feature_inputs[m][:b * q].index_copy_(0, where, g.to(self.feature_inputs[m].dtype))
        return self.replay(key)

    def inputs_of(self, model_idx: int) -> StepInputs:
        """The input buffers the graphs of ``model_idx`` read: ``inputs`` for the target's steps (model 0),
        ``side_inputs`` for prefill pieces and draft models."""
        return self.inputs if model_idx == 0 else self.side_inputs

    def captured(self, key: tuple[int, int, int]) -> bool:
        """``key``'s forward is a captured graph (its outputs are the same buffers at every replay)."""
        return key in self.graphs

    def outcome_buffer(self, key: tuple[int, int, int]):
        """The greedy outcome buffer of ``key``'s captured forward (what a queued decode step is built from), or
        None when ``key`` has no graph."""
        entry = self.graphs.get(key)
        return None if entry is None else entry[1].accept

    def replay(self, key: tuple[int, int, int]) -> GraphOutput:
        """Run ``key``'s forward over its inputs as they are now on the device (replayed when captured)."""
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return out
        return self._forward(key)

    def capture(self) -> CaptureReport:
        """Capture every (model, B, Q) bucket, largest first, into one memory pool (CUDA only)."""
        if self.device.type != "cuda":
            return self.report
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        # Graphs of one memory pool share the memory of their intermediates, so a replay may overwrite the outputs
        # of another graph of its pool captured after it. The target's verifies (and the device programs) keep
        # their outputs (outcome, features, trees) across a prefill: a step queued behind verify K is written from
        # them after the next step's prefill pieces ran. Prefill pieces and draft forwards (whose outputs are read
        # at once) therefore capture into a pool of their own.
        mempool, side_pool = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
        keys = [(m, b, q) for m, qs in self.query_buckets.items() for b in self.batch_buckets for q in qs]
        gc.collect()  # dead engines' graphs and buffers go first; ``capture_graph`` holds the collector in each capture
        for key in sorted(keys, key=lambda k: (k[1] * k[2], k[1]), reverse=True):
            self.inputs_of(key[0]).clear(key[1], key[2])
            self.graphs[key] = capture_graph(functools.partial(self._forward, key),
                                             mempool if key[0] == 0 else side_pool, self.device)
        extra = sum(program.capture(torch.cuda.graph_pool_handle())[0] for program in self.programs)  # (pools of
        # their own: a verify replayed after a program must leave the trees it wrote, which a queued step reads)
        torch.cuda.synchronize(self.device)
        self.report = CaptureReport(len(self.graphs) + extra, time.perf_counter() - start,
                                    torch.cuda.memory_reserved(self.device) - before, sorted(self.graphs))
        log.info("%s", self.report)
        return self.report

    def measure_costs(self, model_idx: int = 0, context: int = 256, repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds of one forward of pool model ``model_idx`` per (batch bucket, query bucket): the median of
        ``repeats`` timed runs over full rows of ``context`` cached tokens (the KV is read, never written:
        every slot is padding). Captured graphs are replayed and timed with CUDA events; other buckets
        run eagerly, timed on the host."""
        costs = {}
        for b in self.batch_buckets:
            for q in self.query_buckets.get(model_idx, ()):
                self._fill_timing_rows(model_idx, b, q, max(1, min(context, self.max_seq_len - q)))
                key = (model_idx, b, q)
                self._timed(key)  # warm-up
                costs[(b, q)] = statistics.median(self._timed(key) for _ in range(repeats))
        return costs

    def _fill_timing_rows(self, model_idx: int, b: int, q: int, context: int) -> None:
        from specdec.runner import as_signed, causal_bits

        bs, width = self.pool.block_size, self.inputs.width
        nblk = min(-(-(context + q) // bs), width)
        row = _TimingRow([1] * q, list(range(context, context + q)), context, context + q,
                         as_signed(causal_bits(q, q)) if q > 1 else None, [-1] + list(range(q - 1)))
        bt = np.zeros((b, width), dtype=np.int32)
        bt[:, :nblk] = np.arange(nblk) % self.pool.num_blocks
        self.inputs_of(model_idx).fill(b, q, [row] * b, [[-1] * q] * b, bt)

    def _timed(self, key: tuple[int, int, int]) -> float:
        if key not in self.graphs:
            sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *_: None)
            sync(self.device)
            start = time.perf_counter()
            self._forward(key)
            sync(self.device)
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graphs[key][0].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @torch.inference_mode()
    def _forward(self, key: tuple[int, int, int]) -> GraphOutput:
        m, b, q = key
        v = self.inputs_of(m).views(b, q)
        meta = AttnMetadata(
            query_start_loc=v.qsl, prefix_lens=v.prefix_lens, seq_lens=v.seq_lens, block_tables=v.block_tables,
            slot_mapping=v.slots, block_size=self.pool.block_size, tree_mask=None if q == 1 else v.tree_mask,
            max_query_len=q, max_seq_len=self.max_seq_len)
        model = self.models[max(m, 0)]
        ctx = ForwardContext(self.backend, meta, self.pool.model_kv(max(m, 0)))
        if m == PREFILL:  # the KV (and the features an EAGLE draft reads), then the draft's KV; no logits
            aux = None
            if self.aux_layers:
                aux = model.forward_features(v.ids, v.positions, ctx, self.aux_layers)[1]
                self.pool.store_features(v.slots, aux)  # (what the EAGLE draft reads, per slot)
            else:
                model(v.ids, v.positions, ctx)
            if DRAFT_MODEL_INDEX in self.models:
                self._draft_prefill(v, b, q, meta)
            return GraphOutput(None, None, aux)
        if m in self.feature_inputs:  # an EAGLE draft: hidden states and its own-vocabulary logits
            hidden = model(v.ids, v.positions, ctx, self.feature_inputs[m][:b * q])  # (B*Q, H)
            return GraphOutput(model.compute_logits(hidden), None, None, hidden)
        aux = None
        if m == 0 and self.aux_layers:
            hidden, aux = model.forward_features(v.ids, v.positions, ctx, self.aux_layers)  # (B*Q, H), (B*Q, kH)
            self.pool.store_features(v.slots, aux)
        else:
            hidden = model(v.ids, v.positions, ctx)  # (B*Q, H)
        if m != 0:
            return GraphOutput(model.compute_logits(hidden), None)
        # The target's logits stay in the model's dtype (what its LM head computes): greedy rows need only
        # the argmax and finite check of one fused pass; rows that sample read float32 copies of theirs.
        logits = model.compute_logits(hidden, dtype=None)  # (B*Q, V)
        triton = self.backend.uses_triton
        argmax, finite = greedy_head(logits, use_triton=triton)  # (B*Q,), (B*Q,)
        accept = greedy_accept(v.ids.view(b, q), v.parents.view(b, q), v.tree_mask.view(b, q), argmax.view(b, q),
                               finite.view(b, q), v.num_tokens, use_triton=triton)  # (B, Q + 3)
        return GraphOutput(logits, accept, aux)

    def _draft_prefill(self, v, b: int, q: int, meta: AttnMetadata) -> None:
        """The draft's KV of the prefill pieces ``v`` (bucket (b, q)), right after the target's forward over them in
        the same replay: one launch sequence instead of the draft's own pieces, its host packing and its logits
        (nobody reads a prefill's). An EAGLE draft's input at position p is the target features of p - 1, found
        through the pieces' block tables in the pool's feature rows (those the target just wrote, or earlier
        chunks'), the zero row for position 0 and for a released block: what ``SlotFeatures.sources`` gives."""
        draft = self.models[DRAFT_MODEL_INDEX]
        ctx = ForwardContext(self.backend, meta, self.pool.model_kv(DRAFT_MODEL_INDEX))
        if not getattr(draft, "reads_features", False):
            draft(v.ids, v.positions, ctx)
            return
        rows = self.pool.feature_rows_on_device(v.block_tables, v.positions.view(b, q) - 1)  # (b, q): of p - 1
        aux = self.pool.features.index_select(0, rows.flatten())  # (b * q, k * hidden)
        draft(v.ids, v.positions, ctx, draft.fuse(aux.to(draft.fc.weight.dtype)))
