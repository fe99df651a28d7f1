"""The verify of an EAGLE step whose trees are still on the device, launched right behind the draft program.

The device draft program (``drafters/eagle_device.py``) leaves each row's tree on the device, and the drafter
proposes them as a ``DeviceDraft`` without reading them. ``Verifier.verify_proposal`` then launches the verify
with no host read between: the host writes what it knows before the trees exist (per row: the pending token,
its position and every query's KV slot, the row lengths and block table, laid out for the verify bucket of
``n`` nodes per row), a few tensor ops write the tree-dependent parts (node tokens, positions, ancestor masks,
parents) into the verify bucket's device inputs (``FusedVerify``), and the verify forward (a graph replay on
CUDA) follows at once. When the step has sampled rows, the sampled rule runs right behind the verify too,
reading the trees from the verify's inputs (``FusedVerify.outcome``). The host reads the trees and every row's
outcome in one copy and builds the ``VerifyResult`` rows from them (``_from_fused`` in ``specdec.verifier``).

Every tree of such a step has exactly ``n`` nodes (the adaptive budget ``n`` keeps each row's best n
nodes of the program's N, a static template its first n), so the verify bucket is chosen for n + 1
queries per row before the draft runs, and the kept nodes are gathered on the device.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.drafters.base import Proposal
from specdec.graphs import GraphCache, cache_for, graph_constant
from specdec.runner import ForwardResult
from specdec.step_inputs import PackedRows, StepViews
from specdec.tree import DraftTree, depths_and_masks, verify_rows_of


class FusedOutcome(NamedTuple):
    """What a fused step leaves for ``Verifier.verify_proposal``: the kept trees' tokens and depths and the
    verify's greedy acceptance, read in one copy (numpy), so results are built without ``DraftTree`` objects."""

    accept: np.ndarray  # (R, Q + 3) the verify's outcome: [m, bonus, path..., finite] per row (sampled rows: the
    #                    lossless rule's)
    tokens: np.ndarray  # (R, n) the kept trees' node tokens (every tree has n nodes)
    max_depth: np.ndarray  # (R,) node levels below the root of each tree (``DraftTree.max_depth``)
    kv_moved: bool = False  # the accepted paths' KV already moved on the device (``pipeline_hooks.advance``)


class FusedTrees(Sequence):
    """The ``DraftTree`` of each row of a fused step, built only when asked for (the results need none):
    ``tokens`` (R, n) and ``parents`` (R, n) host arrays (-1: the root; topological order), or one shape
    ``parents`` (a tuple of n) shared by every row. A device proposal's trees are known once its step is read:
    made empty, they are ``fill``-ed by the verifier."""

    def __init__(self, tokens: np.ndarray | None = None, parents: np.ndarray | tuple[int, ...] = ()) -> None:
        self.tokens, self.parents = tokens, parents
        self._trees: dict[int, DraftTree] = {}

    def fill(self, tokens: np.ndarray, parents: np.ndarray | tuple[int, ...]) -> None:
        """The trees as the step's read gave them (see the class docstring)."""
        self.tokens, self.parents = tokens, parents
        self._trees.clear()

    @property
    def num_nodes(self) -> int:
        """Nodes of every tree (``adaptive.max_nodes`` reads it)."""
        return self.tokens.shape[1]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # IndexError past the end, negative indices from the end
        tree = self._trees.get(i)
        if tree is None:
            parents = self.parents if isinstance(self.parents, tuple) else self.parents[i].tolist()
            tree = self._trees[i] = DraftTree.of_parents(self.tokens[i].tolist(), list(parents))
        return tree


