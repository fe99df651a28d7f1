"""Tree drafting with an EAGLE draft as one device program per batch bucket.

For every row of a step, greedy or sampled, the whole proposal runs on the device with no host read in
between: the catch-up forward over each row's newly committed tokens (their target features come
from the verify step), then the tree levels. For a static template (``chain:K``, ``topk:WxD``,
``DeviceTreeLoop`` here) each level takes the top-k of each parent's draft logits and runs the draft
forward of the new nodes (each node reads its parent's draft state); dynamic trees grow inside the
same program (``eagle_dynamic.DeviceDynamicTree``). On CUDA the program is captured as one CUDA
graph per batch bucket; on the CPU it runs eagerly over the same buffers. The host fills the
catch-up inputs (one copy), runs the program and reads the batch's trees (one copy).

A program also runs cut to its first L levels (``levels_for``: the fewest that hold the best n nodes a step
keeps under budget n), and at budget 0 as the catch-up forward alone: a step that keeps few nodes or none pays
for no draft forward, draft head or top-k it would drop (the catch-up still runs, so the draft's KV stays
current for the steps that speculate again). Each level count a budget may need is captured per bucket.

For greedy rows the trees equal those of the level-by-level host path (``EagleDrafter``'s
``ModelDrafter.propose``) up to ties in the draft logits: both take each parent's most probable draft tokens
in rank order. A step with sampled rows runs the program's sampled variant (one more graph per bucket): a
sampled row ranks each node's children by logits * S / T + G, G the Gumbel noise the target's sampled rule
uses at the children's position for the request (``_children_scores``), so the first child is a draw of the
draft's distribution at temperature T / S coupled with the target's own draw there; the rule accepts a child when
it equals the target's draw, lossless whatever the draft proposes. S (``SAMPLED_DRAFT_SHARPNESS``) > 1 sharpens
the draft: a draft trained toward the target is less sure than it, and a draw coupled with the target's agrees
with it more often from a sharper draft (the value chosen by the shipped draft's accepted lengths at several S:
bench/RESULTS.md, "Findings behind current defaults").
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import numpy as np
import torch

from specdec.attention.base import AttnMetadata
from specdec.drafters.model_drafter import DRAFT_MODEL_INDEX
from specdec.graphs import bucket, capture_graph
from specdec.kernels.gumbel_noise import children_scores
from specdec.kernels.topk import topk
from specdec.kernels.tree_slots import tree_slots
from specdec.models.llama import ForwardContext
from specdec.step_inputs import PackedRows, StepInputs
from specdec.tree import depths_and_masks
from specdec.tree_spec import TreeTemplate

# a sampled row's draft children are drawn at the request's temperature divided by this (the module docstring)
SAMPLED_DRAFT_SHARPNESS = 1.5


class _Level(NamedTuple):
    """The nodes of one tree level (level order: [start, end)) and where their tokens come from."""

    start: int
    end: int
    depth: int
    parent_local: torch.Tensor  # (n,) index of each node's parent within the previous level (0: the root)
    rank: torch.Tensor  # (n,) the node's rank among its siblings: which of the parent's top tokens it takes
    children: int  # most children of one parent in this level (the top-k width)
    nodes: torch.Tensor  # (n,) region index of each node (its slot is at position L + index)
    masks: torch.Tensor  # (n,) ancestor bitmask over the region (self included)


def levels_of(template: TreeTemplate, device) -> list[_Level]:
    """The template's levels; raises ValueError unless it is level ordered (every level after the last)."""
    depth, ranks, parents = template.depth, template.ranks, template.parents
    if list(depth) != sorted(depth):
        raise ValueError(f"template parents {parents} are not in level order")
    _, masks = depths_and_masks(list(parents))
    out, start = [], 0
    while start < len(parents):
        d = depth[start]
        end = start
        while end < len(parents) and depth[end] == d:
            end += 1
        prev = out[-1] if out else None
        local = [0 if parents[i] < 0 else parents[i] - prev.start for i in range(start, end)]
        dev = dict(dtype=torch.int64, device=device)
        out.append(_Level(start, end, d, torch.tensor(local, **dev), torch.tensor(ranks[start:end], **dev),
                          max(ranks[start:end]) + 1, torch.arange(start, end, **dev),
                          torch.tensor(masks[start:end], **dev)))
        start = end
    return out


