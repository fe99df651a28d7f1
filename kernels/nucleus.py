"""Top-k / top-p / min-p filtering of softmax(x / t) per row without sorting the vocabulary.

The rule (``filtered_probs_reference``, the sort the sampled acceptance rule runs): rank a row's tokens by
logit, descending, equal logits by lower id; softmax over the k best (k = top_k, 0 or >= V: all); the token of
rank j is kept iff j < k, the mass of the tokens ranked before it is < top_p (rank 0 always kept) and its
probability is >= min_p times rank 0's; kept probabilities are renormalised (top-k alone: its softmax),
dropped ones are 0. Rows without a filter get ``probs`` unchanged. Parameters are per batch row b
(row // rows per batch row of x (B, ..., V)); temperatures > 0 (greedy rows are handled by the caller).

How ``nucleus_probs`` does it, one program per row, each pass a loop over the row in chunks of BLOCK (the
row stays in cache), e = exp(x / t - max) the unnormalised mass:
1. the max and min int32 order key (``topk.order_key``: integer order == float order, so a key's rank is
   its logit's) and the trailing zero bits all the row's floats share (a bf16 row: 16, shifted off);
2. top-k: radix select of the k-th largest key over (key - min key), 8-bit digits counted with
   ``tl.histogram``; tokens tied at that key are kept by lowest id (one more pass finds the last kept id);
3. top-p: a 256-bin count histogram of the top-k tokens by e (quarter octaves) bounds the mass of its
   lowest bins; the tokens of the bins above those that surely hold less than 1 - top_p are the candidates,
   compacted in id order into a scratch row (all top-k tokens where no bin can go); radix select over their
   keys with 16-bin mass histograms finds the key at which the mass in rank order reaches top_p, and tokens
   tied there are taken in id order while the mass ranked before them is below top_p;
4. min-p (e >= min_p: rank 0 has e = 1), the kept sum, then the written row.

Floating point: the kernel's sums run in another order than the reference's cumsum, so a token whose
cumulative mass is within float rounding of top_p (or probability within rounding of min_p times rank 0's)
may go the other way; elsewhere the kept sets are the same and probabilities agree to float rounding.
Rows of finite or -inf logits only (a row of -inf alone gives NaN, as the softmax does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, INDEX_DTYPES, check_launchable, check_tensor
from specdec.kernels.topk import order_key
from specdec.kernels.triton_import import tl, triton

if TYPE_CHECKING:
    from specdec.row_sampling import RowSampling

DEFAULT_BLOCK = 2048
MAX_COLS = 1 << 30
_INT_MIN: tl.constexpr = tl.constexpr(-(1 << 31))
_INT_MAX: tl.constexpr = tl.constexpr((1 << 31) - 1)
_COUNT_BITS: tl.constexpr = tl.constexpr(8)  # top-k digits: 256 bins, tl.histogram
_COUNT_RADIX: tl.constexpr = tl.constexpr(256)
_MASS_BITS: tl.constexpr = tl.constexpr(4)  # top-p digits: 16 bins of mass, one compare per bin and token
_MASS_RADIX: tl.constexpr = tl.constexpr(16)
_MARGIN: tl.constexpr = tl.constexpr(1e-4)  # candidates must hold top_p * (1 + this): far above float rounding
RULE_INTS: tl.constexpr = tl.constexpr(6)  # a ``KeepRule`` row: filtered, thr_k, cut_k, thr_p, cut_p, shift
RULE_FLOATS: tl.constexpr = tl.constexpr(2)  # and m, min_p


@triton.jit
def _load(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK: tl.constexpr):
    """(cols, key, e, ok) of entries [start, start + BLOCK) of the row, or of the ids listed in ids_row: the
    shifted order key and the unnormalised softmax exp(x / t - m), x / t rounded like torch's division."""
    offs = start + tl.arange(0, BLOCK)
    ok = offs < n
    if from_ids:
        cols = tl.load(ids_row + offs, mask=ok, other=0)
    else:
        cols = offs
    x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(tl.math.div_rn(x, tl.full((BLOCK,), 0.0, tl.float32) + t) - m)
    return cols, order_key(x) >> shift, e, ok


