"""Stochastic (lossless) verification of a whole batch of trees on the device: no host reads.

The rule is ``specdec.acceptance.verify_stochastic``'s (../shared/DESIGN.md, "Draft trees and
verification"), vectorised over rows: every row walks down its tree one tried child per step. A step
tries the next child x of the row's current node against the row's current target distribution p:
accepted with probability min(1, p(x)/q_i(x)) (the row moves to x and p becomes the target's
distribution there), else p <- normalize(max(p - q_i, 0)) and the next sibling is tried. q_i is the
row's draft distribution for iid children, the previous one with x removed for children drawn without
replacement, and a point mass on x for deterministic children. A row whose current node has no
untried child stops; its bonus token is then sampled from its final p. Each node is tried at most
once, so a tree of n nodes needs at most n steps: the loop runs over steps, never over rows or nodes.

Trees whose children are all deterministic (n-gram chains, trees the draft grew by rank, empty trees) take
the equivalent single-draw form instead (``accept_deterministic_padded``, ``acceptance.walk_deterministic``):
one draw from the target distribution at every verify token, then the greedy walk with the drawn tokens in
place of the argmax. That is a fixed handful of ops over (B, Q, V) whatever the tree's shape.

Layout: padded (B, Q) like ``accept_greedy_padded``; verify token 0 is the root. The random numbers
are each request's next ones of its ``uniform_stream.UniformStream`` (``draw_uniforms``, or
``padded_uniforms`` inside a captured step) in the layout of ``verify_stochastic``, so a seeded request
samples the same on both paths up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specdec.acceptance_batched import accept_greedy_padded
from specdec.kernels.nucleus import filtered_probs
from specdec.tree import CHILD_MODES, ROOT, DraftTree
from specdec.uniform_stream import UniformStream, padded_uniforms

MODE_CODE = {m: i for i, m in enumerate(CHILD_MODES)}  # child_mode -> int64 code of PaddedTrees.child_mode
_DET, _WOR = MODE_CODE["deterministic"], MODE_CODE["without_replacement"]


class PaddedTrees(NamedTuple):
    """Draft trees of a batch in the padded verify layout, on one device (``pad_trees`` builds them)."""

    tokens: Tensor  # (B, Q) int64 verify tokens (token 0, the root, is not read)
    parents: Tensor  # (B, Q) int64 parent verify index; -1 for the root and padding
    tree_mask: Tensor  # (B, Q) int64 bit j set iff verify token j is the token itself or an ancestor
    dist_index: Tensor  # (B, Q) int64 row of `dists` each token was drawn from; -1: none (root, padding, deterministic)
    num_tokens: Tensor  # (B,) int64 real verify tokens per row (root included; 0 for a padded row)
    child_mode: Tensor  # (B,) int64 MODE_CODE of the row's tree
    dists: Tensor | None  # (R, V) float32/float64 draft distributions of all rows, stacked; None if none
    max_trials: int  # host bound on the children any row can try (loop length); at most Q - 1
    modes: frozenset[str] = frozenset(CHILD_MODES)  # host: child modes present (fewer = less work per step)


class RowSampling(NamedTuple):
    """Per-row sampling parameters as tensors on the device (``SamplingParams`` semantics)."""

    temperature: Tensor  # (B,) float; 0 = greedy
    top_k: Tensor  # (B,) int64; 0 = off
    top_p: Tensor  # (B,) float in (0, 1]; 1 = off
    filtered: bool = True  # host flag: False promises no row uses top-k/top-p/min-p (skips the sort)
    any_greedy: bool = True  # host flag: False promises no row has temperature 0 (skips the greedy rule)
    min_p: Tensor | None = None  # (B,) float in [0, 1]; 0 = off; None: 0 for every row


def sampling_rows(params: Sequence, device: torch.device | str) -> RowSampling:
    """``RowSampling`` of SamplingParams-like objects (temperature, top_k, top_p, min_p if they have it): one
    host->device copy."""
    host = torch.tensor([[p.temperature, p.top_k, p.top_p, getattr(p, "min_p", 0.0)] for p in params],
                        dtype=torch.float64).reshape(-1, 4)
    dev = host.to(device)  # (B, 4)
    filtered = any((p.top_k or 0) > 0 or p.top_p < 1.0 or getattr(p, "min_p", 0.0) > 0 for p in params)
    return RowSampling(dev[:, 0], dev[:, 1].long(), dev[:, 2], filtered, any(p.temperature == 0 for p in params),
                       dev[:, 3])


def pad_trees(trees: Sequence[DraftTree], q: int, device: torch.device | str) -> PaddedTrees:
    """The trees in the padded layout with Q = q verify tokens per row (q >= every tree's nodes + 1).

    Integer arrays come from the trees' host views and reach the device in one copy; draft
    distributions (already on the device) are concatenated, their row indices shifted to match."""
    rows_host, dists, offset, trials = [], [], 0, 0  # per row: tokens, parents, mask, dist_index (Q each), n, mode
    for i, t in enumerate(trees):
        n = t.num_nodes + 1
        if n > q:
            raise ValueError(f"trees[{i}] has {n - 1} nodes; at most q - 1 = {q - 1} fit")
        dist_index = [-1] * q
        if t.draft_dists is not None and t.child_mode != "deterministic":
            dist_index[1:n] = [d + offset for d in t.host.dist_index]
            dists.append(t.draft_dists)
            offset += t.draft_dists.shape[0]
        rows_host.append([*tree_rows(t, q), *dist_index, n, MODE_CODE[t.child_mode]])
        trials = max(trials, _max_trials(t))
    host = torch.tensor(rows_host, dtype=torch.int64).reshape(len(trees), 4 * q + 2)
    dev = host.to(device)
    stacked = None
    if dists:
        dtype = torch.float64 if any(d.dtype == torch.float64 for d in dists) else torch.float32
        stacked = torch.cat([d.to(device=device, dtype=dtype) for d in dists])  # (R, V)
    return PaddedTrees(dev[:, :q], dev[:, q:2 * q], dev[:, 2 * q:3 * q], dev[:, 3 * q:4 * q], dev[:, 4 * q],
                       dev[:, 4 * q + 1], stacked, trials, frozenset(t.child_mode for t in trees if t.num_nodes))


def tree_rows(tree: DraftTree, q: int) -> list[int]:
    """(3 Q,) host ints of one tree's padded row: verify tokens (the root's 0), parents (-1: root, padding),
    tree masks (0: padding). The caller checks that the tree fits (nodes + 1 <= q)."""
    masks, parents = tree.verify_rows()
    pad = [0] * (q - len(parents))
    return [0, *tree.host.tokens, *pad, *parents, *[-1] * len(pad), *masks, *pad]


def _max_trials(tree: DraftTree) -> int:
    """The most children one walk down ``tree`` can try: reaching node v costs its rank + 1 among its
    siblings at every level, and at the last node every child may be tried."""
    h = tree.host
    reach = {ROOT: 0}
    for parent in [ROOT, *range(tree.num_nodes)]:  # topological: a parent is reached before its children
        for rank, c in enumerate(h.children[parent]):
            reach[c] = reach[parent] + rank + 1
    return max(reach[v] + len(h.children[v]) for v in reach)


def draw_uniforms(streams: Sequence[UniformStream | None], trees: Sequence[DraftTree], q: int,
                  device: torch.device | str) -> Tensor:
    """(B, Q) float64 uniforms in [0, 1): per row the next n + 1 of its request's stream (n tree nodes),
    exactly what ``verify_stochastic`` draws, in ``padded_uniforms``' layout (node c's number at column c + 1,
    the bonus token's at column 0), computed on ``device`` from one copy of the rows' keys and counters; the
    streams advance by n + 1. Rows without a stream (greedy) draw nothing and get zeros."""
    host = np.zeros((4, len(trees)), dtype=np.int64)  # key0, key1, counter, num_tokens (0: no stream)
    for i, (s, t) in enumerate(zip(streams, trees, strict=True)):
        if s is not None:
            host[:, i] = s.key0, s.key1, s.counter, t.num_nodes + 1
            s.counter += t.num_nodes + 1
    key0, key1, counter, num_tokens = torch.from_numpy(host).to(device)  # (B,) each
    u = padded_uniforms(key0, key1, counter, num_tokens, q)  # (B, Q)
    return torch.where((num_tokens > 0).view(-1, 1), u, 0.0)


def shape_probs_rows(logits: Tensor, sampling: RowSampling, use_triton: bool = False) -> Tensor:
    """``shape_probs`` with per-row parameters: (B, ..., V) logits -> (B, ..., V) probabilities (float32 or
    wider), row b shaped with temperature[b], top_k[b], top_p[b], min_p[b]; the same values ``shape_probs`` gives.

    Inside the captured rule each op here is a kernel over (B, Q, V), so the host flags skip what no row needs
    (the filter without top-k/top-p/min-p, the one-hot without greedy rows), and per-row choices are folded into
    (B,) factors where that gives the same bits (dividing by 1, comparing with +inf). ``use_triton``: the filter
    is ``kernels.nucleus``' kernel (no sort), else its sort-based reference."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (B, ..., V)
    view = (-1,) + (1,) * (x.dim() - 1)  # per-row parameter -> broadcast over (..., V)
    t = sampling.temperature.to(x.dtype).view(view)
    greedy = t == 0 if sampling.any_greedy else None
    if greedy is not None:
        t = torch.where(greedy, torch.ones_like(t), t)
    probs = torch.softmax(x / t, dim=-1)  # (B, ..., V)
    if sampling.filtered:
        probs = filtered_probs(x, t, probs, sampling, use_triton=use_triton)
    if greedy is None:
        return probs
    top = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)  # one-hot argmax (first maximum)
    return torch.where(greedy, top, probs)


