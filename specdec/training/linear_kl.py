"""The draft's training loss through its frozen LM head, scored a chunk of rows at a time.

Per scored row the loss is ``(1 - w) KL(p || q) + w KL(p_T || q_T)`` (``eagle_unroll.LossMix``): p the teacher's
distribution over the draft vocabulary, q = softmax(z) the draft's (z its logits), x_T the distribution at temperature
T. Scored with autograd through whole logits, every unrolled step keeps several (rows, vocabulary) float32 tensors
for its backward and makes some twenty passes over them. Here each chunk's logits are made, scored and dropped, and
the gradient with respect to the draft's states is made in the forward (the head is frozen, so it is the only one):

    KL(p || softmax(z)) = sum p log p + logsumexp(z) - p.z          gradient softmax(z) - p
    KL(p_T || softmax(z / T))                                        gradient (softmax(z / T) - p_T) / T

``kernels.kl_rows`` scores one chunk: in torch (``kl_rows_reference``), or on CUDA in one launch that reads the logits
and the teacher twice and writes the gradient once (``kl_rows_triton``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec.kernels.kl_rows import kl_rows_reference, kl_rows_triton

LOSS_CHUNK = 8192  # scored rows per chunk: their logits and gradient (chunk, N) are the largest tensors made


class Teacher(NamedTuple):
    """The teacher's side of the loss at the scored rows: log-probabilities (n, N) float32, top tokens (n,),
    sum p log p (n,), and at the mix's temperature T the log-normaliser of t_logp / T and sum p_T log p_T (n,)
    each (None without a temperature)."""

    logp: torch.Tensor
    top: torch.Tensor
    negent: torch.Tensor
    lse_t: torch.Tensor | None
    negent_t: torch.Tensor | None

    @classmethod
    def of(cls, t_logp: torch.Tensor, temperature: float | None, chunk: int = LOSS_CHUNK) -> Teacher:
        """The constants of ``t_logp`` (made once for every unrolled step), ``chunk`` rows at a time."""
        parts = []
        with torch.no_grad():
            for c in t_logp.split(chunk):
                negent = torch.where(c > float("-inf"), c.exp() * c, 0).sum(-1)
                if temperature is None:
                    parts.append((negent, None, None))
                    continue
                ct = c / temperature
                lse_t = torch.logsumexp(ct, -1)
                logp_t = ct - lse_t[:, None]
                parts.append((negent, lse_t, torch.where(logp_t > float("-inf"), logp_t.exp() * logp_t, 0).sum(-1)))
        cat = [None if parts[0][i] is None else torch.cat([x[i] for x in parts]) for i in range(3)]
        return cls(t_logp, t_logp.argmax(-1), *cat)

    def rows(self, start: int, end: int) -> Teacher:
        return Teacher(*(None if f is None else f[start:end] for f in self))


class RowLoss(NamedTuple):
    """Per scored row: KL at temperature 1, the draft's top token (its first maximum), and at the temperature the KL
    and the overlap sum min(p_T, q_T) (None when not asked)."""

    kl: torch.Tensor
    top: torch.Tensor
    kl_t: torch.Tensor | None
    overlap_t: torch.Tensor | None


def kl_rows(z: torch.Tensor, teacher: Teacher, row_w: torch.Tensor, temperature: float, sampled_weight: float,
            grad: bool, measure: bool) -> tuple[RowLoss, torch.Tensor | None]:
    """The row losses of logits ``z`` (c, N) (any float dtype; scored in float32) against ``teacher``'s rows (the
    temperature's figures when it has them, the overlap with ``measure``), and with ``grad`` the gradient of
    ``sum(row_w * loss)`` with respect to z, in z's dtype: ``kernels.kl_rows.kl_rows_triton`` on CUDA,
    ``kl_rows_reference`` elsewhere."""
    fn = kl_rows_triton if z.is_cuda else kl_rows_reference
    *rows, dz = fn(z, teacher.logp, teacher.negent, teacher.lse_t, teacher.negent_t, row_w, temperature,
                   sampled_weight, grad, measure)
    return RowLoss(*rows), dz


class _LinearKL(torch.autograd.Function):
    """``linear_kl``'s loss: each chunk's logits made, scored (``kl_rows``) and dropped, the gradient with respect
    to the states made in the forward."""

    @staticmethod
    def forward(ctx, x, weight, teacher, row_w, temperature, sampled_weight, measure, chunk, grad):  # noqa: ANN001
        rows, grads = [], []
        for i in range(0, x.shape[0], chunk):
            z = F.linear(x[i:i + chunk], weight)  # (c, N): the head's dtype (bf16 under autocast)
            loss, dz = kl_rows(z, teacher.rows(i, i + chunk), row_w[i:i + chunk], temperature, sampled_weight, grad,
                               measure)
            rows.append(loss)
            if grad:
                grads.append(F.linear(dz.to(z.dtype), weight.t()))  # (c, H)
        out = RowLoss(*(None if getattr(rows[0], f) is None else torch.cat([getattr(r, f) for r in rows])
                        for f in RowLoss._fields))
        w = sampled_weight
        mixed = out.kl if not w else (1 - w) * out.kl + w * out.kl_t
        ctx.save_for_backward(torch.cat(grads).to(x.dtype) if grad else None)
        ctx.mark_non_differentiable(*(t for t in out if t is not None))
        return (mixed * row_w).sum(), *out

    @staticmethod
    def backward(ctx, grad_loss, *unused):  # noqa: ANN001
        (gx,) = ctx.saved_tensors
        return gx * grad_loss, None, None, None, None, None, None, None, None


def linear_kl(x: torch.Tensor, head: torch.nn.Linear, teacher: Teacher, row_w: torch.Tensor, temperature: float,
              sampled_weight: float, measure: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, RowLoss]:
    """``sum(row_w * loss)`` of the draft's normed states ``x`` (n, H) through its frozen LM ``head`` against the
    ``teacher`` rows, and the per-row figures (the temperature's when the teacher has them, the overlap with
    ``measure``), ``chunk`` rows (default ``LOSS_CHUNK``) at a time. Equal to scoring ``log_softmax(head(x))`` with
    autograd through it (``tests/test_distill_recipe.py`` checks the loss, the gradients and the figures)."""
    if head.weight.requires_grad:
        raise ValueError("linear_kl needs a frozen LM head (its weight's gradient is not computed)")
    if sampled_weight and teacher.lse_t is None:
        raise ValueError("a sampled_weight > 0 needs the teacher's figures at the temperature (Teacher.of)")
    grad = torch.is_grad_enabled() and x.requires_grad
    loss, *rows = _LinearKL.apply(x, head.weight, teacher, row_w, temperature, sampled_weight, measure,
                                  chunk or LOSS_CHUNK, grad)
    return loss, RowLoss(*rows)
