"""Sampling distributions and the greedy accept rule of tree verification.

Pure functions. `shape_probs` is the one place where temperature / top-k / top-p / min-p turn
logits into the distribution that is sampled, for the target and the draft alike (the penalties change the
logits before: ``repetition_penalty``, then ``count_penalty``). `verify_greedy` accepts the longest path whose every
token equals the target's choice at its parent; with the argmax that is greedy decoding, and with the
target's position-keyed Gumbel-max sample (``kernels.gumbel_choice``) it is the lossless sampled rule
(docs/design.md, "The sampled rule").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.tree import ROOT, DraftTree


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


def count_penalty(logits: Tensor, counts: Tensor, presence: Tensor | float, frequency: Tensor | float) -> Tensor:
    """(..., V) logits less OpenAI/vLLM's presence and frequency penalties: ``frequency * count + presence *
    (count > 0)`` for each token's ``counts`` (..., V) (its occurrences in the output so far). Float32 or wider;
    ``presence`` and ``frequency`` numbers or tensors broadcast against the logits (0 = unchanged)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V)
    return x - (frequency * counts + presence * (counts > 0))


# ---------------------------------------------------------------- whole-tree verification


def verify_greedy(tree: DraftTree, target_argmax: Tensor) -> AcceptResult:
    """Accept the longest path whose every token equals the target's choice at its parent.

    target_argmax: (N+1,) int64 choices, row 0 at the root, row i+1 at node i. With the argmax the
    output equals target-only greedy decoding (with ``kernels.gumbel_choice``'s samples, target-only
    sampling); among equal siblings the lowest index is followed.
    """
    _check_rows("target_argmax", target_argmax, tree.num_nodes)
    want = target_argmax.tolist()  # (N+1,) one device->host copy
    tokens = tree.host.tokens
    node, path = ROOT, []
    while True:
        nxt = next((c for c in tree.host.children[node] if tokens[c] == want[node + 1]), None)
        if nxt is None:
            return AcceptResult(path, [tokens[c] for c in path], int(want[node + 1]))
        node = nxt
        path.append(node)


def _check_rows(name: str, t: Tensor, n: int) -> None:
    """Raise ValueError naming ``name`` unless t is an (N+1,) int64 tensor for a tree of n nodes."""
    if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != n + 1:
        got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape (N+1,) with N={n} tree nodes, got {got}")
    if t.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {t.dtype}")