def accept_stochastic_padded(logits: Tensor, trees: PaddedTrees, sampling: RowSampling, uniforms: Tensor,
                             ) -> Tensor:  # (B, Q + 2) int64: [m, bonus, accepted verify indices (first m valid)]
    """Per row, the accepted path and bonus token of the lossless rule, in ``accept_greedy_padded``'s layout.

    logits: (B, Q, V) target logits at the verify tokens; uniforms: (B, Q) float64 from ``draw_uniforms``.
    Rows with temperature 0 get ``accept_greedy_padded``'s answer exactly; padded rows (num_tokens 0)
    accept nothing (their bonus is meaningless). No host reads; the work done depends only on the inputs'
    shapes and the host fields of ``trees`` and ``sampling``, so the call can be captured in a CUDA graph."""
    b, q, vocab = _check(logits, trees, sampling, uniforms)
    probs = shape_probs_rows(logits, sampling)  # (B, Q, V)
    single = _deterministic_outcome(probs, trees, uniforms)  # (B, Q + 2): the rows with deterministic children
    if not trees.modes - {"deterministic"}:  # (a greedy row's distribution is one-hot: its draws are the argmax)
        return single
    dists = trees.dists
    if dists is not None:
        probs = probs.to(torch.promote_types(probs.dtype, dists.dtype))
        dists = dists.to(probs.dtype)
    idx = torch.arange(q, device=logits.device)
    first_child, next_sibling = _links(trees.parents, trees.num_tokens)
    det = (trees.child_mode == _DET).view(-1, 1)  # (B, 1)
    wor = (trees.child_mode == _WOR).view(-1, 1) if "without_replacement" in trees.modes else None

    def draft_row(child: Tensor) -> Tensor:  # (B, 1) verify index (q = none) -> (B, V) its draft distribution
        di = trees.dist_index.gather(1, child.clamp(max=q - 1))  # (B, 1)
        return dists[di.clamp(min=0).view(-1)] * ((child < q) & (di >= 0))

    nxt = first_child[:, :1]  # (B, 1) next child to try; q = none (the row has stopped)
    p = probs[:, 0]  # (B, V) target distribution at the current node, after the rejections so far
    q_cur = None if dists is None else draft_row(nxt)  # (B, V) draft distribution of the next child
    on_path = torch.zeros(b, q, dtype=torch.bool, device=logits.device)
    for _ in range(trees.max_trials):
        live = nxt < q  # (B, 1)
        c = nxt.clamp(max=q - 1)
        x = trees.tokens.gather(1, c)  # (B, 1)
        point = torch.zeros_like(p).scatter_(1, x, 1.0)  # (B, V) point mass on x: the deterministic q_i
        q_i = point if q_cur is None else torch.where(det, point, q_cur)
        px, qx = p.gather(1, x).double(), q_i.gather(1, x).double()
        a = torch.where(qx > 0, torch.clamp(px / qx.clamp(min=1e-300), max=1.0), 0.0)  # min(1, p(x)/q_i(x))
        acc = live & (uniforms.gather(1, c) < a)
        rej = live & ~acc
        at_child = probs.gather(1, c.unsqueeze(-1).expand(b, 1, vocab)).squeeze(1)  # (B, V)
        p = torch.where(acc, at_child, torch.where(rej, _residual(p, q_i), p))
        child_first = first_child.gather(1, c)
        if q_cur is not None:
            after = q_cur if wor is None else torch.where(rej & wor, _remove(q_cur, point), q_cur)
            q_cur = torch.where(acc, draft_row(child_first), after)
        nxt = torch.where(acc, child_first, torch.where(rej, next_sibling.gather(1, c), nxt))
        on_path |= acc & (idx.view(1, -1) == c)
    bonus = _sample(p, uniforms[:, :1])  # (B, 1)
    count = on_path.sum(1, keepdim=True)
    order = torch.where(on_path, idx, idx + q).argsort(dim=1)  # path indices first, in depth order
    out = torch.where(det, single, torch.cat([count, bonus, order], dim=1))  # (B, Q + 2)
    return _keep_greedy_rows(out, logits, trees, sampling)