@triton.jit
def keep_token(key, cols, e, thr_k, cut_k, thr_p, cut_p, min_p):
    """Kept by top-k and top-p (keys above thr, and at thr the ids up to cut) and by min-p."""
    top_k = (key > thr_k) | ((key == thr_k) & (cols <= cut_k))
    return top_k & ((key > thr_p) | ((key == thr_p) & (cols <= cut_p))) & (e >= min_p)


@triton.jit
def _top_digit(lo, hi, BITS: tl.constexpr):
    """Lowest bit of the top BITS-bit digit that hi - lo (as uint32) needs; 0 when hi == lo."""
    span = (hi - lo).to(tl.uint32, bitcast=True)
    exponent = (span.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF  # rounding up adds one bit at most
    n_bits = tl.where(span == 0, 0, tl.minimum(exponent - 126, 32))
    return tl.maximum((n_bits + BITS - 1) // BITS - 1, 0) * BITS


@triton.jit
def _row_stats(x_row, n, t, BLOCK: tl.constexpr):
    """Max and min key shifted by the row's common trailing zero bits of its floats (at most 16), the shift,
    and the max of x / t."""
    kmax = _INT_MIN
    kmin = _INT_MAX
    low = 1 << 16  # the lowest bit set in any float, capped
    xmax = float("-inf")
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        key = order_key(x)
        kmax = tl.maximum(kmax, tl.max(tl.where(ok, key, _INT_MIN), axis=0))
        kmin = tl.minimum(kmin, tl.min(tl.where(ok, key, _INT_MAX), axis=0))
        bits = x.to(tl.int32, bitcast=True)
        bits = bits & -bits & 0xFFFF  # 0: none of the low 16 bits set
        low = tl.minimum(low, tl.min(tl.where(ok & (bits != 0), bits, 1 << 16), axis=0))
        xmax = tl.maximum(xmax, tl.max(x, axis=0))
    shift = ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # log2 of a power of two
    return kmax >> shift, kmin >> shift, shift, tl.math.div_rn(xmax, t)  # (division is monotone)


@triton.jit
def _count_select(x_row, n, shift, lo, hi, need, BLOCK: tl.constexpr):
    """(thr, ties): keys above thr and the first ``ties`` ids at thr are the ``need`` largest keys."""
    bins = tl.arange(0, _COUNT_RADIX)
    pos = _top_digit(lo, hi, _COUNT_BITS)
    pre = (lo - lo).to(tl.uint32, bitcast=True)  # resolved high digits of key - lo
    thr = lo
    ties = 0
    while pos >= 0:
        hist = tl.zeros((_COUNT_RADIX,), tl.int32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            rel = ((order_key(x) >> shift) - lo).to(tl.uint32, bitcast=True) >> pos.to(tl.uint32)
            inside = ok & ((rel >> _COUNT_BITS) == pre)
            hist += tl.histogram(tl.where(inside, rel & (_COUNT_RADIX - 1), 0).to(tl.int32), _COUNT_RADIX)
            hist -= tl.where(bins == 0, tl.sum(tl.where(inside, 0, 1), axis=0), 0)  # outsiders counted in bin 0
        at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist  # tokens in bins >= b
        digit = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1
        need -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        whole = need == tl.sum(tl.where(bins == digit, hist, 0), axis=0)  # the bucket is kept entirely
        pre = (pre << _COUNT_BITS) | digit.to(tl.uint32)
        bucket_lo = lo + (pre << pos.to(tl.uint32)).to(tl.int32, bitcast=True)
        thr = tl.where(whole, bucket_lo - 1, bucket_lo)
        ties = tl.where(whole, 0, need)
        pos = tl.where(whole | (pos == 0), -1, pos - _COUNT_BITS)
    return thr, ties


@triton.jit
def _mass_bin(e):
    """Bins of masses e in [0, 1] by their float bits, a quarter octave each: bin b holds the masses from
    float(0x3F800000 - (b + 1) 2**21) (excluded) to float(0x3F800000 - b 2**21); bin 255 all below 2**-63."""
    return tl.minimum(tl.maximum((0x3F800000 - e.to(tl.int32, bitcast=True)) >> 21, 0), 255)


@triton.jit
def _bin_cut(x_row, ids_row, n, shift, t, m, thr_k, cut_k, top_p, BLOCK: tl.constexpr):
    """(cut, z_k): the top-k tokens of mass bins >= cut hold at most z_k (1 - top_p (1 + 2 MARGIN)) of the
    top-k mass z_k (counted at each bin's largest mass); cut 256 where no bin can be left out."""
    bins = tl.arange(0, 256)
    hist = tl.zeros((256,), tl.int32)
    z_k = 0.0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = _load(x_row, ids_row, start, n, False, shift, t, m, BLOCK)
        kept = ok & keep_token(key, cols, e, thr_k, cut_k, thr_k, cut_k, 0.0)
        hist += tl.histogram(tl.where(kept, _mass_bin(e), 0), 256)
        hist -= tl.where(bins == 0, tl.sum(tl.where(kept, 0, 1), axis=0), 0)  # the others counted in bin 0
        z_k += tl.sum(tl.where(kept, e, 0.0), axis=0)
    bound = hist.to(tl.float32) * (0x3F800000 - bins * (1 << 21)).to(tl.float32, bitcast=True)  # (256,)
    tail = tl.sum(bound, axis=0) - tl.cumsum(bound, 0) + bound  # at most the mass in bins >= b
    cut = tl.min(tl.where(tail <= z_k * (1.0 - top_p * (1.0 + 2 * _MARGIN)), bins, 256), axis=0)
    return cut, z_k


@triton.jit
def _compact(x_row, ids_row, n, shift, t, m, thr_k, cut_k, bin_cut, BLOCK: tl.constexpr):
    """Write the ids of the top-k tokens of mass bin < bin_cut to ids_row in id order; return their count, min
    and max key and mass."""
    n_c = 0
    lo = _INT_MAX
    hi = _INT_MIN
    s_c = 0.0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = _load(x_row, ids_row, start, n, False, shift, t, m, BLOCK)
        cand = ok & keep_token(key, cols, e, thr_k, cut_k, thr_k, cut_k, 0.0) & (_mass_bin(e) < bin_cut)
        slot = n_c + tl.cumsum(cand.to(tl.int32), 0) - 1
        tl.store(ids_row + slot, cols, mask=cand)
        n_c += tl.sum(cand.to(tl.int32), axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(cand, key, _INT_MAX), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(cand, key, _INT_MIN), axis=0))
        s_c += tl.sum(tl.where(cand, e, 0.0), axis=0)
    return n_c, lo, hi, s_c


@triton.jit
def _mass_select(x_row, ids_row, n_c, shift, lo, hi, t, m, target, BLOCK: tl.constexpr):
    """(thr, above) over the listed candidates: thr is the key of the token, in rank order, at which the mass
    reaches ``target``; ``above`` is the mass of the keys above thr."""
    bins = tl.arange(0, _MASS_RADIX)
    pos = _top_digit(lo, hi, _MASS_BITS)
    pre = (lo - lo).to(tl.uint32, bitcast=True)
    above = 0.0
    while pos >= 0:
        hist = tl.zeros((_MASS_RADIX,), tl.float32)
        for start in range(0, n_c, BLOCK):
            cols, key, e, ok = _load(x_row, ids_row, start, n_c, True, shift, t, m, BLOCK)
            rel = (key - lo).to(tl.uint32, bitcast=True) >> pos.to(tl.uint32)
            e = tl.where(ok & ((rel >> _MASS_BITS) == pre), e, 0.0)
            hit = (rel & (_MASS_RADIX - 1)).to(tl.int32)[:, None] == bins[None, :]  # (BLOCK, RADIX)
            hist += tl.sum(tl.where(hit, e[:, None], 0.0), axis=0)
        reach = above + tl.sum(hist, axis=0) - tl.cumsum(hist, 0) + hist  # mass up to the end of bin b
        digit = tl.max(tl.where((reach >= target) & (hist > 0), bins, -1), axis=0)
        lowest = tl.min(tl.where(hist > 0, bins, _MASS_RADIX - 1), axis=0)  # not reached (rounding): keep the set
        digit = tl.maximum(digit, lowest)
        above += tl.sum(tl.where(bins > digit, hist, 0.0), axis=0)
        pre = (pre << _MASS_BITS) | digit.to(tl.uint32)
        pos -= _MASS_BITS
    return lo + pre.to(tl.int32, bitcast=True), above


@triton.jit
def _tie_cut(x_row, ids_row, n, from_ids, shift, thr, ties, t, m, above, target, BLOCK: tl.constexpr):
    """The last id kept among the tokens at key thr in id order (-1: none): the i-th (from 0) is kept iff
    i < ties and (i == 0 or above + i * its mass < target)."""
    cut = -1
    seen = 0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = _load(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK)
        tie = ok & (key == thr)
        i = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
        keep = tie & (i < ties) & ((i == 0) | (above + i.to(tl.float32) * e < target))
        cut = tl.maximum(cut, tl.max(tl.where(keep, cols, -1), axis=0))
        seen += tl.sum(tie.to(tl.int32), axis=0)
    return cut


@triton.jit
def _kept_sum(x_row, ids_row, n, from_ids, shift, t, m, thr_k, cut_k, thr_p, cut_p, min_p, BLOCK: tl.constexpr):
    """The mass of the kept tokens among the row's (or the listed) ones."""
    s = 0.0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = _load(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK)
        s += tl.sum(tl.where(ok & keep_token(key, cols, e, thr_k, cut_k, thr_p, cut_p, min_p), e, 0.0), axis=0)
    return s


@triton.jit
def _top_p(x_row, ids_row, n, shift, t, m, thr_k, cut_k, top_p, BLOCK: tl.constexpr, MASS_BLOCK: tl.constexpr):
    """(thr, cut, n_c): top-p among the top-k tokens keeps the keys above thr and the ids up to cut at thr; its
    n_c candidates are listed in ids_row."""
    bin_cut, z_k = _bin_cut(x_row, ids_row, n, shift, t, m, thr_k, cut_k, top_p, BLOCK)
    n_c, lo, hi, s_c = _compact(x_row, ids_row, n, shift, t, m, thr_k, cut_k, bin_cut, BLOCK)
    if (s_c < top_p * z_k * (1.0 + _MARGIN)) & (bin_cut < 256):  # (rounding): list every top-k token
        n_c, lo, hi, s_c = _compact(x_row, ids_row, n, shift, t, m, thr_k, cut_k, 256, BLOCK)
    target = top_p * z_k
    thr, above = _mass_select(x_row, ids_row, n_c, shift, lo, hi, t, m, target, MASS_BLOCK)
    return thr, _tie_cut(x_row, ids_row, n_c, True, shift, thr, _INT_MAX, t, m, above, target, BLOCK), n_c


@triton.jit
def row_filter(k_ptr, p_ptr, min_p_ptr, b, stride_k, stride_p, stride_min_p, n_cols, HAS_MIN_P: tl.constexpr):
    """Batch row b's filter: (k, nucleus, top_p, min_p): k the top-k count (n_cols when off), whether top-p is on,
    top-p and min-p (0 when off) as float32."""
    k = tl.load(k_ptr + b * stride_k)
    k = tl.where(k > 0, tl.minimum(k, n_cols), n_cols).to(tl.int32)
    top_p = tl.load(p_ptr + b * stride_p)
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + b * stride_min_p).to(tl.float32)
    return k, top_p < 1.0, top_p.to(tl.float32), min_p


@triton.jit
def _nucleus_kernel(
    x_ptr, probs_ptr, out_ptr, ids_ptr, t_ptr, k_ptr, p_ptr, min_p_ptr, rule_i_ptr, rule_f_ptr, skip_ptr,
    n_cols, stride_x, stride_probs, rows_per_param, stride_t, stride_k, stride_p, stride_min_p,
    HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr, MASS_BLOCK: tl.constexpr, RULE: tl.constexpr,
    SKIP: tl.constexpr,
):
    # RULE: instead of the filtered row, store what decides whether a token is kept (``KeepRule``); SKIP (with
    # RULE): rows whose skip flag is set store a rule of no filter without reading their row
    row = tl.program_id(0).to(tl.int64)
    b = row // rows_per_param
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * n_cols
    ids_row = ids_ptr + row * n_cols
    t = tl.load(t_ptr + b * stride_t).to(tl.float32)
    k, nucleus, top_p, min_p = row_filter(k_ptr, p_ptr, min_p_ptr, b, stride_k, stride_p, stride_min_p, n_cols,
                                          HAS_MIN_P)
    active = (k < n_cols) | nucleus | (min_p > 0)
    if SKIP:
        active = active & (tl.load(skip_ptr + row) == 0)
    if active:
        hi, lo, shift, m = _row_stats(x_row, n_cols, t, BLOCK)
        thr_k = lo - 1  # off: every key is above
        cut_k = -1
        if k < n_cols:
            thr_k, ties = _count_select(x_row, n_cols, shift, lo, hi, k, BLOCK)
            if ties > 0:
                cut_k = _tie_cut(x_row, ids_row, n_cols, False, shift, thr_k, ties, t, m, 0.0, float("inf"), BLOCK)
        thr_p = thr_k
        cut_p = cut_k
        n_c = n_cols
        listed = nucleus & (m > float("-inf"))  # (a row of -inf alone is NaN: nothing to select)
        if listed:
            thr_p, cut_p, n_c = _top_p(x_row, ids_row, n_cols, shift, t, m, thr_k, cut_k, top_p, BLOCK, MASS_BLOCK)
        if RULE:
            rule_i = rule_i_ptr + row * RULE_INTS
            tl.store(rule_i, 1)
            tl.store(rule_i + 1, thr_k)
            tl.store(rule_i + 2, cut_k)
            tl.store(rule_i + 3, thr_p)
            tl.store(rule_i + 4, cut_p)
            tl.store(rule_i + 5, shift)
            tl.store(rule_f_ptr + row * RULE_FLOATS, m)
            tl.store(rule_f_ptr + row * RULE_FLOATS + 1, min_p)
        else:
            s = _kept_sum(x_row, ids_row, tl.where(listed, n_c, n_cols), listed, shift, t, m, thr_k, cut_k,
                          thr_p, cut_p, min_p, BLOCK)
            norm = tl.full((BLOCK,), 0.0, tl.float32) + s
            for start in range(0, n_cols, BLOCK):
                cols, key, e, ok = _load(x_row, ids_row, start, n_cols, False, shift, t, m, BLOCK)
                keep = keep_token(key, cols, e, thr_k, cut_k, thr_p, cut_p, min_p) | (e != e)  # NaN: a row of -inf
                tl.store(out_row + cols, tl.where(keep, tl.math.div_rn(e, norm), 0.0), mask=ok)
    elif RULE:
        tl.store(rule_i_ptr + row * RULE_INTS, 0)  # no filter: every token kept
    else:
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n_cols
            tl.store(out_row + cols, tl.load(probs_ptr + row * stride_probs + cols, mask=ok), mask=ok)


def check_nucleus_args(x: torch.Tensor, t: torch.Tensor, probs: torch.Tensor | None, sampling: RowSampling) -> None:
    """Raise ValueError unless ``nucleus_probs`` takes the arguments: x (B, ..., V) float logits with V in
    [1, MAX_COLS] and a contiguous last dimension, probs float32 of x's shape, t and every parameter of
    ``sampling`` B entries (temperature t, top_k integer, top_p and min_p float) on x's device."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() < 2 or not 1 <= x.shape[-1] <= MAX_COLS:
        raise ValueError(f"x must be (B, ..., V) with 1 <= V <= {MAX_COLS}, got shape {tuple(x.shape)}")
    if probs is not None:
        check_tensor("probs", probs, shape=tuple(x.shape), dtypes=(torch.float32,), device=x.device,
                     last_dim_contiguous=True)
    b = x.shape[0]
    check_tensor("t", t, dtypes=FLOAT_DTYPES + (torch.float64,), device=x.device)
    if t.numel() != b:
        raise ValueError(f"t must have B = {b} entries (one temperature a batch row), got shape {tuple(t.shape)}")
    floats = (torch.float32, torch.float64)
    check_tensor("sampling.top_k", sampling.top_k, shape=(b,), dtypes=INDEX_DTYPES, device=x.device)
    check_tensor("sampling.top_p", sampling.top_p, shape=(b,), dtypes=floats, device=x.device)
    if sampling.min_p is not None:
        check_tensor("sampling.min_p", sampling.min_p, shape=(b,), dtypes=floats, device=x.device)


def takes_logits(x: torch.Tensor) -> bool:
    """Whether ``nucleus_rule`` takes logits ``x``."""
    return x.dtype in FLOAT_DTYPES and x.dim() >= 2 and 1 <= x.shape[-1] <= MAX_COLS


def takes(x: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether ``nucleus_probs`` takes logits ``x`` and ``probs`` (else ``filtered_probs`` runs the reference)."""
    return takes_logits(x) and probs.dtype == torch.float32


def nucleus_probs(x: torch.Tensor, t: torch.Tensor, probs: torch.Tensor, sampling: RowSampling,
                  block: int = DEFAULT_BLOCK, num_warps: int | None = None) -> torch.Tensor:  # (B, ..., V)
    """``filtered_probs_reference(x, t, probs, sampling)`` without a sort (module docstring: the rule, and where
    float rounding may differ). x may be the bf16 logits themselves; t: the B temperatures (> 0); ``block``
    (a power of two >= 16) is the columns one step of a row's loop reads; ``num_warps``: the program's warps
    (None: 8 for blocks of 2048 and more, else 4)."""
    rows = _rows(x, t, probs, sampling, block)  # (R, V)
    prob_rows = probs.reshape(-1, x.shape[-1])  # (R, V)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)  # (R, V)
    _launch(rows, x.shape[0], t, sampling, block, num_warps, prob_rows, out, None)
    return out.view(x.shape)


class KeepRule(NamedTuple):
    """What ``nucleus_probs`` keeps of each row, without the row: ``ints`` (R, 6) int32 [filtered, thr_k, cut_k,
    thr_p, cut_p, shift] and ``floats`` (R, 2) float32 [m, min_p]. A row with filtered 0 keeps every token; else
    token v (logit x) is kept iff ``keep_token(order_key(x) >> shift, v, exp(x / t - m), ...)``, exactly the tokens
    the filtered row has nonzero (up to the renormalised probability's underflow, which leaves out tokens no
    Gumbel-max choice can pick). ``kernels.gumbel_choice`` reads it in place of a kept mask."""

    ints: torch.Tensor
    floats: torch.Tensor


def nucleus_rule(x: torch.Tensor, t: torch.Tensor, sampling: RowSampling, block: int = DEFAULT_BLOCK,
                 num_warps: int | None = None, skip: torch.Tensor | None = None) -> KeepRule:
    """``nucleus_probs``' kept set of every row of x (B, ..., V) as a ``KeepRule`` (one row of numbers per row of
    x): the same passes less the last two (the kept mass and the written row), and no probabilities in.
    ``skip`` (R,) int32 (R the rows of x, all dims but the last): rows flagged nonzero are not read (their rule
    says "no filter"; the caller has their token already)."""
    rows = _rows(x, t, None, sampling, block)  # (R, V)
    r = rows.shape[0]
    if skip is not None:
        check_tensor("skip", skip, shape=(r,), dtypes=(torch.int32,), device=x.device)
    rule = KeepRule(torch.zeros((r, 6), dtype=torch.int32, device=x.device),
                    torch.zeros((r, 2), dtype=torch.float32, device=x.device))
    _launch(rows, x.shape[0], t, sampling, block, num_warps, rows, rows, rule, skip)
    return rule


def _rows(x: torch.Tensor, t: torch.Tensor, probs: torch.Tensor | None, sampling: RowSampling,
          block: int) -> torch.Tensor:
    """The checked arguments' logits as (R, V) rows with a contiguous last dimension."""
    check_nucleus_args(x, t, probs, sampling)
    check_launchable(_nucleus_kernel, x.device)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    rows = x.reshape(-1, x.shape[-1])  # (R, V)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows: torch.Tensor, b: int, t: torch.Tensor, sampling: RowSampling, block: int, num_warps: int | None,
            prob_rows: torch.Tensor, out: torch.Tensor, rule: KeepRule | None, skip: torch.Tensor | None = None,
            ) -> None:
    """One program per row of ``rows`` (R, V) (parameters per batch row: R // b rows each): the filtered rows into
    ``out`` (unfiltered ones copied from ``prob_rows``), or with ``rule`` the kept sets into it."""
    r, v = rows.shape
    if r == 0:
        return
    ids = torch.empty((r, v), dtype=torch.int32, device=rows.device)  # (R, V) top-p candidates
    temp, min_p = t.reshape(-1), sampling.min_p
    ints, floats = (ids, out) if rule is None else rule
    _nucleus_kernel[(r,)](
        rows, prob_rows, out, ids, temp, sampling.top_k, sampling.top_p, temp if min_p is None else min_p, ints,
        floats, ids if skip is None else skip, v, rows.stride(0), prob_rows.stride(0), r // b, temp.stride(0),
        sampling.top_k.stride(0), sampling.top_p.stride(0), 0 if min_p is None else min_p.stride(0),
        HAS_MIN_P=min_p is not None, BLOCK=block, MASS_BLOCK=min(block, 512), RULE=rule is not None,
        SKIP=skip is not None,
        num_warps=num_warps or (8 if block >= 2048 else 4))


