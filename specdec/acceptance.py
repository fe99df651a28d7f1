"""Sampling distributions and the lossless accept/reject rules of tree verification.

Pure functions. `shape_probs` is the one place where temperature / top-k / top-p / min-p turn
logits into the distribution that is sampled, for the target and the draft alike (a repetition penalty
changes the logits before, ``repetition_penalty``).
Verification follows ../shared/DESIGN.md ("Draft trees and verification"): at a node
with target distribution p, children x_1..x_k drawn with distributions q_1..q_k are
tried in order; x_i is accepted with probability min(1, p(x_i)/q_i(x_i)), and on
rejection p <- normalize(max(p - q_i, 0)). If every child is rejected (or the node has
none) the bonus token is sampled from the final p. The output token is then distributed
exactly as p: P(x_i = y, accepted) = min(q_i(y), p(y)) and P(rejected) * p'(y) =
max(p(y) - q_i(y), 0), which add up to p(y).

Edge cases (each leaves the rule exact):
- q_i(x_i) = 0: rejected. Drawing such an x_i from q_i has probability 0, except when
  q_i is all zeros (a without-replacement draw past the end of q's support): that is a
  null proposal, and the residual max(p - 0, 0) is p itself.
- p(x_i) = 0: accepted with probability 0, the ordinary residual follows.
- residual mass 0: then p <= q_i everywhere, so rejection has probability 0 and can only
  happen through rounding; p stays unchanged.
- deterministic children: q_i is a point mass on x_i (passed as None), accepted with
  probability p(x_i); rejection zeroes p(x_i) and renormalizes.

A tree whose children are all deterministic is verified in the equivalent single-draw form
(``walk_deterministic``): at each node draw y ~ p once; follow the child whose token is y, or, if none is,
commit y as the bonus token. Trying x_1..x_k in turn accepts x_i with probability p(x_i) and, after
rejecting all, samples y from p without x_1..x_k: exactly the law of one draw from p. One draw per
visited node needs no loop over children, which is what makes the device rule a few ops over (B, Q, V).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.tree import CHILD_MODES, ROOT, DraftTree
from specdec.uniform_stream import UniformStream


class AcceptResult(NamedTuple):
    """Outcome of verifying one tree: the accepted path (root excluded) and the bonus token
    sampled at its last node. The step commits accepted_tokens + [bonus_token]."""

    accepted_nodes: list[int]
    accepted_tokens: list[int]
    bonus_token: int

    @property
    def committed_tokens(self) -> list[int]:
        return [*self.accepted_tokens, self.bonus_token]


# ---------------------------------------------------------------- sampling distribution


def check_sampling(temperature: float, top_k: int | None, top_p: float, min_p: float = 0.0) -> None:
    """Raise ValueError naming the field when a sampling parameter is out of range."""
    if not 0.0 <= temperature < float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")


def shape_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """(..., V) logits -> (..., V) probabilities (float32 or wider) of the distribution to sample.

    temperature 0: one-hot on the argmax (the first index among equal maxima). Otherwise
    softmax(logits / temperature), restricted to the top_k most probable tokens, then to
    the smallest set of most probable tokens whose mass is >= top_p, then to the tokens whose probability is
    >= min_p times the most probable one's, renormalized. Tokens are
    ranked by their logits before the division (so a huge temperature that rounds the scaled
    values to ties cannot change which tokens are kept); equal logits are ranked by token id
    (lower id first), so the kept set is deterministic.
    """
    check_sampling(temperature, top_k, top_p, min_p)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V)
    vocab = x.shape[-1]
    if temperature == 0.0:
        return F.one_hot(x.argmax(-1), vocab).to(x.dtype)
    k = min(top_k or vocab, vocab)
    if k == vocab and top_p >= 1.0 and min_p == 0.0:
        return torch.softmax(x / temperature, dim=-1)
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)  # (..., V) ranked by logit, then id
    xs = xs / temperature
    rank = torch.arange(vocab, device=x.device)
    probs = torch.softmax(xs.masked_fill(rank >= k, float("-inf")), dim=-1)  # (..., V) top-k
    if top_p < 1.0:
        before = F.pad(probs.cumsum(-1)[..., :-1], (1, 0))  # mass of strictly more probable tokens
        probs = probs.masked_fill(before >= top_p, 0.0)  # keep while the mass before is < top_p
    if min_p > 0.0:  # rank 0 is the most probable token; its share does not change with the renormalisation
        probs = probs.masked_fill(probs < min_p * probs[..., :1], 0.0)
    if top_p < 1.0 or min_p > 0.0:
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def repetition_penalty(logits: Tensor, present: Tensor, penalty: Tensor | float) -> Tensor:
    """(..., V) logits with a repetition penalty (HF/vLLM semantics) on the tokens ``present`` (..., V) bool marks
    (those of the context): a positive logit divided by ``penalty``, a negative one multiplied by it. Float32 or
    wider, like ``shape_probs``; ``penalty`` a number or a tensor broadcast against the logits (1 = unchanged)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V)
    return torch.where(present, torch.where(x > 0, x / penalty, x * penalty), x)