def accept_deterministic_padded(logits: Tensor, trees: PaddedTrees, sampling: RowSampling, uniforms: Tensor,
                                ) -> Tensor:  # (B, Q + 2) int64, ``accept_stochastic_padded``'s layout
    """``accept_stochastic_padded`` for rows whose children are all deterministic (the caller vouches; rows'
    ``child_mode`` is not read), without a loop: ``acceptance.walk_deterministic`` for every row at once."""
    _check(logits, trees, sampling, uniforms)
    return _deterministic_outcome(shape_probs_rows(logits, sampling), trees, uniforms)  # (greedy rows: the argmax)


def accept_deterministic_walk(logits: Tensor, trees: PaddedTrees, sampling: RowSampling, uniforms: Tensor,
                              levels: int) -> Tensor:  # (B, Q + 2) int64, ``accept_stochastic_padded``'s layout
    """``accept_deterministic_padded``'s outcome, drawing only where the walk goes: round d shapes and samples the
    target distribution at every row's depth-d path node (B, V), so the filtering sort covers B * (levels + 1)
    distributions instead of B * Q. ``levels`` is a host bound on the trees' levels below the root (a row still
    walking after levels + 1 rounds would have no bonus token: the caller vouches for the bound)."""
    b, q, _ = _check(logits, trees, sampling, uniforms)
    idx = torch.arange(q, device=logits.device)  # (Q,)
    rows = torch.arange(b, device=logits.device)  # (B,)
    is_node = (idx.view(1, -1) < trees.num_tokens.view(-1, 1)) & (trees.parents >= 0)  # (B, Q)
    cur = torch.zeros(b, dtype=torch.int64, device=logits.device)  # (B,) the row's current node (0: the root)
    live = torch.ones(b, dtype=torch.bool, device=logits.device)  # (B,) the row's walk goes on
    bonus = torch.zeros_like(cur)
    on_path = torch.zeros(b, q, dtype=torch.bool, device=logits.device)
    for _ in range(levels + 1):
        probs = shape_probs_rows(logits[rows, cur], sampling)  # (B, V) at the current nodes
        y = _sample(probs, uniforms.gather(1, cur.view(-1, 1))).view(-1)  # (B,) the draw there
        match = is_node & (trees.parents == cur.view(-1, 1)) & (trees.tokens == y.view(-1, 1))  # (B, Q)
        child = torch.where(match, idx, q).min(-1).values  # (B,) the first child drawn; q = none
        found = live & (child < q)
        bonus = torch.where(live & ~found, y, bonus)
        on_path |= found.view(-1, 1) & (idx.view(1, -1) == child.view(-1, 1))
        cur = torch.where(found, child, cur)
        live = found
    count = on_path.sum(1, keepdim=True)  # (B, 1)
    order = torch.where(on_path, idx, idx + q).argsort(dim=1)  # (B, Q) path indices first, in depth order
    return torch.cat([count, bonus.view(-1, 1), order], dim=1)