class CatchUp(NamedTuple):
    """What the catch-up forward leaves for the tree levels of bucket ``b``."""

    b: int
    views: object  # StepViews of the catch-up
    kv: list
    state: torch.Tensor  # (b, 1, hidden) the root's draft state
    logits: torch.Tensor  # (b, 1, N) the root's draft-vocabulary logits
    slots: torch.Tensor  # (T,) KV slot of every forwarded node, levels one after another (padded rows: -1)
    positions: torch.Tensor  # (T,) position of every forwarded node, laid out as ``slots``
    seq_lens: torch.Tensor  # (levels, b) each row's attended length in each forwarded level
    starts: tuple[int, ...]  # levels + 1 offsets of each forwarded level into ``slots`` and ``positions``
    sampled: bool = False  # the program's sampled variant (``DeviceDraftProgram._children_scores``)


class _Plan(NamedTuple):
    """Bucket ``b``'s forwarded nodes, levels one after another, each level row-major (b, n): constants."""

    rows: torch.Tensor  # (T,) the node's batch row
    nodes: torch.Tensor  # (T,) its region index
    depths: torch.Tensor  # (T,) its depth
    ends: torch.Tensor  # (levels, 1) the region [0, end) each level attends
    starts: tuple[int, ...]  # levels + 1 offsets into T