def filtered_probs_reference(x: torch.Tensor, t: torch.Tensor, probs: torch.Tensor, sampling: RowSampling,
                             ) -> torch.Tensor:  # (B, ..., V)
    """``probs`` (softmax(x / t)) with the rows that use top-k, top-p or min-p replaced by their filtered
    distribution: a stable sort of every row, softmax over the top k, cumsum for top-p, a scatter back."""
    vocab = x.shape[-1]
    view = t.shape
    k = torch.where(sampling.top_k > 0, sampling.top_k.clamp(max=vocab), vocab).view(view)
    nucleus = (sampling.top_p < 1.0).view(view)
    top_p = torch.where(nucleus, sampling.top_p.to(x.dtype).view(view), float("inf"))  # +inf: nothing dropped
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)  # ranked by logit, then id
    rank = torch.arange(vocab, device=x.device)
    kept = torch.softmax((xs / t).masked_fill(rank >= k, float("-inf")), dim=-1)  # top-k
    reached = kept.cumsum(-1)[..., :-1] >= top_p  # (B, ..., V - 1): the mass up to rank j reaches top_p
    kept[..., 1:].masked_fill_(reached, 0.0)  # drop every token after the one that reaches it
    renorm = nucleus
    if sampling.min_p is not None:  # below min_p times rank 0's probability (the most probable token): dropped
        min_p = sampling.min_p.to(x.dtype).view(view)
        kept = kept.masked_fill(kept < min_p * kept[..., :1], 0.0)  # (min_p 0 drops nothing)
        renorm = renorm | (min_p > 0)
    kept = kept / torch.where(renorm, kept.sum(-1, keepdim=True), 1.0)  # renormalised (x / 1 is x exactly)
    filtered = (k < vocab) | renorm
    shaped = torch.empty_like(kept).scatter_(-1, order, kept)  # order is a permutation: every entry written
    return torch.where(filtered, shaped, probs)


def filtered_probs(x: torch.Tensor, t: torch.Tensor, probs: torch.Tensor, sampling: RowSampling, *,
                   use_triton: bool) -> torch.Tensor:  # (B, ..., V)
    """``filtered_probs_reference``'s distribution: ``nucleus_probs`` (no sort, float32) when ``use_triton`` and
    it takes x; the reference otherwise. ``_filtered`` of the sampled acceptance rule has this signature:
    x (B, ..., V) logits (float32 there), t (B, 1, ..., 1) temperatures, probs = softmax(x / t)."""
    if not (use_triton and takes(x, probs)):
        return filtered_probs_reference(x, t, probs, sampling)
    return nucleus_probs(x, t, probs, sampling)
