"""The device trees of a fused EAGLE step written into the verify's inputs: ``TreeWriter`` (the kept nodes of each
row's tree, as tokens, positions, ancestor masks and parents in the verify bucket, by torch ops or one Triton
kernel, ``kernels/tree_write.py``), the host-known skeleton of the verify (``verify_skeleton``), and the tree
shape helpers the verifier and the pipeline share (``shape_rows``, ``shape_depth``, ``ancestry``,
``best_nodes_on_device``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.graphs import GraphCache, graph_constant
from specdec.step_inputs import PackedRows, StepViews
from specdec.tree import depths_and_masks, verify_rows_of


class TreeWriter:
    """``best_nodes_on_device`` + ``write_trees`` of a dynamic program's output (with ``use_triton`` one kernel,
    ``kernels/tree_write.py``): on CUDA one replay of a graph
    captured (by ``FusedVerify.prepare`` at engine start, else on first use) per (batch bucket, query bucket,
    budget) instead of 20-45 small launches, whatever number of the bucket's rows are live (a continuous batch's
    steps often run a few rows short of their bucket, waiting for an admission); eagerly elsewhere or with
    ``capture`` False. A graph builds trees for all of its bucket's rows (the padding rows past the live ones from
    what its input held there before: valid trees, the capture's or an earlier step's), but every write to the
    inputs is masked by a per-row live flag (the graph's input, one copy per step), so the padding rows keep what
    the skeleton or the queued step's writer put there. Either way the kept trees are returned in buffers of their
    own (the program's output may be overwritten by the verify)."""

    def __init__(self, levels: int, device: torch.device, capture: bool | None = None,
                 graphs: GraphCache | None = None, use_triton: bool = False) -> None:
        self.levels, self.device, self.use_triton = levels, device, use_triton
        self.capture = device.type == "cuda" if capture is None else capture
        self.graphs = graphs if graphs is not None else GraphCache("tree writer", device)  # (b, q, n) ->

    def __call__(self, views: StepViews, b: int, q: int, out: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Write the trees ``out`` (R, 3, N) keeps under budget ``n`` into bucket (b, q)'s ``views``: their tokens
        and parents (R, min(n, N)), each tree's ``DraftTree.max_depth`` (R, 1) and the kept nodes' score ranks
        (R, min(n, N): ``kept_ranks``)."""
        r = out.shape[0]
        if min(n, out.shape[2]) == 0:  # no nodes (budget 0, plain decoding): nothing to write, no launch
            return _no_trees(r, out.device)
        if not self.capture or r > b:
            return self._build(views, b, q, out.clone(), n)
        key = (b, q, n)
        entry = self.graphs.get(key)
        if entry is None:  # the bucket's input views are fixed buffers, so the graph may write them
            src = torch.empty((b, *out.shape[1:]), dtype=out.dtype, device=out.device)
            src[:] = out[:1]  # (padding rows: copies of a live row's tree until a full step writes them)
            src[:r] = out
            live = _live_rows(b, r, out.device).clone()
            graph, kept = self.graphs.capture(functools.partial(self._build, views, b, q, src, n, live))
            entry = self.graphs[key] = (graph, src, live, kept)
        graph, src, live, kept = entry
        src[:r].copy_(out)
        live.copy_(_live_rows(b, r, out.device))
        graph.replay()
        return kept if r == b else tuple(t[:r] for t in kept)

    @torch.inference_mode()
    def _build(self, views: StepViews, b: int, q: int, src: Tensor, n: int,
               live: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        if self.use_triton:  # one launch (``kernels/tree_write.py``) instead of the ~30 small ops below
            from specdec.kernels.tree_write import tree_write_triton

            return *tree_write_triton(views, b, q, src, n, self.levels, live), kept_ranks(src, n)
        tokens, parents, ranks = best_nodes_on_device(src, n)
        depth = write_trees(views, b, q, tokens, parents, self.levels, live)
        return tokens, parents, tree_top(depth, tokens.shape[0], tokens.device), ranks


@graph_constant(maxsize=256)
def _live_rows(b: int, r: int, device: torch.device) -> Tensor:
    """(b, 1) bool: the first ``r`` rows of a bucket of ``b`` are live (read only)."""
    return (torch.arange(b, device=device) < r).view(b, 1)


@graph_constant(maxsize=64)
def _no_trees(r: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``TreeWriter``'s result for ``r`` trees of no nodes: tokens, parents and ranks (r, 0), max depths 0 (r, 1);
    read only, so one set per row count serves every step."""
    empty = torch.zeros(r, 0, dtype=torch.int64, device=device)
    return empty, empty, torch.zeros(r, 1, dtype=torch.int64, device=device), empty


def verify_skeleton(reqs: list, n: int, q: int, bt: np.ndarray, block_size: int,
                    parents: tuple[int, ...] | None = None) -> PackedRows:
    """The verify rows of ``reqs`` with trees of ``n`` nodes each, laid out for ``q`` queries per row, with
    everything that does not depend on the trees' tokens: the pending token at position L - 1 (root mask 1),
    every query's KV slot (logical positions L - 1 .. L - 1 + n, through the rows' block tables ``bt`` (R, W)
    of ``block_size``-token blocks), the row lengths, and, when every row has the tree shape ``parents``, the
    nodes' positions, masks and parents. The rest (node tokens 0; positions and masks 0, parents -1) waits
    for ``write_trees``."""
    r, w = len(reqs), n + 1
    shape = _skeleton(r, w, q, parents if n else None)
    last = np.fromiter((len(req.tokens) - 1 for req in reqs), np.int64, r)  # (R,) L - 1: the pending token's position
    tokens = shape.tokens.copy()  # (5, R, w) ids, positions, slots, masks, parents
    tokens[0, :, 0] = [req.tokens[-1] for req in reqs]
    tokens[1] += last[:, None] * shape.moves  # the root at L - 1; a static shape's nodes at L + depth
    logical = last[:, None] + shape.cols  # (R, w)
    np.multiply(bt[shape.rows, logical // block_size], block_size, out=tokens[2], dtype=np.int64)
    tokens[2] += logical % block_size
    per_row = shape.per_row.copy()  # (3, R) prefix, seq lens, tokens
    per_row[0], per_row[1] = last, last + w
    return PackedRows(shape.index, tokens.reshape(5, r * w), per_row)


class _Skeleton(NamedTuple):
    """What ``verify_skeleton`` writes the same at every step of a shape (read-only arrays)."""

    tokens: np.ndarray  # (5, R, w) ids and slots 0, positions relative to L - 1 (0 where unknown), masks, parents
    moves: np.ndarray  # (w,) 1 where a position is L - 1 + tokens[1], 0 where it waits for ``write_trees``
    cols: np.ndarray  # (1, w) query index in the row
    rows: np.ndarray  # (R, 1) row index
    index: np.ndarray  # (R * w,) each query's place in the padded layout
    per_row: np.ndarray  # (3, R) row 2: w queries per row


@functools.lru_cache(maxsize=256)
def _skeleton(r: int, w: int, q: int, parents: tuple[int, ...] | None) -> _Skeleton:
    """The fixed part of ``verify_skeleton``'s rows: R rows of w queries in a bucket of q, of tree shape
    ``parents`` (None: the positions, masks and parents of the nodes are written on the device)."""
    tokens = np.zeros((5, r, w), dtype=np.int64)
    tokens[3, :, 0] = 1
    tokens[4] = -1
    moves = np.zeros(w, dtype=np.int64)
    moves[0] = 1
    if parents is not None:
        depth, tokens[3], tokens[4] = shape_rows(parents)
        tokens[1, :, 1:] = 1 + depth
        moves[:] = 1
    per_row = np.full((3, r), w, dtype=np.int64)
    out = _Skeleton(tokens, moves, np.arange(w)[None], np.arange(r)[:, None],
                    (np.arange(r)[:, None] * q + np.arange(w)).ravel(), per_row)
    for a in out:
        a.flags.writeable = False
    return out


def shape_depth(parents: tuple[int, ...]) -> int:
    """``DraftTree.max_depth`` of the tree shape ``parents``."""
    return int(shape_rows(parents)[0].max()) + 1 if parents else 0


@functools.lru_cache(maxsize=256)
def shape_rows(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Node depths (n,), and the verify masks and parents of the root + nodes (n + 1,) of a tree shape."""
    depth, masks = depths_and_masks(parents)
    verify_masks, verify_parents = verify_rows_of(masks, list(parents))
    return np.array(depth, dtype=np.int64), np.array(verify_masks, dtype=np.int64), np.array(verify_parents)


@torch.inference_mode()
def write_trees(v: StepViews, b: int, q: int, tokens: Tensor, parents: Tensor | None, levels: int,
                live: Tensor | None = None) -> Tensor | None:
    """Write the trees ``tokens``/``parents`` (R, n) into the first R rows of bucket (b, q)'s device inputs
    filled by ``verify_skeleton``: node j of row i is verify query 1 + j, at position L + depth, with mask
    bit 0 (the root) and its ancestors' bits shifted by one (``DraftTree.verify_rows``), parent j + 1.
    ``parents`` None: the skeleton holds the shape, only the tokens are written. ``live`` (R, 1) bool: only
    those rows are written (the others keep their inputs). Returns the nodes' depths (R, n) when it computed
    them (else None)."""
    r, n = tokens.shape
    if not n:
        return None
    nodes = slice(1, n + 1)

    def put(view: Tensor, values: Tensor) -> None:
        view[:r, nodes] = values if live is None else torch.where(live, values, view[:r, nodes])

    put(v.ids.view(b, q), tokens)
    if parents is None:
        return None
    depth, ancestors = ancestry(parents, levels)  # (R, n) each
    positions = v.positions.view(b, q)
    put(positions, positions[:r, :1] + 1 + depth)
    put(v.tree_mask.view(b, q), (ancestors << 1) | 1)  # bit 63 lands on the int64 sign, as on the host
    put(v.parents.view(b, q), parents + 1)
    return depth


def tree_top(depth: Tensor | None, r: int, device) -> Tensor:
    """(R, 1) ``DraftTree.max_depth`` of trees whose node depths (under the root) are ``depth`` (R, n); None (no
    nodes): 0."""
    if depth is None:
        return torch.zeros(r, 1, dtype=torch.int64, device=device)
    return depth.max(1, keepdim=True).values + 1


def ancestry(parents: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Depth (0 under the root) and ancestor bitmask (self included) of each node of topologically ordered
    trees ``parents`` (R, n) (-1: the root) at most ``levels`` deep (``tree._depths_and_masks`` per row)."""
    r, n = parents.shape
    # (2, R, n): ancestor masks and depths. A parent's mask never holds the child's bit, so adding the child's
    # own bit is or-ing it: one gather, one add and one select per round for both
    base, step = _ancestry_start(r, n, parents.device)
    has, up = parents >= 0, parents.clamp(min=0).expand(2, r, n)
    state = base
    for _ in range(levels - 1):  # after k rounds every node less than k + 1 deep is right
        state = torch.where(has, state.gather(2, up) + step, base)
    return state[1], state[0]


@graph_constant(maxsize=64)
def _ancestry_start(r: int, n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(2, R, n) masks and depths of nodes under the root (own bit, depth 0), and (2, 1, n) what a parent adds
    (own bit, one level); made once per shape (read-only)."""
    own = torch.ones(n, dtype=torch.int64, device=device) << torch.arange(n, device=device)  # (n,)
    base = torch.stack([own.expand(r, n), torch.zeros(r, n, dtype=torch.int64, device=device)])
    return base, torch.stack([own, torch.ones_like(own)]).view(2, 1, n)


def _kept_columns(ranks: Tensor, n: int) -> Tensor:
    """(R, n) the columns of the nodes of score rank < n of each row of ``ranks`` (R, N), n < N, in level order."""
    m = ranks.shape[1]
    ar = torch.arange(m, device=ranks.device)
    return torch.where(ranks < n, ar, ar + m).sort(dim=1).values[:, :n]


def kept_ranks(out: Tensor, n: int) -> Tensor:
    """The score ranks (R, min(n, N)) of the nodes ``best_nodes_on_device`` keeps of a dynamic tree program's output
    ``out`` (R, 3, N), in the same (level) order: a node is kept by every budget above its rank, so what a smaller
    budget's tree would have accepted is read off an accepted path (``budget_policy.step_tokens``). (What the Triton
    tree writer, which returns tokens and parents alone, adds.)"""
    ranks = out[:, 2]
    return ranks.clone() if n >= ranks.shape[1] else ranks.gather(1, _kept_columns(ranks, n))


def best_nodes_on_device(out: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """``eagle_drafter.best_nodes`` of every row of a dynamic tree program's output (R, 3, N) on the device:
    tokens and parents (R, min(n, N)) of the nodes of score rank < n, in level order, parents re-indexed
    among them (-1: the root, also for a node whose parent was not kept), and their ranks (``kept_ranks``)."""
    tokens, parents, ranks = out.unbind(1)  # (R, N) each
    if n >= tokens.shape[1]:
        return tokens, parents, ranks.clone()
    keep = ranks < n  # (R, N): exactly n per row (ranks are a permutation)
    cols = _kept_columns(ranks, n)  # (R, n) kept nodes in level order
    new = keep.long().cumsum(1) - 1  # (R, N) index among the kept
    up = parents.gather(1, cols)  # (R, n)
    safe = up.clamp(min=0)
    kept_parent = (up >= 0) & keep.gather(1, safe)
    return tokens.gather(1, cols), torch.where(kept_parent, new.gather(1, safe), -1), ranks.gather(1, cols)
