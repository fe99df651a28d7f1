"""Greedy dynamic trees grown inside the EAGLE device program (EAGLE-2 style, fixed shapes).

A dynamic tree of shape (K, D, N) = (width, depth, nodes) grows D levels of K nodes per row:
level 0 holds the root's K most probable draft tokens; each later level forwards the previous
level's K nodes (the frontier: each reads its parent's draft state, its KV goes to the row's tree
region at index level * K + position, its attention mask is its ancestor bitmask over that region),
takes each frontier node's K most probable tokens as candidates scored parent score + draft log
probability, and keeps the row's best K candidates, best first, as the next level. The tree is the
row's best N of the K * D nodes by score (the sum of draft log probabilities along the path).

Tie rule: a node never scores above its parent; equal scores keep the earlier level, then the
earlier position in the level (a stable sort over level order), so every chosen node's ancestors
are chosen and the chosen set is a tree. Everything is tensor ops of fixed shapes over the batch:
the program is captured as one CUDA graph per batch bucket like the static loop, and the host reads
each row's (tokens, parents, ranks) once.

``dynamic:B`` drafts with the default frontier ``DEVICE_WIDTH`` x ``DEVICE_DEPTH`` levels and keeps
min(B, K * D) nodes; ``dynamic:B:KxD`` names the shape (see ``device_shape``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from specdec.drafters.eagle_device import CatchUp, DeviceDraftProgram
from specdec.kernels.topk import topk_logprobs
from specdec.kernels.tree_choose import tree_choose, tree_level
from specdec.tree import MAX_TREE_NODES
from specdec.tree_ops import choose, select_level
from specdec.tree_spec import TreeSpec

# ``dynamic:B`` on the device: levels of 10 nodes, 5 levels (4 draft forwards after the catch-up). Past 5 levels
# width adds more accepted tokens than depth: 10 x 5 keeping 31 nodes (a 32-token verify) accepts about as much
# as the host path's dynamic:63 (8 levels of 8, a 64-token verify), and wider or deeper shapes add little.
DEVICE_WIDTH = 10
DEVICE_DEPTH = 5

# expand(level, tokens (b, K) draft ids, parent_pos (b, K), masks (b, K)) -> (b, K, V) children's log probs
Expand = Callable[[int, Tensor, Tensor, Tensor], Tensor]
# topk(x (..., V), k) -> (values, indices) (..., k): the k largest over the draft vocabulary, best first
TopK = Callable[[Tensor, int], tuple[Tensor, Tensor]]


def torch_topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk`` over the last dimension: ``grow``'s default top-k."""
    return torch.topk(x, k, dim=-1)


class GrowOps(NamedTuple):
    """How ``grow`` ranks: ``children`` takes each row's K most probable children as (log probabilities,
    draft ids) from what ``expand`` returns (and from the root's); ``level`` is ``select_level`` (the level's
    best of the K * K candidates) and ``pick(scores, tokens, parents, n)`` is ``choose``. A device program
    passes the ops of ``kernels/topk.py`` and ``kernels/tree_choose.py`` (the kernels on the Triton backend)."""

    children: TopK = torch_topk  # on log probabilities; the op ``topk_logprobs`` reads logits
    level: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]] = select_level
    pick: Callable[[Tensor, Tensor, Tensor, int], Tensor] = choose


TORCH_OPS = GrowOps()


class DynamicShape(NamedTuple):
    """K frontier nodes per level, D levels, N nodes kept."""

    width: int
    depth: int
    nodes: int

    @property
    def region(self) -> int:
        """Tree-region slots whose draft KV the program writes (every level but the last)."""
        return self.width * (self.depth - 1)


