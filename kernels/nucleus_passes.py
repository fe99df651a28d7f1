"""The row passes of the sort-free top-k / top-p / min-p filter (``kernels/nucleus.py``'s kernel and the split
token choice of ``kernels/gumbel_choice.py``), Triton device functions over one row of logits in chunks of BLOCK
(the row stays in cache), e = exp(x / t - max) the unnormalised mass:
1. ``row_stats``: the max and min int32 order key (``topk.order_key``: integer order == float order, so a key's
   rank is its logit's) and the trailing zero bits all the row's floats share (a bf16 row: 16, shifted off);
2. top-k, ``count_select``: radix select of the k-th largest key over (key - min key), 8-bit digits counted with
   ``tl.histogram``; tokens tied at that key are kept by lowest id (``tie_cut``: one more pass finds the last kept
   id);
3. top-p, ``top_p_cut``: a 256-bin count histogram of the top-k tokens by e (quarter octaves) bounds the mass of
   its lowest bins; the tokens of the bins above those that surely hold less than 1 - top_p are the candidates,
   compacted in id order into a scratch row (all top-k tokens where no bin can go); radix select over their keys
   with 16-bin mass histograms finds the key at which the mass in rank order reaches top_p, and tokens tied there
   are taken in id order while the mass ranked before them is below top_p;
4. min-p (e >= min_p: rank 0 has e = 1), ``keep_token``, and the kept sum, ``kept_sum``.
``row_filter`` reads a batch row's filter parameters.
"""

from __future__ import annotations

from specdec.kernels.topk import order_key
from specdec.kernels.triton_import import tl, triton

_INT_MIN: tl.constexpr = tl.constexpr(-(1 << 31))
_INT_MAX: tl.constexpr = tl.constexpr((1 << 31) - 1)
_COUNT_BITS: tl.constexpr = tl.constexpr(8)  # top-k digits: 256 bins, tl.histogram
_COUNT_RADIX: tl.constexpr = tl.constexpr(256)
_MASS_BITS: tl.constexpr = tl.constexpr(4)  # top-p digits: 16 bins of mass, one compare per bin and token
_MASS_RADIX: tl.constexpr = tl.constexpr(16)
_MARGIN: tl.constexpr = tl.constexpr(1e-4)  # candidates must hold top_p * (1 + this): far above float rounding

@triton.jit
def load_block(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK: tl.constexpr):
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
def row_stats(x_row, n, t, BLOCK: tl.constexpr):
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
def count_select(x_row, n, shift, lo, hi, need, BLOCK: tl.constexpr):
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
        cols, key, e, ok = load_block(x_row, ids_row, start, n, False, shift, t, m, BLOCK)
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
        cols, key, e, ok = load_block(x_row, ids_row, start, n, False, shift, t, m, BLOCK)
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
            cols, key, e, ok = load_block(x_row, ids_row, start, n_c, True, shift, t, m, BLOCK)
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
def tie_cut(x_row, ids_row, n, from_ids, shift, thr, ties, t, m, above, target, BLOCK: tl.constexpr):
    """The last id kept among the tokens at key thr in id order (-1: none): the i-th (from 0) is kept iff
    i < ties and (i == 0 or above + i * its mass < target)."""
    cut = -1
    seen = 0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = load_block(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK)
        tie = ok & (key == thr)
        i = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
        keep = tie & (i < ties) & ((i == 0) | (above + i.to(tl.float32) * e < target))
        cut = tl.maximum(cut, tl.max(tl.where(keep, cols, -1), axis=0))
        seen += tl.sum(tie.to(tl.int32), axis=0)
    return cut


@triton.jit
def kept_sum(x_row, ids_row, n, from_ids, shift, t, m, thr_k, cut_k, thr_p, cut_p, min_p, BLOCK: tl.constexpr):
    """The mass of the kept tokens among the row's (or the listed) ones."""
    s = 0.0
    for start in range(0, n, BLOCK):
        cols, key, e, ok = load_block(x_row, ids_row, start, n, from_ids, shift, t, m, BLOCK)
        s += tl.sum(tl.where(ok & keep_token(key, cols, e, thr_k, cut_k, thr_p, cut_p, min_p), e, 0.0), axis=0)
    return s


@triton.jit
def top_p_cut(x_row, ids_row, n, shift, t, m, thr_k, cut_k, top_p, BLOCK: tl.constexpr, MASS_BLOCK: tl.constexpr):
    """(thr, cut, n_c): top-p among the top-k tokens keeps the keys above thr and the ids up to cut at thr; its
    n_c candidates are listed in ids_row."""
    bin_cut, z_k = _bin_cut(x_row, ids_row, n, shift, t, m, thr_k, cut_k, top_p, BLOCK)
    n_c, lo, hi, s_c = _compact(x_row, ids_row, n, shift, t, m, thr_k, cut_k, bin_cut, BLOCK)
    if (s_c < top_p * z_k * (1.0 + _MARGIN)) & (bin_cut < 256):  # (rounding): list every top-k token
        n_c, lo, hi, s_c = _compact(x_row, ids_row, n, shift, t, m, thr_k, cut_k, 256, BLOCK)
    target = top_p * z_k
    thr, above = _mass_select(x_row, ids_row, n_c, shift, lo, hi, t, m, target, MASS_BLOCK)
    return thr, tie_cut(x_row, ids_row, n_c, True, shift, thr, _INT_MAX, t, m, above, target, BLOCK), n_c


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
