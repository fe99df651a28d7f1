"""Runs one model forward over a packed batch of rows on the shared KV pool."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from specdec.attention.base import AttentionBackend, AttnMetadata
from specdec.kvcache.block_table import BlockTables
from specdec.kvcache.pool import KVPool
from specdec.models.llama import ForwardContext, LlamaForCausalLM
from specdec.scheduler.request import Request
from specdec.step_inputs import DRAFT_MODEL_INDEX, PREFILL, PREFILL_QUERY, PackedRows

MAX_TREE_REGION = 64
MAX_PIECE_REPLAYS = 4  # the most graph replays a long draft forward is cut into (``ModelRunner._graphed_pieces``)


@dataclass
class RowInput:
    """The queries of one row: tokens, RoPE positions and where in the region they sit.

    The row sees logical positions [0, seq_len); [prefix_len, seq_len) is the masked region
    and the queries are its last len(token_ids) positions. ``tree_mask`` holds one bitmask
    over the region per query, or None for causal.
    """

    req: Request
    token_ids: list[int]
    positions: list[int]
    prefix_len: int
    seq_len: int
    tree_mask: list[int] | None = None
    want_logits: str = "last"  # "last", "all" or "none"
    parents: list[int] | None = None  # verify rows: each query's parent query index (-1 = root)


class ForwardResult(NamedTuple):
    """Per-row logits (as asked by ``want_logits``) and, from a graphed target forward, the batch's
    greedy acceptance (``accept_greedy_padded``, on the device) — None when the step ran eagerly."""

    logits: Sequence[torch.Tensor | None]
    accept: torch.Tensor | None
    features: RowSlices | None = None  # per row (n, k * hidden) outputs of the asked decoder layers
    draft_kv: bool = False  # prefill rows: the draft's KV of them was written too (``GraphRunner._draft_prefill``)


class RowSlices:
    """Per-row slices of one table whose row i starts at ``starts[i]`` and has ``lengths[i]`` entries
    (packed rows of an eager forward or padded rows of a graphed one). ``take`` reads chosen
    entries of every row with one indexing op instead of one per row."""

    def __init__(self, table: torch.Tensor, starts: list[int], lengths: list[int]) -> None:
        self.table, self.starts, self.lengths = table, starts, lengths

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.table[self.starts[i]:self.starts[i] + self.lengths[i]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def take(self, flat: np.ndarray) -> torch.Tensor:
        """Entries ``flat`` (table indices, int64: a row's entry j is at ``starts[i] + j``) of the table, one
        indexing op."""
        return self.table[torch.from_numpy(flat).to(self.table.device, non_blocking=True)]  # (no stream sync)


def causal_bits(region_len: int, n_query: int) -> list[int]:
    """Bitmasks equal to a causal mask for the last ``n_query`` positions of a region."""
    return [(1 << (r + 1)) - 1 for r in range(region_len - n_query, region_len)]


class ModelRunner:
    """Builds ``AttnMetadata`` for rows of requests and runs a model over them."""

    def __init__(self, pool: KVPool, tables: BlockTables, backend: AttentionBackend, device) -> None:
        self.pool, self.tables, self.backend = pool, tables, backend
        self.device = torch.device(device)
        self.graphs = None  # a GraphRunner once the engine enables the static-buffer step

    def build(self, rows: list[RowInput]) -> tuple[AttnMetadata, torch.Tensor, torch.Tensor]:
        """Metadata, token ids (T,) and positions (T,) of the packed rows. The per-token arrays are built with
        numpy and reach the device in one non-blocking copy, so building a step never waits for the GPU work
        queued before it."""
        bs, use_tree = self.pool.block_size, any(r.tree_mask is not None for r in rows)
        counts = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        seq_lens = [r.seq_len for r in rows]
        prefix = [r.prefix_len for r in rows]
        for r, n in zip(rows, counts.tolist()):
            if not 0 < n <= r.seq_len - r.prefix_len:
                raise ValueError(f"row of {r.req.request_id}: {n} queries for region of {r.seq_len - r.prefix_len}")
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        parts = [qsl, np.asarray(prefix, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)]
        parts.append(np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in rows]))  # ids
        parts.append(np.concatenate([np.asarray(r.positions, dtype=np.int64) for r in rows]))  # positions
        parts.append(np.concatenate([_row_slots(r.req.blocks, r.seq_len - n, r.seq_len, bs)
                                     for r, n in zip(rows, counts.tolist())]))  # slots
        if use_tree:
            masks = []
            for r, n in zip(rows, counts.tolist()):
                region = r.seq_len - r.prefix_len
                if r.tree_mask is None and region > MAX_TREE_REGION:
                    raise ValueError(f"tree batch row with a causal region of {region} > {MAX_TREE_REGION}")
                masks += r.tree_mask if r.tree_mask is not None else causal_bits(region, n)
            parts.append(np.asarray(as_signed(masks), dtype=np.int64))
        sizes = [len(x) for x in parts]
        dev = torch.from_numpy(np.concatenate(parts)).to(self.device, non_blocking=True)  # (no stream sync)
        views = dev.split(sizes)
        host_qsl = qsl.tolist()
        meta = AttnMetadata(
            query_start_loc=views[0].int(), prefix_lens=views[1].int(), seq_lens=views[2].int(),
            block_tables=self.tables.stage([r.req.bt_row for r in rows]),
            slot_mapping=views[5],
            block_size=bs,
            tree_mask=views[6] if use_tree else None,
            max_query_len=int(counts.max()),
            max_seq_len=max(seq_lens),
            host_query_start_loc=host_qsl, host_seq_lens=seq_lens, host_prefix_lens=prefix,
        )
        return meta, views[3], views[4]

    def sync_tables(self, reqs) -> None:
        """Write each request's block list into its block-table row (host side; staged with the step)."""
        self.tables.set_rows(reqs)

    def prepare(self, model_idx: int, rows: list[RowInput]) -> tuple[ForwardContext, torch.Tensor, torch.Tensor]:
        """Stage the rows' block tables; the forward context on pool model ``model_idx``, ids and positions."""
        self.sync_tables(r.req for r in rows)
        meta, ids, pos = self.build(rows)
        return ForwardContext(self.backend, meta, self.pool.model_kv(model_idx)), ids, pos

    def run(self, model_idx: int, model: LlamaForCausalLM, rows: list[RowInput]) -> list[torch.Tensor | None]:
        """Forward the rows through ``model`` (KV views of pool model ``model_idx``).

        Returns per row the float32 logits it asked for: (V,) for "last", (n, V) for "all". Logits of a
        graphed step are views of the graph's output: use them before the next forward.
        """
        return self.forward(model_idx, model, rows).logits

    def forward(self, model_idx: int, model: LlamaForCausalLM, rows: list[RowInput],
                aux_layers: tuple[int, ...] = ()) -> ForwardResult:
        """``run`` plus the device-side greedy acceptance when the step was graphed (target only) and the
        features of ``aux_layers`` (those forwards run eagerly)."""
        if model_idx == 0 and self._prefill_graphed(rows, aux_layers):  # (short chunks too: not in a verify's
            return self._forward_prefill(rows)  # buckets, whose inputs a step queued behind a verify reads)
        if model_idx == 0 and any(r.parents is None and r.want_logits == "all" for r in rows):  # prefill rows that
            return ForwardResult(*self._forward_eager(model_idx, model, rows, aux_layers))  # want logits: eagerly
        key = self._graph_key(model_idx, rows, aux_layers)
        if key is not None:
            return self._forward_graphed(key, rows)
        return ForwardResult(*self._forward_eager(model_idx, model, rows, aux_layers))

    def _prefill_graphed(self, rows: list[RowInput], aux_layers: tuple[int, ...]) -> bool:
        g = self._graphs_for(0, aux_layers)
        return g is not None and PREFILL in g.query_buckets and all(r.want_logits == "none" for r in rows)

    def _forward_prefill(self, rows: list[RowInput]) -> ForwardResult:
        """Target rows that want no logits (prefill chunks) as causal pieces of ``PREFILL_QUERY`` queries, the
        rows of graphed prefill replays (as many pieces per replay as the largest batch bucket), each replay the
        draft's forward over them too when the engine has a draft model (``draft_kv``). Pieces of one row may share
        a replay: every layer stores all pieces' KV before any piece attends."""
        g, q = self.graphs, PREFILL_QUERY
        pieces, top = _causal_pieces(rows, q), g.batch_buckets[-1]
        for i in range(0, len(pieces), top):  # (the features an EAGLE draft reads go to their slots)
            group = pieces[i:i + top]
            self._replay(g.key_of(PREFILL, len(group), q), group)
        return ForwardResult([None] * len(rows), None, None, DRAFT_MODEL_INDEX in g.models)

    def _graphs_for(self, model_idx: int, aux_layers: tuple[int, ...] = ()):
        """The GraphRunner when a forward of pool model ``model_idx`` asking for ``aux_layers`` can be graphed
        (the target's graphs return exactly their aux layers, the draft's none), else None."""
        g = self.graphs
        if g is None or tuple(aux_layers) != (g.aux_layers if model_idx == 0 else ()):
            return None
        return g

    def _graph_key(self, model_idx: int, rows: list[RowInput], aux_layers: tuple[int, ...] = ()):
        g = self._graphs_for(model_idx, aux_layers)
        return None if g is None else g.key_for(model_idx, rows)

    def run_with_features(self, model_idx: int, model, rows: list[RowInput], g: torch.Tensor):
        """Forward a feature-reading (EAGLE) draft over packed rows with one feature row per token
        ``g`` (T, hidden): its hidden states (T, hidden) and, when the step was graphed, its logits
        over its own vocabulary (T, N), else None. Causal rows longer than the model's graphs take (a prefill
        chunk, a catch-up of many positions) run as pieces through them (``_graphed_pieces``)."""
        key = self._graph_key(model_idx, rows)
        if key is None:
            pieces = self._graphed_pieces(model_idx, rows, g)
            if pieces is not None:
                return pieces
            ctx, ids, pos = self.prepare(model_idx, rows)
            with torch.inference_mode():
                return model(ids, pos, ctx, g), None
        where = self.padded_index(rows, key[2])
        out = self._replay(key, rows, (where, g))
        return out.hidden.index_select(0, where), out.logits.index_select(0, where)

    def _graphed_pieces(self, model_idx: int, rows: list[RowInput], g: torch.Tensor):
        """``run_with_features`` of causal ``rows`` cut into pieces of the model's largest graphed query count,
        as many pieces a replay as its largest batch bucket holds (pieces of one row may share a replay: the
        layer stores every piece's KV before any piece attends), or None when the model has no graphs, a row is
        not causal, or the rows need more than ``MAX_PIECE_REPLAYS`` replays (then one eager forward costs less).
        Eager forwards over arbitrary token counts meet new matrix shapes (and their kernels) with every new
        prompt length; the graphs' shapes are fixed at capture."""
        graphs = self.graphs
        buckets = None if graphs is None else graphs.query_buckets.get(model_idx)
        if not buckets or any(r.tree_mask is not None for r in rows):
            return None
        q, top = buckets[-1], graphs.batch_buckets[-1]
        if sum(-(-len(r.token_ids) // q) for r in rows) > top * MAX_PIECE_REPLAYS:  # (one eager forward is cheaper)
            return None
        pieces, (hidden, logits, start) = _causal_pieces(rows, q), ([], [], 0)
        for i in range(0, len(pieces), top):
            group = pieces[i:i + top]
            count = sum(len(p.token_ids) for p in group)
            key = graphs.key_for(model_idx, group)
            where = self.padded_index(group, key[2])
            out = self._replay(key, group, (where, g[start:start + count]))
            hidden.append(out.hidden.index_select(0, where))
            logits.append(out.logits.index_select(0, where))
            start += count
        return torch.cat(hidden), torch.cat(logits)

    def padded_index(self, rows: list[RowInput], q: int) -> torch.Tensor:
        """(T,) position of each packed query of ``rows`` in a padded layout of ``q`` queries per row (copied
        without waiting for the GPU)."""
        counts = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        starts = np.repeat(np.cumsum(counts) - counts, counts)  # each query's row's first packed index
        index = np.repeat(np.arange(len(rows), dtype=np.int64) * q, counts) + np.arange(int(counts.sum())) - starts
        return torch.from_numpy(index).to(self.device, non_blocking=True)

    def padded_inputs(self, rows: list[RowInput], q: int):
        """Stage ``rows`` for a padded step of ``q`` queries per row: their block tables synced; the rows
        (causal ones with explicit masks when q > 1), each row's query slots and its block-table row."""
        self.sync_tables(r.req for r in rows)
        if q > 1:
            rows = [r if r.tree_mask is not None else _with_causal_mask(r) for r in rows]
        bs = self.pool.block_size
        slots = [_row_slots(r.req.blocks, r.seq_len - len(r.token_ids), r.seq_len, bs).tolist() for r in rows]
        return rows, slots, self.tables.host_rows([r.req.bt_row for r in rows])

    def _replay(self, key, rows: list[RowInput], features=None):
        return self.graphs.run(key, *self.padded_inputs(rows, key[2]), features)

    def _forward_graphed(self, key, rows: list[RowInput]) -> ForwardResult:
        out = self._replay(key, rows)
        return self._graphed_result(out, key[2], [len(r.token_ids) for r in rows], [r.want_logits for r in rows])

    def packed_key(self, model_idx: int, n_rows: int, longest: int, aux_layers: tuple[int, ...] = ()):
        """The graph bucket of ``n_rows`` rows of at most ``longest`` queries over masked regions of at most
        ``MAX_TREE_REGION`` tokens (verify rows), for ``forward_packed``; None when they must run eagerly."""
        g = self._graphs_for(model_idx, aux_layers)
        return None if g is None else g.key_of(model_idx, n_rows, longest)

    def forward_packed(self, key, reqs: list[Request], packed: PackedRows, lengths: list[int],
                       on_device=None, bt_rows=None) -> ForwardResult:
        """``forward`` of the rows of ``reqs`` flattened into ``packed`` for graph bucket ``key``
        (``packed_key``), without a ``RowInput`` per row; row i has ``lengths[i]`` queries, all with logits.
        ``on_device``: see ``GraphRunner.run_packed``. ``bt_rows``: the rows' host block tables (R, W) when the
        caller has synced them this step (None: synced here)."""
        if bt_rows is None:
            self.sync_tables(reqs)
            bt_rows = self.tables.host_rows([r.bt_row for r in reqs])
        out = self.graphs.run_packed(key, packed, bt_rows, on_device=on_device)
        return self._graphed_result(out, key[2], lengths, ["all"] * len(reqs))

    @staticmethod
    def _graphed_result(out, q: int, lengths: list[int], wants: list[str]) -> ForwardResult:
        feats = None if out.features is None else RowSlices(out.features, [i * q for i in range(len(lengths))],
                                                             lengths)
        return ForwardResult(_PaddedLogits(out.logits, q, lengths, wants), out.accept, feats)

    def _forward_eager(self, model_idx: int, model: LlamaForCausalLM, rows: list[RowInput], aux_layers=()):
        ctx, ids, pos = self.prepare(model_idx, rows)
        qsl = ctx.meta.host_query_start_loc
        with torch.inference_mode():
            if aux_layers:
                hidden, aux = model.forward_features(ids, pos, ctx, aux_layers)  # (T, hidden), (T, k * hidden)
                self.pool.store_features(ctx.meta.slot_mapping, aux)  # (what the EAGLE draft reads, per slot)
            else:
                hidden, aux = model(ids, pos, ctx), None  # (T, hidden)
            picks, spans = [], []
            for i, r in enumerate(rows):
                s, e = qsl[i], qsl[i + 1]
                span = {"last": (e - 1, e), "all": (s, e), "none": (e, e)}[r.want_logits]
                spans.append((len(picks), len(picks) + span[1] - span[0], r.want_logits))
                picks += range(*span)
            logits = model.compute_logits(hidden[picks]) if picks else None  # (P, V)
        out = []
        for a, b, kind in spans:
            out.append(None if kind == "none" else (logits[a] if kind == "last" else logits[a:b]))
        return out, None, None if aux is None else RowSlices(aux, qsl[:-1], [len(r.token_ids) for r in rows])


class _PaddedLogits:
    """Per-row float32 logits of a padded step, sliced (and converted from the target's dtype) only when a row
    is read (greedy verify reads none)."""

    def __init__(self, logits: torch.Tensor, q: int, lengths: list[int], wants: list[str]) -> None:
        self.logits, self.q, self.lengths, self.wants = logits, q, lengths, wants

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor | None:
        s, e, want = i * self.q, i * self.q + self.lengths[i], self.wants[i]
        return None if want == "none" else (self.logits[e - 1] if want == "last" else self.logits[s:e]).float()

    def __iter__(self):
        return (self[i] for i in range(len(self.lengths)))


def _row_slots(blocks: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """(end - start,) physical slots of logical positions [start, end) of a request with ``blocks``."""
    logical = np.arange(start, end, dtype=np.int64)
    return np.asarray(blocks, dtype=np.int64)[logical // block_size] * block_size + logical % block_size


def _with_causal_mask(r: RowInput) -> RowInput:
    return RowInput(r.req, r.token_ids, r.positions, r.prefix_len, r.seq_len,
                    _causal_signed(r.seq_len - r.prefix_len, len(r.token_ids)), r.want_logits, r.parents)


@functools.lru_cache(maxsize=1024)
def _causal_signed(region_len: int, n_query: int) -> tuple[int, ...]:
    """``causal_bits`` as signed int64 values; shared (a tuple: read-only)."""
    return tuple(as_signed(causal_bits(region_len, n_query)))


def as_signed(masks: list[int]) -> list[int]:
    """Bitmasks using bit 63 become negative int64 values (two's complement)."""
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def _causal_pieces(rows: list[RowInput], q: int) -> list[RowInput]:
    """Causal ``rows`` cut into pieces of at most ``q`` queries, row after row, each piece's region itself (what
    comes before it is in the KV cache, or written by an earlier piece of the same replay)."""
    pieces = []
    for r in rows:
        n, first = len(r.token_ids), r.seq_len - len(r.token_ids)
        pieces += [RowInput(r.req, r.token_ids[s:s + q], r.positions[s:s + q], first + s, first + min(n, s + q),
                            None, r.want_logits) for s in range(0, n, q)]
    return pieces