class DeviceDraftProgram:
    """A greedy drafting program of ``model`` (an ``EagleDraft`` on pool model 1) per batch bucket: the
    catch-up forward, then the tree levels of a subclass's ``_grow``: ``levels`` are the forwarded levels
    (region indices (n,), depth, end of the attended region), whose slots and positions the program computes
    once, after the catch-up.

    ``catch_up``: most committed tokens a row's catch-up may hold (longer rows take the host path).
    """

    def __init__(self, model, pool, backend, batch_buckets: tuple[int, ...], catch_up: int, bt_width: int,
                 device, levels: list[tuple[torch.Tensor, int, int]]) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self.device = torch.device(device)
        self.batch_buckets, self.q = batch_buckets, catch_up
        self._batch_of = [bucket(n, batch_buckets) for n in range(max(batch_buckets) + 1)]
        self.inputs = StepInputs(max(batch_buckets), catch_up, bt_width, self.device)
        width = len(model.aux_layers) * model.config.hidden_size
        self.features = torch.zeros(max(batch_buckets) * catch_up, width, device=self.device,
                                    dtype=next(model.parameters()).dtype)
        self.max_seq_len = bt_width * pool.block_size
        # per row: the request's noise key (two words) and S / temperature as float64 bits (0: a greedy row)
        self.sampling = torch.zeros(max(batch_buckets), 3, dtype=torch.int64, device=self.device)
        from specdec.pipeline import HostUpload

        self._upload = HostUpload(self.device)
        self._written: tuple[list, bool] = ([], False)  # the rows ``sampling`` holds, and whether one samples
        # (bucket, sampled, levels, width) -> the captured program and its output
        self.graphs: dict[tuple[int, bool, int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._idle = {b: self._no_trees(b) for b in batch_buckets}  # a catch-up-only program's output
        self._qsl: dict[tuple[int, int], torch.Tensor] = {}
        self._plans: dict[tuple[int, int | None], _Plan] = {}  # (bucket, width) -> the forwarded levels' constants
        self._add_plans(self.max_width, levels)
        # the (levels, width) variants captured (``set_budgets``): the whole program, and cuts for smaller budgets
        self.variants: tuple[tuple[int, int | None], ...] = (self.variant_for(None),)
        self._row_start = {b: torch.arange(b, device=self.device) * catch_up for b in batch_buckets}  # (b,)

    def _add_plans(self, width: int | None, levels: list[tuple[torch.Tensor, int, int]]) -> None:
        """The constants of the program of ``width`` whose forwarded levels are ``levels``, for every bucket (once)."""
        for b in self.batch_buckets:
            if (b, width) in self._plans:
                continue
            self._plans[(b, width)] = self._plan(b, levels)
            for n in {len(nodes) for nodes, _, _ in levels}:
                self._qsl[(b, n)] = torch.arange(b + 1, device=self.device) * n

    def _plan(self, b: int, levels: list[tuple[torch.Tensor, int, int]]) -> _Plan:
        """The constants of bucket ``b`` for the forwarded ``levels`` (region indices (n,), depth, end)."""
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        rows, nodes, depths, starts = [empty], [empty], [empty], [0]
        for idx, depth, _ in levels:
            n = len(idx)
            rows.append(torch.arange(b, device=self.device).repeat_interleave(n))
            nodes.append(idx.to(self.device).repeat(b))
            depths.append(torch.full((b * n,), depth, dtype=torch.int64, device=self.device))
            starts.append(starts[-1] + b * n)
        rows = torch.cat(rows)
        ends = torch.tensor([end for _, _, end in levels], dtype=torch.int64, device=self.device).view(-1, 1)
        return _Plan(rows, torch.cat(nodes), torch.cat(depths), ends, tuple(starts))

    @property
    def max_levels(self) -> int:
        """The tree levels of a whole program."""
        raise NotImplementedError

    def levels_for(self, n: int) -> int:
        """The fewest levels whose nodes hold the ``n`` nodes a step keeps (0: the catch-up alone)."""
        raise NotImplementedError

    @property
    def max_width(self) -> int | None:
        """The nodes per level of a whole program (None: levels of a static template, whose widths are its own)."""
        return None

    def width_for(self, n: int) -> int | None:
        """The fewest nodes per level that hold the ``n`` nodes a step keeps (``max_width`` unless narrower
        levels keep the same nodes)."""
        return self.max_width

    def variant_for(self, n: int | None) -> tuple[int, int | None]:
        """(levels, width) of the program whose kept trees under budget ``n`` are the whole program's (None: the
        whole program; budget 0: the catch-up alone)."""
        if n is None:
            return self.max_levels, self.max_width
        levels = self.levels_for(n)
        return levels, (self.width_for(n) if levels else self.max_width)

    def _no_trees(self, b: int) -> torch.Tensor:
        """The output of bucket ``b`` when no level runs: a tree of no node a budget keeps."""
        raise NotImplementedError

    def set_budgets(self, budgets) -> None:
        """Capture (``capture``) the (levels, width) variants the node ``budgets`` need (the whole program always;
        none for budget 0, whose steps run no draft: ``EagleDrafter.propose``)."""
        self.variants = tuple(sorted({self.variant_for(n) for n in budgets if n} | {self.variant_for(None)},
                                     key=lambda v: (v[0], v[1] or 0)))

    def bucket(self, rows: int, longest: int) -> int | None:
        """The batch bucket of a step with ``rows`` rows whose longest catch-up is ``longest``, or None."""
        if rows >= len(self._batch_of) or longest > self.q:
            return None
        return self._batch_of[rows]

    def set_rows(self, reqs: list) -> bool:
        """Write the sampling inputs of the step's rows ``reqs`` (in order); returns whether some row samples (then
        the program's sampled variant runs: its rows' children are drawn with the target's noise). The same rows
        in the same order as last time (a queued step's, the usual case) are already there: nothing is written."""
        held, any_sampled = self._written
        if len(held) == len(reqs) and all(a is b for a, b in zip(held, reqs)):
            return any_sampled
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        self._written = (list(reqs), bool(sampled))
        if not sampled:
            return False
        host = np.zeros((len(reqs), 3), dtype=np.int64)
        for i in sampled:
            s = reqs[i].stream
            host[i, :2] = s.key0, s.key1
            host[i, 2:] = np.array([SAMPLED_DRAFT_SHARPNESS / reqs[i].params.temperature]).view(np.int64)
        self.sampling[:len(reqs)].copy_(self._upload(host))
        return True

    def run(self, b: int, rows: PackedRows, bt_rows, table: torch.Tensor, src: torch.Tensor,
            sampled: bool = False, n: int | None = None) -> torch.Tensor:
        """Fill bucket ``b``'s inputs with the catch-up ``rows`` (laid out for ``q`` queries per row) and their
        block-table rows (R, W), its target features with rows ``src`` (b * q,) of ``table`` (padded positions
        included), and run the program (``sampled``: its sampled variant, ``set_rows``; ``n``: the node budget
        the step keeps, None: all): its output for every row (padded rows: garbage)."""
        self.inputs.fill_packed(b, self.q, rows, bt_rows)
        torch.index_select(table, 0, src, out=self.features[:b * self.q])
        return self.replay(b, sampled, n)

    def replay(self, b: int, sampled: bool = False, n: int | None = None) -> torch.Tensor:
        """Run bucket ``b``'s program (``sampled``: the variant whose sampled rows draw with the target's noise)
        over its inputs and features as they are now on the device, cut to the levels and width whose nodes hold
        the ``n`` nodes a step keeps (None: all). Outside the captured variants the whole program runs (same kept
        trees)."""
        variant = self.variant_for(n)
        if variant not in self.variants:
            variant = self.variant_for(None)
        key = (b, sampled and variant[0] > 0, *variant)
        entry = self.graphs.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out
        return self._program(*key)

    def capture(self, pool_handle=None) -> tuple[int, float]:
        """Capture every batch bucket (CUDA only): (graphs, seconds)."""
        if self.device.type != "cuda":
            return 0, 0.0
        start = time.perf_counter()
        for b in sorted(self.batch_buckets, reverse=True):
            self.inputs.clear(b, self.q)
            for levels, width in self.variants:
                for sampled in (False, True) if levels else (False,):  # (the catch-up alone samples nothing)
                    key = (b, sampled, levels, width)
                    self.graphs[key] = capture_graph(functools.partial(self._program, *key), pool_handle, self.device)
        torch.cuda.synchronize(self.device)
        return len(self.graphs), time.perf_counter() - start

    @torch.inference_mode()
    def _program(self, b: int, sampled: bool, levels: int, width: int | None) -> torch.Tensor:
        m, q, bs = self.model, self.q, self.pool.block_size
        v = self.inputs.views(b, q)
        kv = self.pool.model_kv(DRAFT_MODEL_INDEX)
        meta = AttnMetadata(query_start_loc=v.qsl, prefix_lens=v.prefix_lens, seq_lens=v.seq_lens,
                            block_tables=v.block_tables, slot_mapping=v.slots, block_size=bs,
                            tree_mask=None if q == 1 else v.tree_mask, max_query_len=q, max_seq_len=self.max_seq_len)
        g = m.fuse(self.features[:b * q])  # (b*q, hidden)
        hidden = m(v.ids, v.positions, ForwardContext(self.backend, meta, kv), g)  # (b*q, hidden)
        if levels == 0:  # the catch-up alone: its KV is what later steps need
            return self._idle[b]
        last = self._row_start[b] + (v.num_tokens - 1).clamp(min=0)  # (b,)
        state = hidden.index_select(0, last).unsqueeze(1)  # (b, 1, hidden): the root's draft state
        # the head's dtype: the tree levels only rank the logits (top-k) or take log probabilities in float32
        logits = m.compute_logits(state.flatten(0, 1), self.backend, dtype=None).unsqueeze(1)  # (b, 1, N)
        p = self._plans[(b, width)]  # every level's slots and positions, computed once
        slots, pos = tree_slots(v.seq_lens, v.num_tokens, v.block_tables, p.rows, p.nodes, p.depths, bs,
                                use_triton=self.backend.uses_triton)
        c = CatchUp(b, v, kv, state, logits, slots, pos, v.seq_lens + p.ends, p.starts, sampled)
        return self._grow(c, levels, width)

    def _grow(self, c: CatchUp, levels: int, width: int | None) -> torch.Tensor:
        """The trees of the program's first ``levels`` levels (>= 1) of ``width`` nodes (``variant_for``), laid
        out as the whole program's output."""
        raise NotImplementedError

    def _children_scores(self, c: CatchUp, logits: torch.Tensor, depth: int) -> torch.Tensor:
        """What a level ranks its children by: the draft ``logits`` (b, n, N) of the nodes whose children are at
        ``depth``; in the sampled variant a sampled row's are logits * S / T + G, G the Gumbel noise the target's
        sampled rule uses at the children's position (the row's length + depth) for the request, S
        ``SAMPLED_DRAFT_SHARPNESS``, so each node's first child is a draw of the draft's distribution at temperature
        T / S coupled with the target's own draw there
        (``kernels.gumbel_choice``) and the next ones its next draws without replacement."""
        if not c.sampled:
            return logits
        b = c.b
        key = self.sampling[:b]
        position = c.views.seq_lens[:b] + depth  # (b,) the children's position
        return children_scores(logits, key[:, 2].view(torch.float64), key[:, 0], key[:, 1], position,
                               self.model.vocab_ids, use_triton=self.backend.uses_triton)  # (b, n, N) float32

    def _forward(self, c: CatchUp, level: int, toks: torch.Tensor, masks: torch.Tensor,
                 feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward of the n nodes per row of forwarded ``level`` (the plan's levels): target ids ``toks``
        (b, n) at the level's region indices (slot of position len(tokens) + index), at the level's depth,
        attending the region [0, end) through ``masks`` (b * n,) and reading draft states ``feats``
        (b * n, hidden). Returns their states (b * n, hidden) and draft logits (b * n, N) in the head's dtype."""
        b, n, v = c.b, toks.shape[1], c.views
        lo, hi = c.starts[level:level + 2]
        meta = AttnMetadata(query_start_loc=self._qsl[(b, n)], prefix_lens=v.seq_lens, seq_lens=c.seq_lens[level],
                            block_tables=v.block_tables, slot_mapping=c.slots[lo:hi], block_size=self.pool.block_size,
                            tree_mask=masks, max_query_len=n, max_seq_len=self.max_seq_len)
        return self.model.forward_logits(toks.flatten(), c.positions[lo:hi], ForwardContext(self.backend, meta, c.kv),
                                         feats, dtype=None)


class DeviceTreeLoop(DeviceDraftProgram):
    """The device program of static tree ``template``: every level takes each parent's most probable
    draft tokens by the template's ranks. Output: the tree tokens (b, N) of every row."""

    def __init__(self, model, pool, backend, template: TreeTemplate, batch_buckets: tuple[int, ...],
                 catch_up: int, bt_width: int, device) -> None:
        self.template = template
        self.levels = levels_of(template, torch.device(device))
        super().__init__(model, pool, backend, batch_buckets, catch_up, bt_width, device,
                         [(lv.nodes, lv.depth, lv.end) for lv in self.levels[:-1]])
        self._masks = {b: [lv.masks.repeat(b) for lv in self.levels] for b in batch_buckets}  # (b*n,) each

    @property
    def max_levels(self) -> int:
        return len(self.levels)

    def levels_for(self, n: int) -> int:
        """A budget keeps the template's first n nodes in level order: the levels that start before n."""
        return sum(lv.start < n for lv in self.levels)

    def _no_trees(self, b: int) -> torch.Tensor:
        return torch.zeros(b, self.template.num_nodes, dtype=torch.int64, device=self.device)

    def _grow(self, c: CatchUp, levels: int, width: int | None) -> torch.Tensor:
        m, b, state, logits = self.model, c.b, c.state, c.logits
        tokens = []
        for i, lv in enumerate(self.levels[:levels]):
            scores = self._children_scores(c, logits, lv.depth)
            top = topk(scores, lv.children, use_triton=self.backend.uses_triton).indices  # (b, n_prev, c)
            toks = m.vocab_ids[top[:, lv.parent_local, lv.rank]]  # (b, n): target ids
            tokens.append(toks)
            if i + 1 == levels:
                break
            feats = state[:, lv.parent_local].flatten(0, 1)  # (b*n, hidden): each node reads its parent's state
            h, logits = self._forward(c, i, toks, self._masks[b][i], feats)  # (b*n, hidden), (b*n, N)
            state = h.view(b, lv.end - lv.start, -1)
            logits = logits.view(b, lv.end - lv.start, -1)
        if levels < len(self.levels):  # the nodes of the levels not run: never kept under this budget
            tokens.append(self._idle[b][:, self.levels[levels].start:])
        return torch.cat(tokens, 1)  # (b, N)