def _deterministic_outcome(probs: Tensor, trees: PaddedTrees, uniforms: Tensor) -> Tensor:
    """(B, Q + 2) single-draw outcome: verify token j draws y_j from probs[:, j] with uniforms[:, j] (the root's is
    column 0, node c's column c + 1: ``walk_deterministic``'s coins), then the greedy walk follows the children
    whose tokens were drawn at their parents and takes y at the path's end as the bonus."""
    drawn = _sample(probs, uniforms.unsqueeze(-1)).squeeze(-1)  # (B, Q)
    return accept_greedy_padded(trees.tokens, trees.parents, trees.tree_mask, drawn, trees.num_tokens)


def _keep_greedy_rows(out: Tensor, logits: Tensor, trees: PaddedTrees, sampling: RowSampling) -> Tensor:
    """(B, Q + 2) ``out`` with the rows of temperature 0 replaced by ``accept_greedy_padded``'s outcome."""
    if not sampling.any_greedy:
        return out
    greedy = accept_greedy_padded(trees.tokens, trees.parents, trees.tree_mask, logits.argmax(-1), trees.num_tokens)
    return torch.where((sampling.temperature == 0).view(-1, 1), greedy, out)


def _remove(q_cur: Tensor, point: Tensor) -> Tensor:
    """(B, V) the next without-replacement draft distribution: q_cur without the drawn token, renormalized
    (all zeros once q_cur's support is used up)."""
    r = q_cur.masked_fill(point > 0, 0.0)
    left = r.sum(-1, keepdim=True)
    return torch.where(left > 0, r / left, torch.zeros_like(r))