class StepClock:
    """Marks on the device timeline (CUDA events) or the host clock (CPU, where every op is synchronous);
    ``seconds`` is read after the step's one host read, so it never waits."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


class DeviceDraft:
    """An EAGLE proposal whose trees are still on the device: the draft program's output ``out`` for ``reqs``
    ((R, 3, N) tokens, parents and score ranks of a dynamic tree; (R, N) tokens of the static template whose
    ``parents`` it is, else None), kept under budget ``n``, verified in graph bucket ``key``. ``bt`` (R, W): the
    rows' host block tables, synced by the catch-up (None: the verify's skeleton is already on the device, written
    from the step before: ``pipeline_hooks.EagleAhead``). ``clock`` marks ``start`` and ``drafted`` time the program."""

    def __init__(self, reqs: list, key: tuple, out: Tensor, n: int, bt: np.ndarray | None,
                 parents: tuple[int, ...] | None, clock: StepClock, start, drafted) -> None:
        self.reqs, self.key, self.out, self.n, self.bt, self.parents = reqs, key, out, n, bt, parents
        self.clock, self.start, self.drafted = clock, start, drafted

    @property
    def draft_seconds(self) -> float:
        """The draft program's share of the step (read after the step's read, so it never waits)."""
        return self.clock.seconds(self.start, self.drafted)

    def proposal(self, rows: int, device=None) -> Proposal:
        """The proposal of ``rows`` trees on the device (``device``: what carries them, by default this draft); its
        trees are filled once the step is read."""
        return Proposal(FusedTrees(), [frozenset()] * rows, self if device is None else device)


class FusedVerify:
    """Launches a verify forward over trees that are still device tensors (see the module docstring).

    ``nodes``: the draft program's nodes per row (N); ``levels``: its trees have at most this many levels
    below the root; ``dynamic``: the program grows dynamic trees (``launch_program``). ``steps`` counts the
    verify forwards launched.
    """

    def __init__(self, verifier, nodes: int, levels: int, dynamic: bool = False) -> None:
        self.verifier, self.runner = verifier, verifier.runner
        self.nodes, self.levels, self.dynamic = nodes, levels, dynamic
        self.clock = StepClock(self.runner.device)
        self.writer = TreeWriter(levels, self.runner.device,  # dynamic trees' verify inputs (``launch_program``)
                                 graphs=cache_for(self.runner.graphs, "tree writer", self.runner.device),
                                 use_triton=self.runner.backend.uses_triton)
        self.steps = 0

    def key(self, rows: int, nodes: int):
        """The graph bucket of the verify of ``rows`` trees of ``nodes`` nodes, or None (then: unfused)."""
        return self.runner.packed_key(0, rows, nodes + 1, self.verifier.aux_layers)

    def prepare(self, budgets: Sequence[int]) -> int:
        """Capture the tree-building graphs of a dynamic program's batch buckets under each of ``budgets``
        now (CUDA), so no step pays a capture in the middle of a run (the first timed batch-64 run paid ~1 s).
        Returns the graphs captured."""
        graphs = self.runner.graphs
        if not (self.dynamic and self.writer.capture) or graphs is None:
            return 0
        before = len(self.writer.graphs)
        for b in graphs.batch_buckets:
            dummy = torch.zeros(b, 3, self.nodes, dtype=torch.int64, device=self.runner.device)  # (b, 3, N)
            # a chain: any tree with valid parents and score ranks does
            dummy[:, 1] = torch.arange(-1, self.nodes - 1, device=dummy.device)
            dummy[:, 2] = torch.arange(self.nodes, device=dummy.device)
            for n in sorted(set(budgets)):
                key = self.key(b, min(n, self.nodes))
                if key is not None:
                    self.writer(graphs.inputs.views(b, key[2]), b, key[2], dummy, n)
        return len(self.writer.graphs) - before

    def launch(self, key, reqs: list, tokens: Tensor, parents: Tensor | tuple[int, ...], bt=None) -> ForwardResult:
        """Run the verify forward of bucket ``key`` over ``reqs`` whose trees are ``tokens`` (R, n) target ids
        and ``parents`` (index among the row's nodes, -1: the root; topological order): (R, n) on the device,
        or one host tuple of n shared by every row (a static template: then only the tokens are written on
        the device). ``bt``: the rows' host block tables (R, W), already synced (None: synced here). Nothing is
        read back: the result's ``accept`` and ``features`` are device tensors."""
        n = tokens.shape[1]
        shared = parents if isinstance(parents, tuple) else None
        bt = self._tables(reqs, bt)
        packed = verify_skeleton(reqs, n, key[2], bt, self.runner.pool.block_size, shared)

        def write(views: StepViews) -> None:
            write_trees(views, key[1], key[2], tokens, parents if shared is None else None, self.levels)

        self.steps += 1
        return self.runner.forward_packed(key, reqs, packed, [n + 1] * len(reqs), on_device=write, bt_rows=bt)

    def launch_program(self, key, reqs: list, out: Tensor, n: int, bt=None) -> tuple[ForwardResult, Tensor, Tensor,
                                                                                     Tensor]:
        """``launch`` of the trees a dynamic program's output ``out`` (R, 3, N) keeps under budget ``n``
        (``best_nodes_on_device``), built on the device by ``self.writer``; also returns the kept trees' tokens
        and parents (R, min(n, N)) and max depths (R, 1), device tensors the verify does not overwrite."""
        k = min(n, out.shape[2])
        bt = self._tables(reqs, bt)
        packed = verify_skeleton(reqs, k, key[2], bt, self.runner.pool.block_size)
        built = []

        def write(views: StepViews) -> None:
            built.append(self.writer(views, key[1], key[2], out, n))

        self.steps += 1
        fwd = self.runner.forward_packed(key, reqs, packed, [k + 1] * len(reqs), on_device=write, bt_rows=bt)
        return fwd, *built[0]

    def relaunch(self, key, r: int, out: Tensor, n: int) -> tuple[ForwardResult, Tensor, Tensor | None,
                                                                   Tensor | None]:
        """The verify of bucket ``key`` over the first ``r`` rows' trees that the program's output ``out`` (r, ...)
        keeps under budget ``n``, its skeleton already on the device (``pipeline_hooks.advance``): the kept trees are
        written into the inputs and the forward replays. Returns its result, the kept tokens and parents ((r, k)
        device; parents None for a static template, whose shape the skeleton already holds) and the trees'
        max depths ((r, 1); None for a static template)."""
        b, q = key[1], key[2]
        views = self.runner.graphs.inputs.views(b, q)
        if self.dynamic:
            tokens, parents, top = self.writer(views, b, q, out, n)
        else:
            tokens, parents, top = out[:, :min(n, out.shape[1])].clone(), None, None
            write_trees(views, b, q, tokens, None, self.levels)
        self.steps += 1
        k = tokens.shape[1]
        fwd = self.runner._graphed_result(self.runner.graphs.replay(key), q, [k + 1] * r, ["all"] * r)
        return fwd, tokens, parents, top

    def launch_draft(self, draft: DeviceDraft) -> tuple[ForwardResult, Tensor, Tensor | tuple[int, ...],
                                                        Tensor | None]:
        """The verify of the trees ``draft`` keeps: its result, their tokens (R, k) and parents ((R, k) on the
        device, or the static template's first k) and max depths ((R, 1); None for a static template), device
        tensors the verify does not overwrite."""
        k = min(draft.n, draft.out.shape[-1])
        if draft.bt is None:  # queued behind the step before: the skeleton is already on the device
            fwd, tokens, parents, top = self.relaunch(draft.key, len(draft.reqs), draft.out, draft.n)
        elif draft.parents is None:
            fwd, tokens, parents, top = self.launch_program(draft.key, draft.reqs, draft.out, draft.n, draft.bt)
        else:
            # the program's output lives in the graphs' shared memory pool, where the verify graph's own
            # intermediates may reuse it: the kept trees are copied out before the verify replays
            tokens, parents, top = draft.out[:, :k].clone(), draft.parents[:k], None
            fwd = self.launch(draft.key, draft.reqs, tokens, parents, draft.bt)
        return fwd, tokens, draft.parents[:k] if parents is None else parents, top

    def outcome(self, key, reqs: list, fwd: ForwardResult, k: int) -> Tensor:
        """(B, Q + 3) outcome of the fused verify ``fwd`` of bucket ``key`` whose trees have ``k`` nodes each:
        its greedy acceptance itself when every row is greedy, else with the sampled rows (and greedy ones with a
        repetition penalty) through the lossless rule (``SampledRule.on_views``: the trees are read where the
        verify inputs hold them)."""
        sampled = [i for i, r in enumerate(reqs) if not r.params.plain_greedy]
        if not sampled:
            return fwd.accept
        graphs = self.runner.graphs
        views = graphs.inputs.views(key[1], key[2])
        return self.verifier.sampled_rule.on_views(reqs, sampled, k + 1, views, fwd.logits.logits, fwd.accept,
                                                   graphs.captured(key))

    def _tables(self, reqs: list, bt):
        """``bt``, or the rows' block tables (R, W) synced now."""
        if bt is None:
            self.runner.sync_tables(reqs)
            bt = self.runner.tables.host_rows([r.bt_row for r in reqs])
        return bt


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

    def __call__(self, views: StepViews, b: int, q: int, out: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Write the trees ``out`` (R, 3, N) keeps under budget ``n`` into bucket (b, q)'s ``views``: their tokens
        and parents (R, min(n, N)) and each tree's ``DraftTree.max_depth`` (R, 1)."""
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
               live: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if self.use_triton:  # one launch (``kernels/tree_write.py``) instead of the ~30 small ops below
            from specdec.kernels.tree_write import tree_write_triton

            return tree_write_triton(views, b, q, src, n, self.levels, live)
        tokens, parents = best_nodes_on_device(src, n)
        depth = write_trees(views, b, q, tokens, parents, self.levels, live)
        return tokens, parents, tree_top(depth, tokens.shape[0], tokens.device)


@graph_constant(maxsize=256)
def _live_rows(b: int, r: int, device: torch.device) -> Tensor:
    """(b, 1) bool: the first ``r`` rows of a bucket of ``b`` are live (read only)."""
    return (torch.arange(b, device=device) < r).view(b, 1)


@graph_constant(maxsize=64)
def _no_trees(r: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """``TreeWriter``'s result for ``r`` trees of no nodes: tokens and parents (r, 0), max depths 0 (r, 1); read
    only, so one set per row count serves every step."""
    empty = torch.zeros(r, 0, dtype=torch.int64, device=device)
    return empty, empty, torch.zeros(r, 1, dtype=torch.int64, device=device)


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


def best_nodes_on_device(out: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``eagle_drafter.best_nodes`` of every row of a dynamic tree program's output (R, 3, N) on the device:
    tokens and parents (R, min(n, N)) of the nodes of score rank < n, in level order, parents re-indexed
    among them (-1: the root, also for a node whose parent was not kept)."""
    tokens, parents, ranks = out.unbind(1)  # (R, N) each
    m = tokens.shape[1]
    if n >= m:
        return tokens, parents
    ar = torch.arange(m, device=out.device)
    keep = ranks < n  # (R, N): exactly n per row (ranks are a permutation)
    cols = torch.where(keep, ar, ar + m).sort(dim=1).values[:, :n]  # (R, n) kept nodes in level order
    new = keep.long().cumsum(1) - 1  # (R, N) index among the kept
    up = parents.gather(1, cols)  # (R, n)
    safe = up.clamp(min=0)
    kept_parent = (up >= 0) & keep.gather(1, safe)
    return tokens.gather(1, cols), torch.where(kept_parent, new.gather(1, safe), -1)
