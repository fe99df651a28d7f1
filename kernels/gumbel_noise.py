"""The sampled rule's Gumbel noise G(s, v) and the draft's children ranked by it, in torch and in Triton.

The noise: per (row, position s) a sub-key of two 32-bit words (``uniform_stream.hash_words`` of the request's
key at word indices 2 s and 2 s + 1), then per token v the 53-bit float64 uniform ``uniforms_at(sub-key, v)``
and G = -log(-log(u)) in float64 (u = 0, probability 2^-53, gives -inf: the token is never chosen). It depends
only on the request's key, s and v, so the target's choice at s (``kernels.gumbel_choice``) and a draft's
children coupled with it (``children_scores``: draft logits / T + G, so a node's best child is a draw of the
draft's distribution that agrees with the target's draw as often as the two distributions allow) read the same
noise without any draw counter. The Triton helpers (``row_noise_key``, ``gumbel_at``) hash in uint32 (wrapping
multiply-add and logical shifts are the reference's masked int64 arithmetic) and take the logs in float64;
``gumbel_noise_triton`` writes their noise, to compare it with ``gumbel_noise`` bit for bit. ``gumbel_rough`` is
the same noise within a stated bound from one hash word and float32 logs: the choices use it to skip exact scoring
where no column could win, never as the noise itself.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor, grid_processors
from specdec.kernels.triton_import import tl, triton
from torch import Tensor

from specdec.uniform_stream import MASK32, hash_words, uniforms_at

# uniform_stream's PCG constants (LCG multiplier and increment, RXS-M-XS multiplier); the tests compare the noise
_PCG_MUL: tl.constexpr = tl.constexpr(747796405)
_PCG_INC: tl.constexpr = tl.constexpr(2891336453)
_PCG_OUT: tl.constexpr = tl.constexpr(277803737)


def noise_keys(key0: Tensor, key1: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
    """The two 32-bit words (int64) keying the noise of sequence ``position`` of the requests keyed (key0, key1);
    all three int64, broadcast together."""
    s = (2 * position) & MASK32
    return hash_words(key0, key1, s), hash_words(key0, key1, s + 1)


def gumbel_noise(key0: Tensor, key1: Tensor, position: Tensor, tokens: Tensor) -> Tensor:
    """Float64 Gumbel noise G(position, token) of the requests keyed (key0, key1): key0, key1, position (...,)
    int64 per row, ``tokens`` (..., N) or (N,) int64 token ids -> (..., N) float64."""
    k0, k1 = noise_keys(key0, key1, position)
    u = uniforms_at(k0[..., None], k1[..., None], tokens)  # (..., N)
    return -torch.log(-torch.log(u))


@triton.jit
def _pcg(v):
    """``uniform_stream._pcg`` on uint32 values: the multiply-add wraps modulo 2**32, the shifts are logical."""
    state = v * _PCG_MUL + _PCG_INC
    word = ((state >> ((state >> 28) + 4)) ^ state) * _PCG_OUT
    return (word >> 22) ^ word


@triton.jit
def _hash_words(key0, key1, index):
    """``uniform_stream.hash_words`` on uint32 key words and indices."""
    return _pcg(_pcg(_pcg(index) ^ key0) ^ key1)


@triton.jit
def row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, stride_key0, stride_key1, stride_pos):
    """``noise_keys`` of one row as two uint32 words (the int64 inputs taken modulo 2**32)."""
    k0 = tl.load(key0_ptr + row * stride_key0).to(tl.uint32)
    k1 = tl.load(key1_ptr + row * stride_key1).to(tl.uint32)
    s = (tl.load(pos_ptr + row * stride_pos) * 2).to(tl.uint32)
    return _hash_words(k0, k1, s), _hash_words(k0, k1, s + 1)


@triton.jit
def gumbel_at(sub0, sub1, cols):
    """Float64 Gumbel noise of token ids ``cols`` (int32) under a row's sub-key (uint32 words): ``gumbel_noise``."""
    word = cols.to(tl.uint32) * 2
    hi = _hash_words(sub0, sub1, word).to(tl.uint64)
    lo = _hash_words(sub0, sub1, word + 1).to(tl.uint64)
    u = ((hi << 21) | (lo >> 11)).to(tl.float64) * 1.1102230246251565e-16  # 53 bits * 2**-53, exact
    return -tl.log(-tl.log(u))


