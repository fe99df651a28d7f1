"""A step's logits processors and penalties at every verify token in one pass (``ContextPenalty.apply``), and its
torch reference.

Per verify token (row r of R = B x Q, its batch row b = r // Q) over the vocabulary: the bias added, the held-back
tokens (``min_tokens``) and the banned ones (bad words) set to -inf, then the repetition penalty on the tokens of the
row's context or of r's path, then the presence and frequency penalties on the row's output counts plus r's path
counts. In torch that is a (B, Q, V) tensor per part (the context broadcast to every verify token, the path
scattered in, each rule's result): several passes over R x V float32. Here one program per (row, block of the
vocabulary) reads the logits once, the (B, V) contexts once per row, compares each column with r's path tokens and
banned tokens (a few dozen at most) and writes the result once. Arithmetic is the reference's, operation for
operation (no fused multiply-add, rounded division), so both give the same bits.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor
from specdec.kernels.triton_import import tl, triton

from specdec.acceptance import count_penalty, repetition_penalty

_BIAS, _HELD, _BAD, _REP, _COUNT = 1, 2, 4, 8, 16  # the bits of ``parts``: which processors a batch has


# (which parts, the verify tokens per row and the path and banned widths are arguments, not compile-time constants:
# one compiled kernel serves every batch, so a new combination of request options compiles nothing mid-request)
@triton.jit(do_not_specialize=["q", "n_banned", "n_path", "parts"])
def _processed_kernel(x_ptr, out_ptr, n_cols, x_stride, q, bias_ptr, held_ptr, early_ptr, banned_ptr, n_banned,
                      present_ptr, penalty_ptr, counts_ptr, presence_ptr, frequency_ptr, path_ptr, n_path, parts,
                      BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = r // q
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    ninf = float("-inf")
    x = tl.load(x_ptr + r * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    ctx = b * n_cols + cols  # (the (B, V) contexts are contiguous)
    if (parts & 1) != 0:  # (_BIAS)
        x = x + tl.load(bias_ptr + ctx, mask=ok, other=0.0)
    if (parts & 2) != 0:  # (_HELD)
        early = tl.load(early_ptr + r)
        held = tl.load(held_ptr + ctx, mask=ok, other=0)
        x = tl.where((held != 0) & (early != 0), ninf, x)
    if (parts & 4) != 0:  # (_BAD)
        for i in range(n_banned):
            x = tl.where(cols == tl.load(banned_ptr + r * n_banned + i), ninf, x)
    if (parts & 24) != 0:  # (_REP or _COUNT)
        on_path = tl.zeros([BLOCK], tl.int32)  # occurrences of the column among r's path tokens
        for i in range(n_path):
            on_path += (cols == tl.load(path_ptr + r * n_path + i)).to(tl.int32)
        if (parts & 8) != 0:  # (_REP)
            present = (tl.load(present_ptr + ctx, mask=ok, other=0) != 0) | (on_path > 0)
            p = tl.load(penalty_ptr + b)
            x = tl.where(present, tl.where(x > 0, tl.math.div_rn(x, tl.zeros([BLOCK], tl.float32) + p), x * p), x)
        if (parts & 16) != 0:  # (_COUNT)
            c = tl.load(counts_ptr + ctx, mask=ok, other=0.0) + on_path.to(tl.float32)
            f, pr = tl.load(frequency_ptr + b), tl.load(presence_ptr + b)
            x = x - (f * c + pr * (c > 0).to(tl.float32))
    tl.store(out_ptr + r * n_cols + cols, x, mask=ok)


def processed_logits_triton(logits: torch.Tensor, path: torch.Tensor, bias: torch.Tensor | None = None,
                            held: torch.Tensor | None = None, early: torch.Tensor | None = None,
                            banned: torch.Tensor | None = None, present: torch.Tensor | None = None,
                            penalty: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                            presence: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
                            block: int = 1024) -> torch.Tensor:
    """``processed_logits_reference``'s promise in one launch (float16, bfloat16 or float32 logits)."""
    check_tensor("logits", logits, shape=(None, None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    b, q, v = logits.shape
    dev = logits.device
    check_tensor("path", path, shape=(b, q, None), dtypes=(torch.int64,), device=dev)
    check_launchable(_processed_kernel, dev)
    if (held is None) != (early is None) or (present is None) != (penalty is None):
        raise ValueError("held and early, present and penalty come together")
    if (counts is None) != (presence is None) or (counts is None) != (frequency is None):
        raise ValueError("counts, presence and frequency come together")
    for name, t, dtypes in (("bias", bias, (torch.float32,)), ("held", held, (torch.bool,)),
                            ("present", present, (torch.bool,)), ("counts", counts, (torch.float32,))):
        if t is not None:
            check_tensor(name, t, shape=(b, v), dtypes=dtypes, device=dev)
    if banned is not None:
        check_tensor("banned", banned, shape=(b, q, None), dtypes=(torch.int64,), device=dev)
    x = logits.view(b * q, v) if logits.is_contiguous() else logits.reshape(b * q, v)
    out = torch.empty(b, q, v, dtype=torch.float32, device=dev)
    parts = sum(bit for bit, t in ((_BIAS, bias), (_HELD, held), (_BAD, banned), (_REP, present), (_COUNT, counts))
                if t is not None)
    if b * q and v:
        _processed_kernel[(b * q, triton.cdiv(v, block))](
            x, out, v, x.stride(0), q, *kernel_parts(dev, bias, held, early, banned, present, penalty, counts, presence,
                                                   frequency, path), parts, BLOCK=block, num_warps=4,
            enable_fp_fusion=False)
    return out


def kernel_parts(device, bias, held, early, banned, present, penalty, counts, presence, frequency,
                 path) -> list:
    """The kernel's part arguments in order (``_processed_kernel``'s from ``bias_ptr`` to ``n_path``): contiguous
    tensors, bool ones as uint8, and for a part that is off a one-element stand-in of the dtype it would have, so
    the kernel's signature (which Triton compiles a kernel per) is the same whatever parts a batch has."""
    def arg(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if t is None:
            return torch.empty(1, dtype=dtype, device=device)  # (never read)
        t = t.contiguous()
        return t.view(torch.uint8) if t.dtype == torch.bool else t.to(dtype)

    f32, u8, i64 = torch.float32, torch.uint8, torch.int64
    return [arg(bias, f32), arg(held, u8), arg(early, u8), arg(banned, i64), 0 if banned is None else banned.shape[-1],
            arg(present, u8), arg(penalty, f32), arg(counts, f32), arg(presence, f32), arg(frequency, f32),
            path.contiguous(), path.shape[-1]]


def processed_logits_reference(logits: torch.Tensor, path: torch.Tensor, bias: torch.Tensor | None = None,
                               held: torch.Tensor | None = None, early: torch.Tensor | None = None,
                               banned: torch.Tensor | None = None, present: torch.Tensor | None = None,
                               penalty: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                               presence: torch.Tensor | None = None,
                               frequency: torch.Tensor | None = None) -> torch.Tensor:
    """(B, Q, V) logits (float32 or wider) at the verify tokens with their processors and penalties applied.

    ``path`` (B, Q, P) int64: each verify token's path tokens (its draft ancestors and itself, not the pending
    token, which the contexts hold already), -1 for none. ``bias`` (B, V) float32 added first; ``held`` (B, V) bool
    set to -inf where ``early`` (B, Q) bool; ``banned`` (B, Q, N) int64 token ids set to -inf (-1: none); the
    repetition ``penalty`` (B,) on the tokens of ``present`` (B, V) bool or of the path; the ``presence`` and
    ``frequency`` (B,) penalties on ``counts`` (B, V) float32 plus the path's occurrences."""
    b, q, v = logits.shape
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if bias is not None:
        x = x + bias.unsqueeze(1)
    if held is not None:
        x = x.masked_fill(early.unsqueeze(-1) & held.unsqueeze(1), float("-inf"))
    if banned is not None:
        x = x.masked_fill(_hits(banned, v) > 0, float("-inf"))
    if present is None and counts is None:
        return x
    on_path = _hits(path, v)  # (B, Q, V) occurrences among the path tokens
    if present is not None:
        x = repetition_penalty(x, present.unsqueeze(1) | (on_path > 0), penalty.view(b, 1, 1))
    if counts is not None:
        x = count_penalty(x, counts.unsqueeze(1) + on_path.to(counts.dtype), presence.view(b, 1, 1),
                          frequency.view(b, 1, 1))
    return x


def _hits(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, Q, V) int32: how often each column appears among ``ids`` (B, Q, K) (-1: none)."""
    b, q, _ = ids.shape
    out = torch.zeros(b, q, vocab + 1, dtype=torch.int32, device=ids.device)
    where = torch.where(ids >= 0, ids, vocab)
    return out.scatter_add_(-1, where, torch.ones(where.shape, dtype=torch.int32, device=ids.device))[..., :vocab]
