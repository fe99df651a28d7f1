"""The device n-gram step in one launch (reference: ``specdec.drafters.ngram_ops.ngram_follow_reference``).

One program per row: append the verify's accepted path and bonus token to the row's history, then scan the
history in tiles for the latest earlier occurrence of its longest suffix n-gram (n = max_n .. min_n, max_n <= 4)
and write the up to k tokens that followed it. A row's history of a few hundred to a few thousand tokens is a
handful of tiles; done on the host with dictionaries this was the n-gram step's largest host cost at batch 16.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton

from specdec.drafters.ngram_ops import ngram_follow_reference

# A match's score in the kernel is n * 2**40 + start (the longest n wins, then the latest start); 2**40 is written
# out there as the literal 1099511627776, which Triton compiles as an int64 constant (the form tested on the GPU).


@triton.jit
def _ngram_follow_kernel(
    hist_ptr, hist_stride, rows_ptr, ids_ptr, pos_ptr, acc_ptr, out_ptr,
    Q: tl.constexpr, QP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MAX_N: tl.constexpr,
    MIN_N: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    hist_row = tl.load(rows_ptr + r).to(tl.int64)
    if hist_row < 0:  # a padding row of the bucket
        return
    h = hist_ptr + hist_row * hist_stride
    acc = acc_ptr + r * (Q + 3)
    out = out_ptr + r * (Q + 4 + K)
    j = tl.arange(0, QP)
    tl.store(out + j, tl.load(acc + j, mask=j < Q + 3, other=0), mask=j < Q + 3)  # the outcome row
    L = tl.load(pos_ptr + r * Q).to(tl.int64) + 1  # the pending token sat at L - 1
    m = tl.load(acc).to(tl.int64)
    path = tl.load(acc + 2 + j, mask=j < m, other=0)  # query indices of the accepted nodes
    tok = tl.load(ids_ptr + r * Q + path, mask=j < m, other=0)
    tl.store(h + L + j, tok.to(hist_ptr.dtype.element_ty), mask=j < m)
    tl.store(h + L + m, tl.load(acc + 1).to(hist_ptr.dtype.element_ty))
    tl.debug_barrier()  # the scan below reads what this program just wrote
    n_tok = L + m + 1
    top = tl.minimum(n_tok - 1, MAX_N)  # the longest suffix that can have an earlier occurrence
    s0 = tl.load(h + n_tok - 1).to(tl.int64)  # the suffix, last token first
    s1 = tl.load(h + tl.maximum(n_tok - 2, 0)).to(tl.int64)
    s2 = tl.load(h + tl.maximum(n_tok - 3, 0)).to(tl.int64)
    s3 = tl.load(h + tl.maximum(n_tok - 4, 0)).to(tl.int64)
    best = tl.full((), -1, tl.int64)
    for base in range(0, n_tok - 1, BLOCK):  # starts i of an n-gram followed by a token: i + n <= n_tok - 1
        i = base + tl.arange(0, BLOCK).to(tl.int64)
        t0 = tl.load(h + i, mask=i < n_tok, other=-1).to(tl.int64)
        t1 = tl.load(h + i + 1, mask=i + 1 < n_tok, other=-1).to(tl.int64)
        t2 = tl.load(h + i + 2, mask=i + 2 < n_tok, other=-1).to(tl.int64)
        t3 = tl.load(h + i + 3, mask=i + 3 < n_tok, other=-1).to(tl.int64)
        m1 = (t0 == s0) & (i + 1 <= n_tok - 1) & (top >= 1) & (MIN_N <= 1)
        m2 = (t0 == s1) & (t1 == s0) & (i + 2 <= n_tok - 1) & (top >= 2) & (MIN_N <= 2)
        m3 = (t0 == s2) & (t1 == s1) & (t2 == s0) & (i + 3 <= n_tok - 1) & (top >= 3) & (MIN_N <= 3)
        m4 = (t0 == s3) & (t1 == s2) & (t2 == s1) & (t3 == s0) & (i + 4 <= n_tok - 1) & (top >= 4)
        n = tl.where(m4, 4, tl.where(m3, 3, tl.where(m2, 2, tl.where(m1, 1, 0)))).to(tl.int64)
        score = tl.where(n > 0, n * 1099511627776 + i, -1)  # n * 2**40 + start
        best = tl.maximum(best, tl.max(score, 0))
    found = best >= 0
    n_best = best // 1099511627776
    start = tl.where(found, best - n_best * 1099511627776 + n_best, 0)  # the continuation's first position
    count = tl.where(found, tl.minimum(n_tok - start, K), 0)
    kk = tl.arange(0, KP)
    chain = tl.load(h + start + kk, mask=kk < count, other=0).to(tl.int64)
    tl.store(out + Q + 3, count)
    tl.store(out + Q + 4 + kk, chain, mask=kk < K)


def ngram_follow_triton(hist: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                        accept: torch.Tensor, k: int, max_n: int = 4, min_n: int = 1) -> torch.Tensor:
    """``ngram_follow_reference`` (same arguments and result) in one launch; ``max_n`` <= 4. Fixed buffers
    (``rows`` padded with -1) make it capturable in a CUDA graph."""
    r, q = ids.shape
    dev = hist.device
    check_launchable(_ngram_follow_kernel, dev)
    check_tensor("hist", hist, shape=(None, None), dtypes=(torch.int32, torch.int64), device=dev)
    if hist.stride(1) != 1:
        raise ValueError("hist: rows must be contiguous")
    check_tensor("rows", rows, shape=(r,), dtypes=(torch.int64,), device=dev)
    check_tensor("positions", positions, shape=(r, q), dtypes=(torch.int64,), device=dev)
    check_tensor("accept", accept, shape=(r, q + 3), dtypes=(torch.int64,), device=dev)
    if not (1 <= min_n <= max_n <= 4) or k < 1:
        raise ValueError(f"need 1 <= min_n <= max_n <= 4 and k >= 1, got min_n={min_n}, max_n={max_n}, k={k}")
    ids, positions, accept = ids.contiguous(), positions.contiguous(), accept.contiguous()
    out = torch.zeros(r, q + 4 + k, dtype=torch.int64, device=dev)
    if r == 0:
        return out
    _ngram_follow_kernel[(r,)](
        hist, hist.stride(0), rows, ids, positions, accept, out,
        Q=q, QP=next_pow2(q + 3), K=k, KP=next_pow2(k), MAX_N=max_n, MIN_N=min_n,
        BLOCK=1024 if dev.type == "cuda" else 64,
    )
    return out


def ngram_follow(hist, rows, ids, positions, accept, k: int, max_n: int = 4, min_n: int = 1, *,
                 use_triton: bool) -> torch.Tensor:
    """The device n-gram step (extend each row's history by the verify's outcome, look up its next chain):
    ``ngram_follow_triton`` (one launch) when ``use_triton`` (the Triton backend) and max_n <= 4,
    ``ngram_follow_reference`` otherwise."""
    op = ngram_follow_triton if use_triton and max_n <= 4 else ngram_follow_reference
    return op(hist, rows, ids, positions, accept, k, max_n, min_n)