def _residual(p: Tensor, q_i: Tensor) -> Tensor:
    """(B, V) target distribution after rejecting a draw from q_i: normalize(max(p - q_i, 0)), or p where that
    has no mass (then p <= q_i everywhere and rejection happened only through rounding)."""
    r = (p - q_i).clamp(min=0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass, p)


def _links(parents: Tensor, num_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(B, Q) first child and next sibling (verify indices, in index order) of every verify token; Q = none."""
    b, q = parents.shape
    idx = torch.arange(q, device=parents.device)
    is_node = (idx.view(1, -1) < num_tokens.view(-1, 1)) & (parents >= 0)  # (B, Q)
    child_of = (parents.unsqueeze(1) == idx.view(1, -1, 1)) & is_node.unsqueeze(1)  # (B, Q parent, Q child)
    first_child = torch.where(child_of, idx, q).min(-1).values  # (B, Q)
    sibling = (parents.unsqueeze(2) == parents.unsqueeze(1)) & is_node.unsqueeze(1)  # (B, Q, Q later)
    sibling &= idx.view(1, 1, -1) > idx.view(1, -1, 1)
    next_sibling = torch.where(sibling, idx, q).min(-1).values  # (B, Q)
    return first_child, next_sibling


def _sample(p: Tensor, u: Tensor) -> Tensor:
    """(..., 1) tokens that uniforms u (..., 1) select from the rows of p (..., V) by inverse CDF, like
    ``sample_token``."""
    cdf = p.cumsum(-1)  # (..., V)
    y = torch.searchsorted(cdf, cdf[..., -1:] * u.to(cdf.dtype), right=True)  # (..., 1)
    vocab = torch.arange(p.shape[-1], device=p.device)
    last = torch.where(p > 0, vocab, 0).max(-1, keepdim=True).values  # u * total rounded up: the last possible token
    return torch.where(y < p.shape[-1], y, last)


def _check(logits: Tensor, trees: PaddedTrees, sampling: RowSampling, uniforms: Tensor) -> tuple[int, int, int]:
    if not isinstance(logits, Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a (B, Q, V) float tensor, got {getattr(logits, 'shape', type(logits))}")
    b, q, vocab = logits.shape
    if tuple(trees.tokens.shape) != (b, q):
        raise ValueError(f"trees.tokens must have shape (B, Q) = {(b, q)} like logits, got {tuple(trees.tokens.shape)}")
    if tuple(uniforms.shape) != (b, q) or uniforms.dtype != torch.float64:
        raise ValueError(f"uniforms must be (B, Q) = {(b, q)} float64, got {tuple(uniforms.shape)} {uniforms.dtype}")
    for name in ("temperature", "top_k", "top_p", "min_p"):
        if getattr(sampling, name) is None:
            continue
        shape = tuple(getattr(sampling, name).shape)
        if shape != (b,):
            raise ValueError(f"sampling.{name} must have shape (B,) = ({b},), got {shape}")
    if trees.dists is None and trees.modes - {"deterministic"}:
        raise ValueError(f"trees.dists is required for child modes {sorted(trees.modes - {'deterministic'})}")
    if trees.dists is not None and trees.dists.shape[1] != vocab:
        raise ValueError(f"trees.dists must have V = {vocab} columns like logits, got {trees.dists.shape[1]}")
    if not 0 <= trees.max_trials < q:
        raise ValueError(f"trees.max_trials must be in [0, {q - 1}], got {trees.max_trials}")
    return b, q, vocab