def device_shape(spec: TreeSpec) -> DynamicShape:
    """The device shape of a dynamic spec: its own ``width`` x ``depth``, or DEVICE_WIDTH (at most the
    budget) x DEVICE_DEPTH (fewer when the region would pass 63 slots); nodes = min(budget, K * D)."""
    if spec.is_static:
        raise ValueError(f"spec must be a dynamic tree, got {spec}")
    if spec.width:
        return DynamicShape(spec.width, spec.depth, spec.budget)
    k = min(DEVICE_WIDTH, spec.budget)
    d = min(DEVICE_DEPTH, MAX_TREE_NODES // k + 1)
    return DynamicShape(k, d, min(spec.budget, k * d))


class GrowConsts(NamedTuple):
    """``grow``'s constant tensors of one shape (built once by a device program, so its graph holds no
    launches for them)."""

    bits: Tensor  # (D, K) int64: the bit of node (level, position) in its ancestor bitmask, 1 << level * K + position
    root: Tensor  # (1, K) int64 zeros: level 0's parent position (the root)
    parent_offset: Tensor  # (K * D,) int64: added to each node's parent position, its parent's region index


def grow_consts(shape: DynamicShape, device) -> GrowConsts:
    """``grow``'s constants for ``shape`` on ``device``."""
    k, d = shape.width, shape.depth
    idx = torch.arange(k * d, dtype=torch.int64, device=device)
    offset = (idx // k - 1) * k
    bits = torch.where(idx < shape.region, 1 << idx.clamp(max=62), 0)  # the last level has no region slots
    return GrowConsts(bits.view(d, k), torch.zeros(1, k, dtype=torch.int64, device=device),
                      torch.where(idx < k, -1, offset))


def grow(root_logp: Tensor, expand: Expand, shape: DynamicShape, ops: GrowOps = TORCH_OPS,
         consts: GrowConsts | None = None, vocab: Tensor | None = None) -> Tensor:
    """The trees of b rows from their roots' draft log probabilities ``root_logp`` (b, V).

    ``expand(level, tokens, parent_pos, masks)`` runs the draft on the K nodes of ``level`` (< D - 1) of
    every row: their draft ids (b, K), their parents' positions in the level before (b, K; level 0: 0,
    the root) and their ancestor bitmasks over the region (b, K; bit level * K + position is the node);
    it returns their children's log probabilities (b, K, V). Returns (b, 3, N) int64: per row the chosen
    nodes in level order as draft ids (``vocab[draft id]`` when ``vocab`` is given), parent index among
    them (-1: the root) and rank by score (0: best).
    ``ops`` rank (``GrowOps``; with a ``children`` that reads logits, ``root_logp`` and ``expand``'s results
    are logits). ``consts``: ``grow_consts(shape, device)``, built here when None.
    """
    k, d, n = shape
    b, dev = root_logp.shape[0], root_logp.device
    if not 1 <= k <= root_logp.shape[1] or not 1 <= n <= k * d:
        raise ValueError(f"shape {tuple(shape)}: width must be in [1, {root_logp.shape[1]}] (the draft "
                         f"vocabulary) and nodes in [1, width * depth]")
    bits, root, parent_offset = consts if consts is not None else grow_consts(shape, dev)
    score, toks = ops.children(root_logp, k)  # (b, K) each
    ppos = root.expand(b, k)  # (b, K)
    masks = bits[0].expand(b, k)  # (b, K)
    scores, tokens, parents = [score], [toks], [ppos]
    for level in range(1, d):
        top_val, top_idx = ops.children(expand(level - 1, toks, ppos, masks), k)  # (b, K, K): nodes' best children
        # the row's best K: scores, parent positions, draft ids, bitmasks (the last level's are never read)
        score, ppos, toks, masks = ops.level(score, top_val, top_idx, masks, bits[level])
        scores.append(score)
        tokens.append(toks)
        parents.append(ppos)  # position in the level before; + parent_offset: its region index
    tokens = torch.cat(tokens, 1)
    return ops.pick(torch.cat(scores, 1), tokens if vocab is None else vocab[tokens],
                    torch.cat(parents, 1) + parent_offset, n)


def _forwarded_levels(k: int, depth: int, device) -> list[tuple[Tensor, int, int]]:
    """The levels a program of ``k`` nodes per level forwards (all but the last): each level's tree region indices
    (level * k + position), its depth and the end of the region it attends."""
    return [(torch.arange(lv * k, lv * k + k, device=device), lv, (lv + 1) * k) for lv in range(depth - 1)]


class DeviceDynamicTree(DeviceDraftProgram):
    """The device program of dynamic trees of ``shape``: output (b, 3, N) int64 per row, the chosen nodes'
    target ids, parents among the chosen (-1: the root) and score ranks (``grow``)."""

    def __init__(self, model, pool, backend, shape: DynamicShape, batch_buckets: tuple[int, ...],
                 catch_up: int, bt_width: int, device) -> None:
        if shape.region > MAX_TREE_NODES or shape.width > len(model.vocab_ids):
            raise ValueError(f"shape {tuple(shape)}: width * (depth - 1) must be <= {MAX_TREE_NODES} and width "
                             f"<= {len(model.vocab_ids)} (the draft vocabulary)")
        self.shape = shape
        self._ops = GrowOps(*(functools.partial(op, use_triton=backend.uses_triton)
                              for op in (topk_logprobs, tree_level, tree_choose)))
        self._consts: dict[int, GrowConsts] = {}  # width -> grow's constants of levels that wide
        self._mask0: dict[tuple[int, int], Tensor] = {}  # (bucket, width) -> (b * width,) level 0's masks
        super().__init__(model, pool, backend, batch_buckets, catch_up, bt_width, device,
                         _forwarded_levels(shape.width, shape.depth, torch.device(device)))
        self._add_width(shape.width)

    def _add_width(self, k: int) -> None:
        """The constants of programs whose levels hold ``k`` nodes: their tree region is laid out k per level
        (node (level, position) at region index level * k + position), so a narrower program is the program of
        shape (k, D) and writes draft KV only inside the whole program's region."""
        if k in self._consts:
            return
        consts = self._consts[k] = grow_consts(DynamicShape(k, self.shape.depth, k * self.shape.depth), self.device)
        self._add_plans(k, _forwarded_levels(k, self.shape.depth, self.device))
        for b in self.batch_buckets:
            self._mask0[(b, k)] = consts.bits[0].repeat(b)

    def set_budgets(self, budgets) -> None:
        super().set_budgets(budgets)
        for _, width in self.variants:
            self._add_width(width)

    @property
    def max_levels(self) -> int:
        return self.shape.depth

    def levels_for(self, n: int) -> int:
        """The best n nodes of a tree lie within its first n levels (a node scores below its parent, and a tie keeps
        the earlier level), so n levels grow the same best n nodes as all D."""
        return min(n, self.shape.depth)

    @property
    def max_width(self) -> int:
        return self.shape.width

    def width_for(self, n: int) -> int:
        """The best n nodes of a tree lie within levels of n nodes: a kept node's parent is among the n best of
        its level and the node among its parent's n best children (every node ranked above it in its level or
        among its siblings scores at least as high, so is kept too), so levels of min(n, K) nodes keep the same
        best n nodes as levels of K, with fewer draft forwards and a smaller top-k per level."""
        return max(1, min(n, self.shape.width))

    def _no_trees(self, b: int) -> Tensor:
        """(b, 3, N): no token, parents -1, score rank N (not below any budget, so never kept)."""
        n = self.shape.nodes
        out = torch.zeros(b, 3, n, dtype=torch.int64, device=self.device)
        out[:, 1], out[:, 2] = -1, n
        return out

    def _grow(self, c: CatchUp, levels: int, width: int | None) -> Tensor:
        m, k = self.model, width
        consts = self._consts[k]
        state = c.state  # (b, K or 1, hidden): the draft states of the level before (first: the root)

        def expand(level: int, toks: Tensor, ppos: Tensor, masks: Tensor) -> Tensor:
            nonlocal state
            feats = state.gather(1, ppos.unsqueeze(-1).expand(c.b, -1, state.shape[-1])).flatten(0, 1)  # (b*K, h)
            flat = self._mask0[(c.b, k)] if level == 0 else masks.flatten()
            h, logits = self._forward(c, level, m.vocab_ids[toks], flat, feats)  # (b*K, hidden), (b*K, V)
            state = h.view(c.b, k, -1)
            return self._children_scores(c, logits.view(c.b, k, -1), level + 1)  # (b, K, V) logits

        # the children's top-k reads the logits: their log probabilities at the picks, no log_softmax launch
        root = self._children_scores(c, c.logits, 0).flatten(0, 1)  # (b, V)
        if levels >= self.shape.depth and k == self.shape.width:
            return grow(root, expand, self.shape, self._ops, consts, m.vocab_ids)  # (b, 3, N)
        # the first ``levels`` levels of k nodes: their best nodes, then nodes no budget they serve keeps (rank N)
        bits, zero, offset = consts
        shape = DynamicShape(k, levels, min(self.shape.nodes, k * levels))
        out = grow(root, expand, shape, self._ops, GrowConsts(bits[:levels], zero, offset[:k * levels]), m.vocab_ids)
        return torch.cat([out, self._idle[c.b][:, :, shape.nodes:]], 2)  # (b, 3, N)
