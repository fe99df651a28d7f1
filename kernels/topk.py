"""Top-k of small k over long rows (the draft vocabulary) in at most two launches.

``torch.topk`` over a 24k-column row is a multi-block radix select on CUDA: about a dozen launches
per call, which is most of what a captured draft program spends on it. Here launch 1 splits each
row into blocks of ``block`` columns and each program keeps its block's best k candidates; launch 2
merges the candidates of each row (one launch when the row fits in one block).

Order: values descending; equal values by lower column index first; NaN ranks above every number
(as in ``torch.topk``) and NaNs tie with each other; -0.0 ties with +0.0. ``topk_reference`` (a
stable descending sort) follows the same rule exactly. ``torch.topk`` itself promises no order
among equal values, so it may pick different indices on ties; the values agree.

How: each value becomes an int32 key whose integer order is that rule's float order, packed with
the complement of its column as one int64, so one integer max per round finds the best value and,
among equals, the lowest column; the value returned is read back from ``x`` at that column. Two ways to take
the k best of a block (``method``): "select", k rounds of a block-wide integer max, each masking the one it took;
"bitonic", one ``tl.topk`` (a bitonic network) of the next power of two >= max(k, 2) keys, stored at once. The
packed keys are unique, so both take the same columns.

``topk_logprobs_small`` picks the same columns of logits and returns their log probabilities: each block
program also keeps its max and sum of exp(x - max), the last launch combines them into the row's
logsumexp, so a log_softmax launch (and its float copy of the row) is not needed before the top-k.

The drafters call the ops ``topk`` and ``topk_logprobs``: on the Triton backend these kernels over the rows of
any (..., N) tensor they take (``takes``), ``torch.topk`` otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton

MAX_K = 16
METHODS = ("select", "bitonic")
DEFAULT_METHOD = "select"
MAX_COLS = 1 << 17  # the merge keeps every row's cdiv(N, block) * k candidates in one program
DEFAULT_BLOCK = 2048
_INT64_MIN: tl.constexpr = tl.constexpr(-(1 << 63))  # below every packed entry


class TopK(NamedTuple):
    """Like ``torch.return_types.topk``: values (R, k) in x's dtype, indices (R, k) int64."""

    values: torch.Tensor
    indices: torch.Tensor


