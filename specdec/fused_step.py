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

import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.drafters.base import Proposal
from specdec.graphs import cache_for
from specdec.runner import ForwardResult
from specdec.step_inputs import StepViews
from specdec.tree import DraftTree
from specdec.tree_writer import TreeWriter, verify_skeleton, write_trees


class FusedOutcome(NamedTuple):
    """What a fused step leaves for ``Verifier.verify_proposal``: the kept trees' tokens and depths and the
    verify's greedy acceptance, read in one copy (numpy), so results are built without ``DraftTree`` objects."""

    accept: np.ndarray  # (R, Q + 3) the verify's outcome: [m, bonus, path..., finite] per row (sampled rows: the
    #                    lossless rule's)
    tokens: np.ndarray  # (R, n) the kept trees' node tokens (every tree has n nodes)
    max_depth: np.ndarray  # (R,) node levels below the root of each tree (``DraftTree.max_depth``)
    kv_moved: bool = False  # the accepted paths' KV already moved on the device (``pipeline_hooks.advance``)
    ranks: np.ndarray | None = None  # (R, n) a dynamic tree's nodes' score ranks (``tree_writer.kept_ranks``)


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
                                                                                     Tensor, Tensor]:
        """``launch`` of the trees a dynamic program's output ``out`` (R, 3, N) keeps under budget ``n``
        (``best_nodes_on_device``), built on the device by ``self.writer``; also returns the kept trees' tokens
        and parents (R, min(n, N)), max depths (R, 1) and score ranks (R, min(n, N)), device tensors the verify
        does not overwrite."""
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
                                                                   Tensor | None, Tensor | None]:
        """The verify of bucket ``key`` over the first ``r`` rows' trees that the program's output ``out`` (r, ...)
        keeps under budget ``n``, its skeleton already on the device (``pipeline_hooks.advance``): the kept trees are
        written into the inputs and the forward replays. Returns its result, the kept tokens and parents ((r, k)
        device; parents None for a static template, whose shape the skeleton already holds), the trees'
        max depths ((r, 1)) and the kept nodes' score ranks ((r, k)); both None for a static template, whose
        budgets keep its first nodes (a node's index is its rank)."""
        b, q = key[1], key[2]
        views = self.runner.graphs.inputs.views(b, q)
        if self.dynamic:
            tokens, parents, top, ranks = self.writer(views, b, q, out, n)
        else:
            tokens, parents, top, ranks = out[:, :min(n, out.shape[1])].clone(), None, None, None
            write_trees(views, b, q, tokens, None, self.levels)
        self.steps += 1
        k = tokens.shape[1]
        fwd = self.runner._graphed_result(self.runner.graphs.replay(key), q, [k + 1] * r, ["all"] * r)
        return fwd, tokens, parents, top, ranks

    def launch_draft(self, draft: DeviceDraft) -> tuple[ForwardResult, Tensor, Tensor | tuple[int, ...],
                                                        Tensor | None, Tensor | None]:
        """The verify of the trees ``draft`` keeps: its result, their tokens (R, k) and parents ((R, k) on the
        device, or the static template's first k), max depths ((R, 1)) and score ranks ((R, k); both None for a
        static template), device tensors the verify does not overwrite."""
        k = min(draft.n, draft.out.shape[-1])
        if draft.bt is None:  # queued behind the step before: the skeleton is already on the device
            fwd, tokens, parents, top, ranks = self.relaunch(draft.key, len(draft.reqs), draft.out, draft.n)
        elif draft.parents is None:
            fwd, tokens, parents, top, ranks = self.launch_program(draft.key, draft.reqs, draft.out, draft.n, draft.bt)
        else:
            # the program's output lives in the graphs' shared memory pool, where the verify graph's own
            # intermediates may reuse it: the kept trees are copied out before the verify replays
            tokens, parents, top, ranks = draft.out[:, :k].clone(), draft.parents[:k], None, None
            fwd = self.launch(draft.key, draft.reqs, tokens, parents, draft.bt)
        return fwd, tokens, draft.parents[:k] if parents is None else parents, top, ranks

    def outcome(self, key, reqs: list, fwd: ForwardResult, k: int, ahead=None) -> Tensor:
        """(B, Q + 3) outcome of the fused verify ``fwd`` of bucket ``key`` whose trees have ``k`` nodes each:
        its greedy acceptance itself when every row is greedy, else with the sampled rows (and greedy ones with
        processed logits) through the lossless rule (``SampledRule.on_views``: the trees are read where the
        verify inputs hold them; ``ahead``: what the step before commits, ``repetition_penalty.committed_ahead``)."""
        sampled = [i for i, r in enumerate(reqs) if not r.plain_greedy]
        if not sampled:
            return fwd.accept
        graphs = self.runner.graphs
        views = graphs.inputs.views(key[1], key[2])
        return self.verifier.sampled_rule.on_views(reqs, sampled, k + 1, views, fwd.logits.logits, fwd.accept,
                                                   graphs.captured(key), ahead=ahead)

    def _tables(self, reqs: list, bt):
        """``bt``, or the rows' block tables (R, W) synced now."""
        if bt is None:
            self.runner.sync_tables(reqs)
            bt = self.runner.tables.host_rows([r.bt_row for r in reqs])
        return bt
