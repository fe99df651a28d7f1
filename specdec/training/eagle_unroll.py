"""Training forward of an eagle draft: several unrolled drafting steps over whole conversations.

Step 0 reads the target's features (position p: features of p - 1); step k > 0 reads the draft's
own step k - 1 output at p - 1, as a tree node k levels deep does at run time. A step-k query at
position p attends to the step-0 keys at positions <= p - k (the catch-up KV of the real run)
and to the step-j keys at position p - k + j for j = 1..k (its ancestors in the tree and itself).
Every step is scored against the same teacher: the target's next-token distribution at p,
restricted to the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.attention.base import AttentionBackend
from specdec.models.eagle import EagleDraft
from specdec.models.llama import ForwardContext, LlamaForCausalLM
from specdec.training.dense_attention import DenseBatch, DenseCausalBackend
from specdec.training.linear_kl import Teacher, linear_kl


@dataclass
class UnrolledBatch:
    """Right-padded rows (batch, seq_len); the keys and values of the steps run so far."""

    batch: int
    seq_len: int
    keys: list[torch.Tensor] = field(default_factory=list)  # per step (B, Hkv, S, D)
    values: list[torch.Tensor] = field(default_factory=list)


def unrolled_mask(seq_len: int, step: int, device) -> torch.Tensor:
    """Boolean (S, (step + 1) * S): which keys of steps 0..step a step-``step`` query may see."""
    p = torch.arange(seq_len, device=device)
    blocks = [p[None, :] <= p[:, None] - step]  # step-0 keys at positions <= p - step
    blocks += [p[None, :] == p[:, None] - step + j for j in range(1, step + 1)]
    return torch.cat(blocks, 1)


class UnrolledBackend(AttentionBackend):
    """Attention of one unrolled step over the keys of all steps so far; never touches a KV cache."""

    name = "eagle-unrolled"

    def forward(self, q, k, v, k_cache, v_cache, meta: UnrolledBatch, scale: float, sliding_window=None):
        if sliding_window is not None:
            raise ValueError("eagle training supports full-attention targets only (sliding_window must be None)")
        b, s = meta.batch, meta.seq_len
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        meta.keys.append(k.view(b, s, hkv, d).transpose(1, 2))
        meta.values.append(v.view(b, s, hkv, d).transpose(1, 2))
        step = len(meta.keys) - 1
        keys = torch.cat(meta.keys, 2).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, (step+1)*S, D)
        values = torch.cat(meta.values, 2).repeat_interleave(hq // hkv, dim=1)  # (B, Hq, (step+1)*S, D)
        q4 = q.view(b, s, hq, d).transpose(1, 2)  # (B, Hq, S, D)
        mask = unrolled_mask(s, step, q.device)  # (S, (step+1)*S)
        o = F.scaled_dot_product_attention(q4, keys, values, attn_mask=mask, scale=scale)  # (B, Hq, S, D)
        return o.transpose(1, 2).reshape(b * s, hq, d)  # (T, Hq, D)


@dataclass
class TeacherOut:
    """The target's features (B*S, k*hidden) and log-probabilities over the draft vocabulary (B*S, N)."""

    aux: torch.Tensor
    logp: torch.Tensor


def teacher_forward(target: LlamaForCausalLM, draft: EagleDraft, ids: torch.Tensor) -> TeacherOut:
    """Prefill the target over right-padded rows ``ids`` (B, S) without autograd."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)  # (B*S,)
    ctx = ForwardContext(DenseCausalBackend(), DenseBatch(b, s), [(None, None)] * target.config.num_layers)
    with torch.no_grad():
        final, aux = target.forward_features(ids.reshape(-1), positions, ctx, draft.aux_layers)
        logp = torch.log_softmax(draft.lm_head(final).float(), -1)  # (B*S, N)
    return TeacherOut(aux, logp)


def shift_right(x: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """(B*S, H) -> (B*S, H) where row (i, p) holds (i, p - 1) and (i, 0) is zero."""
    x = x.view(b, s, -1)
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1).reshape(b * s, -1)


@dataclass(frozen=True)
class LossMix:
    """The loss at a position: ``(1 - sampled_weight) * KL(p || q) + sampled_weight * KL(p_T || q_T)``, where p and
    q are the target's and the draft's next-token distributions over the draft vocabulary and ``x_T`` is
    ``softmax(logits / temperature)``: the distributions a request sampled at that temperature compares (the
    drafter shapes its q with the request's temperature). ``sampled_weight`` 0 is the plain KL."""

    temperature: float = 1.0
    sampled_weight: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"LossMix.temperature must be > 0, got {self.temperature!r}")
        if not 0 <= self.sampled_weight <= 1:
            raise ValueError(f"LossMix.sampled_weight must be in [0, 1], got {self.sampled_weight!r}")


@dataclass
class UnrolledLoss:
    """Weighted mean loss over steps (what training minimises), and per step: mean KL at temperature 1, top-1
    agreement with the target, count; with ``measure``, also per step the mean KL at the mix's temperature and the
    mean overlap sum_x min(p_T(x), q_T(x)) (the chance that one draft token sampled at that temperature is
    accepted)."""

    loss: torch.Tensor
    kl: list[torch.Tensor]
    top1: list[torch.Tensor]
    count: list[torch.Tensor]
    kl_t: list[torch.Tensor] = field(default_factory=list)
    overlap_t: list[torch.Tensor] = field(default_factory=list)


def unrolled_loss(draft: EagleDraft, teacher: TeacherOut, ids: torch.Tensor, valid: torch.Tensor, unroll: int,
                  decay: float, mix: LossMix = LossMix(), measure: bool = False) -> UnrolledLoss:
    """The ``mix`` loss at the ``valid`` (B, S) positions for steps 0..unroll-1, step k weighted ``decay ** k``
    (weights normalised to sum 1); step k scores only positions >= k (its features exist)."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)  # (B*S,)
    ctx = ForwardContext(UnrolledBackend(), UnrolledBatch(b, s), [(None, None)])
    g = shift_right(draft.fuse(teacher.aux), b, s)  # (B*S, hidden)
    rows = valid.reshape(-1).nonzero().squeeze(1)  # (n,) the scored positions
    pos = positions[rows]  # (n,)
    sampled = mix.sampled_weight > 0 or measure
    t = Teacher.of(teacher.logp[rows], mix.temperature if sampled else None)  # (the constants of every step)
    weights = [decay**k / sum(decay**j for j in range(unroll)) for k in range(unroll)]
    out = UnrolledLoss(torch.zeros((), device=ids.device), [], [], [])
    for k in range(unroll):
        h = draft(ids.reshape(-1), positions, ctx, g)  # (B*S, hidden)
        ok = (pos >= k).float()  # (n,)
        n = ok.sum().clamp_min(1).detach()
        loss, per_row = linear_kl(draft.norm(h[rows]), draft.lm_head, t, ok / n, mix.temperature,
                                  mix.sampled_weight, measure)  # (the logits of ``compute_logits``, chunk by chunk)
        out.loss = out.loss + weights[k] * loss
        out.kl.append((per_row.kl * ok).sum() / n)
        out.top1.append(((per_row.top == t.top).float() * ok).sum() / n)
        out.count.append(n)
        if measure:
            out.kl_t.append((per_row.kl_t * ok).sum() / n)
            out.overlap_t.append((per_row.overlap_t * ok).sum() / n)
        g = shift_right(h, b, s)
    return out