@triton.jit
def order_key(x):
    """float32 -> int32 whose integer order is the module's float order: -0.0 ties +0.0, NaN above +inf."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int order == float order (-0.0 below +0.0, NaN by sign)
    key = tl.where(x == 0.0, 0, key)  # -0.0 ties with +0.0
    return tl.where(x != x, 0x7FFFFFFF, key)  # every NaN above +inf (0x7F800000), all equal


@triton.jit
def _emit(packed, row, slot, x_row_ptr, cand_ptr, val_ptr, idx_ptr, row_max, log_sum,
          K: tl.constexpr, FINAL: tl.constexpr, LOGP: tl.constexpr, KP: tl.constexpr = 0):
    """Take the k largest of ``packed``: as candidates (slot ``slot`` on) or as the output row (LOGP: the value
    less ``row_max`` and ``log_sum``, the row's log probability). KP > 0: all at once by a bitonic top-KP (a power
    of two >= K); 0: one by one. (Two functions, not an early return: the compiler scopes a constexpr branch's
    names into the code after it, where the loop would re-type them.)"""
    if KP > 0:
        _emit_bitonic(packed, row, slot, x_row_ptr, cand_ptr, val_ptr, idx_ptr, row_max, log_sum, K, FINAL, LOGP, KP)
    else:
        _emit_select(packed, row, slot, x_row_ptr, cand_ptr, val_ptr, idx_ptr, row_max, log_sum, K, FINAL, LOGP)


@triton.jit
def _emit_bitonic(packed, row, slot, x_row_ptr, cand_ptr, val_ptr, idx_ptr, row_max, log_sum,
                  K: tl.constexpr, FINAL: tl.constexpr, LOGP: tl.constexpr, KP: tl.constexpr):
    top = tl.topk(packed, KP)  # (KP,) best first
    i = tl.arange(0, KP)
    if FINAL:
        col = 0x7FFFFFFF - (top & 0x7FFFFFFF)
        tl.store(idx_ptr + row * K + i, col, mask=i < K)
        val = tl.load(x_row_ptr + col, mask=i < K, other=0.0)
        if LOGP:
            val = (val.to(tl.float32) - row_max) - log_sum
        tl.store(val_ptr + row * K + i, val, mask=i < K)
    else:
        tl.store(cand_ptr + slot + i, top, mask=i < K)


@triton.jit
def _emit_select(packed, row, slot, x_row_ptr, cand_ptr, val_ptr, idx_ptr, row_max, log_sum,
                 K: tl.constexpr, FINAL: tl.constexpr, LOGP: tl.constexpr):
    for i in range(K):
        best = tl.max(packed, axis=0)
        packed = tl.where(packed == best, _INT64_MIN, packed)  # packed entries are unique (column inside)
        if FINAL:
            col = 0x7FFFFFFF - (best & 0x7FFFFFFF)
            tl.store(idx_ptr + row * K + i, col)
            val = tl.load(x_row_ptr + col)
            if LOGP:
                val = (val.to(tl.float32) - row_max) - log_sum
            tl.store(val_ptr + row * K + i, val)
        else:
            tl.store(cand_ptr + slot + i, best)


@triton.jit
def _block_topk_kernel(
    x_ptr, cand_ptr, val_ptr, idx_ptr, part_ptr, n_cols, stride_x,
    K: tl.constexpr, BLOCK: tl.constexpr, FINAL: tl.constexpr, LOGP: tl.constexpr, KP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # (BLOCK,)
    packed = (order_key(x).to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)  # ties: the lower column is larger
    packed = tl.where(ok, packed, _INT64_MIN)  # a short block pads its candidates with it
    n_blocks = tl.num_programs(1)
    row_max = 0.0
    log_sum = 0.0
    if LOGP:  # the block's max and sum of exp(x - max); NaN or +inf in x makes the sum NaN (as log_softmax)
        row_max = tl.max(tl.where(ok, x, float("-inf")), axis=0)
        part = tl.sum(tl.where(ok & (x != float("-inf")), tl.exp(x - row_max), 0.0), axis=0)
        if FINAL:
            log_sum = tl.log(part)
        else:
            tl.store(part_ptr + (row * n_blocks + blk) * 2, row_max)
            tl.store(part_ptr + (row * n_blocks + blk) * 2 + 1, part)
    _emit(packed, row, (row * n_blocks + blk) * K, x_ptr + row * stride_x, cand_ptr, val_ptr, idx_ptr,
          row_max, log_sum, K, FINAL, LOGP, KP)


@triton.jit
def _merge_topk_kernel(
    cand_ptr, x_ptr, val_ptr, idx_ptr, part_ptr, n_cand, n_blocks, stride_x,
    K: tl.constexpr, CAND_P: tl.constexpr, BLOCKS_P: tl.constexpr, LOGP: tl.constexpr, KP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CAND_P)
    packed = tl.load(cand_ptr + row * n_cand + offs, mask=offs < n_cand, other=_INT64_MIN)  # (CAND_P,)
    row_max = 0.0
    log_sum = 0.0
    if LOGP:  # combine the blocks' (max, sum): a block of -inf alone adds 0
        b = tl.arange(0, BLOCKS_P)
        part = part_ptr + (row * n_blocks + b) * 2
        ms = tl.load(part, mask=b < n_blocks, other=float("-inf"))
        ss = tl.load(part + 1, mask=b < n_blocks, other=0.0)
        row_max = tl.max(ms, axis=0)
        log_sum = tl.log(tl.sum(tl.where(ms == float("-inf"), 0.0, ss * tl.exp(ms - row_max)), axis=0))
    _emit(packed, row, 0, x_ptr + row * stride_x, cand_ptr, val_ptr, idx_ptr, row_max, log_sum, K, True, LOGP, KP)


def check_topk_args(x: torch.Tensor, k: int) -> None:
    """Raise ValueError unless ``topk_small`` takes (x, k): x (R, N) float, last dim contiguous,
    1 <= N <= MAX_COLS, k an int in [1, min(MAX_K, N)]."""
    check_tensor("x", x, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    n = x.shape[1]
    if not 1 <= n <= MAX_COLS:
        raise ValueError(f"x must have 1 to {MAX_COLS} columns, got {n}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(MAX_K, n):
        raise ValueError(f"k must be an int in [1, {min(MAX_K, n)}] (at most {MAX_K} and the {n} columns), "
                         f"got {k!r}")


def takes(x: torch.Tensor, k: int) -> bool:
    """Whether ``topk_small`` takes the rows of ``x`` (..., N) (leading dims flattened, last dim made
    contiguous) with this ``k``; a caller falls back to ``torch.topk`` otherwise."""
    n = x.shape[-1] if x.dim() else 0
    return x.dtype in FLOAT_DTYPES and 1 <= n <= MAX_COLS and isinstance(k, int) and 1 <= k <= min(MAX_K, n)


def topk_small(x: torch.Tensor, k: int, block: int = DEFAULT_BLOCK, num_warps: int | None = None,
               method: str = DEFAULT_METHOD) -> TopK:  # (R, N) -> (R, k) x2
    """Each row's k largest values of ``x`` (R, N), best first, with their columns: the values of
    ``torch.topk(x, k, dim=-1)``, ties and NaN as the module docstring says (== ``topk_reference``).
    ``block`` (a power of two >= 16) is the columns one program of launch 1 reads; ``num_warps`` its warps
    (None: 8 from 4,096 columns, else 4); ``method`` "select" or "bitonic" (the module docstring)."""
    return _launch(x, k, block, False, num_warps, method)


def topk_logprobs_small(x: torch.Tensor, k: int, block: int = DEFAULT_BLOCK, num_warps: int | None = None,
                        method: str = DEFAULT_METHOD) -> TopK:  # (R, N) -> (R, k) x2
    """``topk_small``'s columns of logits ``x`` (R, N) with their log probabilities, float32: values
    ``log_softmax(x.float())`` at those columns (== ``topk_logprobs_reference`` up to float rounding), in the
    same launches (each block also sums its exponentials). A row holding NaN or +inf has NaN values."""
    return _launch(x, k, block, True, num_warps, method)


def _launch(x: torch.Tensor, k: int, block: int, logp: bool, num_warps: int | None = None,
            method: str = DEFAULT_METHOD) -> TopK:
    check_topk_args(x, k)
    check_launchable(_block_topk_kernel, x.device)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    kp = next_pow2(max(k, 2)) if method == "bitonic" else 0  # (tl.topk takes a power of two, and not 1)
    r, n = x.shape
    values = torch.empty((r, k), dtype=torch.float32 if logp else x.dtype, device=x.device)
    indices = torch.empty((r, k), dtype=torch.int64, device=x.device)
    if r == 0:
        return TopK(values, indices)
    block = min(block, max(16, next_pow2(n)))
    n_blocks = triton.cdiv(n, block)
    warps = num_warps or (8 if block >= 4096 else 4)
    if n_blocks == 1:
        _block_topk_kernel[(r, 1)](x, values, values, indices, values, n, x.stride(0), K=k, BLOCK=block,
                                   FINAL=True, LOGP=logp, KP=kp, num_warps=warps)
        return TopK(values, indices)
    cand = torch.empty((r, n_blocks * k), dtype=torch.int64, device=x.device)  # packed (key, column)
    part = torch.empty((r, n_blocks, 2) if logp else (1,), dtype=torch.float32, device=x.device)  # (max, sum)
    _block_topk_kernel[(r, n_blocks)](x, cand, values, indices, part, n, x.stride(0), K=k, BLOCK=block,
                                      FINAL=False, LOGP=logp, KP=kp, num_warps=warps)
    _merge_topk_kernel[(r,)](cand, x, values, indices, part, n_blocks * k, n_blocks, x.stride(0), K=k,
                             CAND_P=max(next_pow2(n_blocks * k), kp), BLOCKS_P=next_pow2(n_blocks), LOGP=logp, KP=kp,
                             num_warps=4)
    return TopK(values, indices)


def topk_reference(x: torch.Tensor, k: int) -> TopK:  # (..., N) -> (..., k) x2
    """``topk_small``'s promise in torch: a stable descending sort (NaN largest, ties by lower index). The rule
    is spelled out rather than left to the sort's NaN and signed-zero handling (on the H200 a bf16 row's NaN
    did not sort first, even cast to float32): values sort in float32 with NaN as -inf and -0.0 as +0.0, then
    a second stable sort moves the NaNs to the front in column order."""
    xf = x.float()
    nan = xf.isnan()
    value = torch.where(nan, float("-inf"), xf) + 0.0  # + 0.0: -0.0 becomes +0.0
    order = torch.sort(value, dim=-1, descending=True, stable=True).indices
    nan_first = torch.sort(nan.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    idx = order.gather(-1, nan_first)[..., :k]
    return TopK(x.gather(-1, idx), idx)


def topk_logprobs_reference(x: torch.Tensor, k: int) -> TopK:  # (..., N) -> (..., k) x2
    """``topk_logprobs_small``'s promise in torch: ``topk_reference``'s columns, ``log_softmax(x.float())`` there."""
    idx = topk_reference(x, k).indices
    return TopK(torch.log_softmax(x.float(), dim=-1).gather(-1, idx), idx)


def topk(x: torch.Tensor, k: int, *, use_triton: bool):  # (..., N) -> values, indices (..., k)
    """The k largest entries of each row of ``x`` over its last dimension, best first: ``topk_small`` (two
    launches at most; ties go to the lower index, NaN ranks first) when ``use_triton`` (the Triton backend) and
    it takes the rows (``takes``: k <= MAX_K, float); ``torch.topk`` otherwise (no promised order among equal
    values)."""
    if not (use_triton and takes(x, k)):
        return torch.topk(x, k, dim=-1)
    return _rows(topk_small, x, k)


def topk_logprobs(x: torch.Tensor, k: int, *, use_triton: bool):  # (..., N) -> values float32, indices (..., k)
    """The k most probable columns of each row of logits ``x`` and their log probabilities (float32):
    ``topk_logprobs_small`` (``topk``'s launches, no log_softmax launch) when ``use_triton`` and ``takes``
    (x, k); ``torch.topk(torch.log_softmax(x.float(), -1), k)`` otherwise."""
    if not (use_triton and takes(x, k)):
        return torch.topk(torch.log_softmax(x.float(), dim=-1), k, dim=-1)
    return _rows(topk_logprobs_small, x, k)


def _rows(fn, x: torch.Tensor, k: int) -> TopK:
    """``fn`` over the rows of ``x`` (..., N) flattened to (R, N), its (R, k) outputs viewed (..., k)."""
    flat = x.reshape(-1, x.shape[-1])  # (R, N)
    top = fn(flat if flat.stride(-1) == 1 else flat.contiguous(), k)  # (R, k) each
    return TopK(top.values.view(*x.shape[:-1], k), top.indices.view(*x.shape[:-1], k))