# ---------------------------------------------------------------- one step of the rule


def accept_prob(p: Tensor, q: Tensor | None, x: int) -> float:
    """Probability of accepting draft token x, drawn from q, against target p (both (V,))."""
    # a = min(1, p(x) / q(x)); q None is a point mass on x, so a = p(x); q(x) = 0 -> 0
    px = p[x].item()
    if q is None:
        return min(1.0, px)
    qx = q[x].item()
    return min(1.0, px / qx) if qx > 0.0 else 0.0


def reject_residual(p: Tensor, q: Tensor | None, x: int) -> Tensor:
    """The target distribution (V,) to use after x ~ q was rejected against p."""
    # p'(y) = max(p(y) - q(y), 0) / sum_z max(p(z) - q(z), 0); kept as p if that mass is 0
    if q is None:
        r = p.clone()
        r[x] = 0.0  # max(p - onehot(x), 0)
    else:
        r = (p - q).clamp_(min=0.0)  # q all zeros (null proposal): r = p
    s = r.sum().item()
    return r.div_(s) if s > 0.0 else p


def remove_token(q: Tensor, x: int) -> Tensor:
    """q (V,) conditioned on not drawing x: the next without-replacement draft distribution."""
    # q'(y) = q(y) [y != x] / (1 - q(x)); all zeros once q's support is used up
    r = q.clone()
    r[x] = 0.0
    s = r.sum().item()
    return r.div_(s) if s > 0.0 else r


def proposals(mode: str, q: Tensor | None, xs: Sequence[int]) -> Iterator[Tensor | None]:
    """Yield q_1..q_k, the distribution child x_i was drawn from given x_1..x_{i-1}, lazily.

    iid: q every time; without_replacement: q_1 = q, q_{i+1} = remove_token(q_i, x_i);
    deterministic: None (a point mass on x_i) every time.
    """
    if mode not in CHILD_MODES:
        raise ValueError(f"child_mode must be one of {CHILD_MODES}, got {mode!r}")
    if mode == "deterministic":
        q = None
    for i in range(len(xs)):
        if i and mode == "without_replacement":
            q = remove_token(q, xs[i - 1])
        yield q


def try_children(p: Tensor, q: Tensor | None, xs: Sequence[int], mode: str,
                 coins: Sequence[float]) -> tuple[int | None, Tensor]:
    """Try children xs in order against target p with uniform coins in [0, 1).

    Returns (i, p) when xs[i] is accepted, or (None, p_final) when all are rejected; the
    token at this position is then sampled from p_final.
    """
    for i, (x, q_i) in enumerate(zip(xs, proposals(mode, q, xs), strict=True)):
        if coins[i] < accept_prob(p, q_i, x):
            return i, p
        p = reject_residual(p, q_i, x)
    return None, p


def sample_token(p: Tensor, u: float) -> int:
    """The token y that uniform u in [0, 1) selects from p (V,) with probability p(y) / sum(p)."""
    # inverse CDF: the first y with cdf(y) > u * cdf(V-1); zero-probability tokens are never chosen
    cdf = p.cumsum(0)  # (V,)
    y = int(torch.searchsorted(cdf, cdf[-1:] * u, right=True).item())
    if y < p.shape[0]:
        return y
    nz = torch.nonzero(p)  # u * total rounded up to total (or p has no mass): the last possible token
    if nz.shape[0] == 0:
        raise ValueError("cannot sample from a distribution with no mass (all probabilities zero)")
    return int(nz[-1].item())