# Bound on |gumbel_rough - gumbel_at| at every column gumbel_rough does not flag (+inf): the worst case of its
# float32 arithmetic and of the 21 uniform bits it drops is below 2**-10 (see gumbel_rough); this is 16x that.
ROUGH_ERR: tl.constexpr = tl.constexpr(2.0**-6)


@triton.jit
def gumbel_rough(sub0, sub1, cols):
    """``gumbel_at``'s noise within ``ROUGH_ERR``, in float32 from one hash word: +inf (a column to score exactly)
    where the uniform lies within 2**-20 of 0 or 1, where one word does not bound it well enough. The uniform is
    u = hi 2**-32 + lo 2**-53 with hi the first word (32 bits) and lo < 2**21 from the second, so u is within
    2**-32 of hi 2**-32; G = -log(E), E = -log(u), moves by du / (u E), at most 2**-11 for u in [2**-20, 1 - 2**-20].
    E is taken from u below 1/2 (float32's relative rounding: ~1e-7 of G) and from w = 1 - u, exact from the
    integer 2**32 - hi, above it (log1p's series below w = 2**-10, else -log(1 - w): ~6e-5 of G). Cheap where the
    exact noise is dear (one hash instead of two, two float32 logs instead of two float64 ones): the choices score a
    column exactly only where this bound says it could win (``gumbel_split.gumbel_max_block``)."""
    hi = _hash_words(sub0, sub1, cols.to(tl.uint32) * 2)  # the exact noise's first word: u's top 32 bits
    low = hi < 2147483648  # u < 1/2
    u = hi.to(tl.float32) * 2.3283064365386963e-10  # hi 2**-32
    w = (~hi + 1).to(tl.float32) * 2.3283064365386963e-10  # (2**32 - hi) 2**-32 = 1 - u, for hi >= 2**31
    e_series = w + w * w * 0.5 + w * w * w * 0.3333333432674408  # -log(1 - w) for w < 2**-10
    e = tl.where(low | (w >= 0.0009765625), -tl.log(tl.where(low, u, 1.0 - w)), e_series)
    edge = (hi < 4096) | (hi > 4294963200)  # u < 2**-20 or 1 - u < 2**-20 (to 2**-32)
    return tl.where(edge, float("inf"), -tl.log(e))


@triton.jit
def _noise_kernel(key0_ptr, key1_ptr, pos_ptr, tok_ptr, out_ptr, n_tokens,
                  stride_key0, stride_key1, stride_pos, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_tokens
    sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, stride_key0, stride_key1, stride_pos)
    tokens = tl.load(tok_ptr + i, mask=ok, other=0).to(tl.int32)
    tl.store(out_ptr + row * n_tokens + i, gumbel_at(sub0, sub1, tokens), mask=ok)


def gumbel_noise_triton(key0: Tensor, key1: Tensor, position: Tensor, tokens: Tensor, block: int = 1024) -> Tensor:
    """``gumbel_noise`` for (R,) rows and (N,) token ids in [0, 2**31) -> (R, N) float64: the kernel's noise, on
    CUDA bit for bit the reference's."""
    check_launchable(_noise_kernel, key0.device)
    check_tensor("key0", key0, shape=(None,))
    r = key0.shape[0]
    check_row_keys(key0, key1, position, r, key0.device)
    check_tensor("tokens", tokens, shape=(None,), dtypes=(torch.int64,), device=key0.device)
    n = tokens.shape[0]
    out = torch.empty((r, n), dtype=torch.float64, device=key0.device)  # (R, N)
    if r and n:
        _noise_kernel[(r, triton.cdiv(n, block))](key0, key1, position, tokens.contiguous(), out, n,
                                                  key0.stride(0), key1.stride(0), position.stride(0), BLOCK=block)
    return out


def check_row_keys(key0: Tensor, key1: Tensor, position: Tensor, rows: int, device: torch.device) -> None:
    """key0, key1 and position: (rows,) int64 on ``device`` (any stride)."""
    for name, t in (("key0", key0), ("key1", key1), ("position", position)):
        check_tensor(name, t, shape=(rows,), dtypes=(torch.int64,), device=device)