# ---------------------------------------------------------------- whole-tree verification


def verify_greedy(tree: DraftTree, target_argmax: Tensor) -> AcceptResult:
    """Accept the longest path whose every token equals the target argmax at its parent.

    target_argmax: (N+1,) int64, row 0 at the root, row i+1 at node i. Output equals
    target-only greedy decoding; among equal siblings the lowest index is followed.
    """
    _check_rows("target_argmax", target_argmax, tree.num_nodes, 1)
    want = target_argmax.tolist()  # (N+1,) one device->host copy
    tokens = tree.host.tokens
    node, path = ROOT, []
    while True:
        nxt = next((c for c in tree.host.children[node] if tokens[c] == want[node + 1]), None)
        if nxt is None:
            return AcceptResult(path, [tokens[c] for c in path], int(want[node + 1]))
        node = nxt
        path.append(node)


@torch.inference_mode()
def verify_stochastic(tree: DraftTree, target_probs: Tensor, stream: UniformStream) -> AcceptResult:
    """Accept a path of the tree and sample the bonus so that the committed tokens are
    distributed exactly as sampling the target one token at a time.

    target_probs: (N+1, V) shaped target distributions (shape_probs), row 0 at the root, row
    i+1 at node i. The uniforms are the request's next n + 1 of ``stream`` (computed on the host; the
    device rule computes the same ones, ``uniform_stream``). The children's draft distributions come
    from tree.draft_dists[tree.dist_index] and tree.child_mode.
    Host syncs: one or two per tried child, plus one for the bonus.
    """
    n = tree.num_nodes
    _check_rows("target_probs", target_probs, n, 2)
    d = tree.draft_dists
    if d is not None and (d.shape[1] != target_probs.shape[1] or d.device != target_probs.device):
        raise ValueError(f"target_probs (V={target_probs.shape[1]}, {target_probs.device}) must match "
                         f"draft_dists (V={d.shape[1]}, {d.device})")
    # one uniform per node (each child is tried at most once) and one for the bonus: (N+1,)
    coins = stream.take(n + 1)
    if tree.child_mode == "deterministic" or not n:
        return walk_deterministic(tree, target_probs, coins)
    h = tree.host
    node, path = ROOT, []
    while True:
        kids = h.children[node]
        p = target_probs[node + 1]  # (V,)
        if not kids:
            break
        q = None if tree.child_mode == "deterministic" else tree.draft_dists[h.dist_index[kids[0]]]
        hit, p = try_children(p, q, [h.tokens[c] for c in kids], tree.child_mode, [coins[c] for c in kids])
        if hit is None:
            break
        node = kids[hit]
        path.append(node)
    return AcceptResult(path, [h.tokens[c] for c in path], sample_token(p, coins[n]))


def walk_deterministic(tree: DraftTree, target_probs: Tensor, coins: Sequence[float]) -> AcceptResult:
    """``verify_stochastic`` of a tree with deterministic children, in the single-draw form: at the root and at
    each accepted node v, y is drawn from target_probs[v + 1] with one uniform (the root's is coins[n], node v's
    coins[v]: the columns ``draw_uniforms`` lays out); the first child whose token is y is accepted, else y is
    the bonus token."""
    h, n = tree.host, tree.num_nodes
    node, path = ROOT, []
    while True:
        y = sample_token(target_probs[node + 1], coins[n] if node == ROOT else coins[node])
        nxt = next((c for c in h.children[node] if h.tokens[c] == y), None)
        if nxt is None:
            return AcceptResult(path, [h.tokens[c] for c in path], y)
        node = nxt
        path.append(node)


def _check_rows(name: str, t: Tensor, n: int, dim: int) -> None:
    if not isinstance(t, Tensor) or t.dim() != dim or t.shape[0] != n + 1:
        shape = "(N+1,)" if dim == 1 else "(N+1, V)"
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {shape} with N={n} tree nodes, got {got}")
    if dim == 1 and t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {t.dtype}")
    if dim == 2 and not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")