@triton.jit
def _children_kernel(x_ptr, inv_t_ptr, key0_ptr, key1_ptr, pos_ptr, tok_ptr, out_ptr, n_cols, per_row, chunk,
                     stride_x, stride_inv_t, stride_key0, stride_key1, stride_pos, BLOCK: tl.constexpr):
    # one program per (batch row, column block, group of ``chunk`` of the batch row's per_row nodes; rows
    # b * per_row + j): the noise depends on the batch row and the column only, so a program computes it once for
    # its group (its float64 logs are most of the work); groups of all nodes unless a small batch would leave the
    # GPU idle
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    first = tl.program_id(2) * chunk
    last = tl.minimum(first + chunk, per_row)
    ok = cols < n_cols
    inv_t = tl.load(inv_t_ptr + b * stride_inv_t)
    if inv_t > 0:
        sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, b, stride_key0, stride_key1, stride_pos)
        tokens = tl.load(tok_ptr + cols, mask=ok, other=0).to(tl.int32)
        g = gumbel_at(sub0, sub1, tokens)
        for j in range(first, last):
            row = b * per_row + j
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
            scaled = x.to(tl.float64) * inv_t  # rounded, then the sum rounded (the launch disables fma contraction)
            tl.store(out_ptr + row * n_cols + cols, (scaled + g).to(tl.float32), mask=ok)
    else:
        for j in range(first, last):
            row = b * per_row + j
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
            tl.store(out_ptr + row * n_cols + cols, x.to(tl.float32), mask=ok)


def children_scores_reference(logits: Tensor, inv_t: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                              tokens: Tensor) -> Tensor:
    """Float32 scores (B, n, N) a sampled draft ranks the children of its nodes by: for batch row b whose
    ``inv_t`` (B,) float64 (1 / temperature) is > 0, logits (B, n, N) * inv_t + G(position, tokens) in float64
    (``gumbel_noise`` of key0, key1, position (B,) int64, for token ids ``tokens`` (N,) int64) rounded to float32,
    so each node's best child is a draw of the draft's distribution coupled with the target's draw at ``position``;
    the logits themselves (float32) where inv_t is 0 (a greedy row)."""
    g = gumbel_noise(key0, key1, position, tokens)  # (B, N)
    inv = inv_t.view(-1, 1, 1)
    drawn = (logits.double() * inv + g.unsqueeze(1)).float()
    return torch.where(inv > 0, drawn, logits.float())


def children_scores_triton(logits: Tensor, inv_t: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                           tokens: Tensor, block: int = 1024) -> Tensor:
    """Same promise as ``children_scores_reference`` (on CUDA the same bits), one launch: the noise computed in
    place, nothing in float64 written. logits (B, n, N) float16/bfloat16/float32, last dim contiguous and the
    first two dims one stride apart (a contiguous tensor, or a slice of one along the first dim)."""
    check_tensor("logits", logits, shape=(None, None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(_children_kernel, logits.device)
    b, n, v = logits.shape
    if n > 1 and logits.stride(0) != n * logits.stride(1):
        raise ValueError(f"logits' first two dims must be one stride apart, got strides {tuple(logits.stride())}")
    check_tensor("inv_t", inv_t, shape=(b,), dtypes=(torch.float64,), device=logits.device)
    check_row_keys(key0, key1, position, b, logits.device)
    check_tensor("tokens", tokens, shape=(v,), dtypes=(torch.int64,), device=logits.device)
    out = torch.empty((b, n, v), dtype=torch.float32, device=logits.device)
    if b and n and v:
        col_blocks = triton.cdiv(v, block)
        # the nodes of a batch row in one group (its noise computed once) when the batch row and column programs
        # fill the GPU twice over, else in as many groups as it takes (batch 1: each node nearly its own program)
        groups = min(n, max(1, triton.cdiv(2 * grid_processors(logits.device), b * col_blocks)))
        chunk = triton.cdiv(n, groups)
        _children_kernel[(b, col_blocks, triton.cdiv(n, chunk))](
            logits, inv_t, key0, key1, position, tokens.contiguous(), out, v, n, chunk, logits.stride(1),
            inv_t.stride(0), key0.stride(0), key1.stride(0), position.stride(0), BLOCK=block, enable_fp_fusion=False)
    return out


def children_scores(logits: Tensor, inv_t: Tensor, key0: Tensor, key1: Tensor, position: Tensor, tokens: Tensor, *,
                    use_triton: bool = False) -> Tensor:
    """``children_scores_triton`` when ``use_triton`` (the Triton backend), ``children_scores_reference``
    otherwise."""
    fn = children_scores_triton if use_triton else children_scores_reference
    return fn(logits, inv_t, key0, key1, position, tokens)
