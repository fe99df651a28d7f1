"""Top-k / top-p / min-p filtering of softmax(x / t) per row without sorting the vocabulary.

The rule (``filtered_probs_reference``, the sort the sampled acceptance rule runs): rank a row's tokens by
logit, descending, equal logits by lower id; softmax over the k best (k = top_k, 0 or >= V: all); the token of
rank j is kept iff j < k, the mass of the tokens ranked before it is < top_p (rank 0 always kept) and its
probability is >= min_p times rank 0's; kept probabilities are renormalised (top-k alone: its softmax),
dropped ones are 0. Rows without a filter get ``probs`` unchanged. Parameters are per batch row b
(row // rows per batch row of x (B, ..., V)); temperatures > 0 (greedy rows are handled by the caller).

How ``nucleus_probs`` does it: one program per row, the passes of ``kernels/nucleus_passes.py`` (the max and min
order keys, a radix select of the top-k key, a histogram-bounded radix select of the top-p key over the
candidates, min-p and the kept sum), then the written row.

Floating point: the kernel's sums run in another order than the reference's cumsum, so a token whose
cumulative mass is within float rounding of top_p (or probability within rounding of min_p times rank 0's)
may go the other way; elsewhere the kept sets are the same and probabilities agree to float rounding.
Rows of finite or -inf logits only (a row of -inf alone gives NaN, as the softmax does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, INDEX_DTYPES, check_launchable, check_tensor
from specdec.kernels.nucleus_passes import (
    count_select,
    keep_token,
    kept_sum,
    load_block,
    row_filter,
    row_stats,
    tie_cut,
    top_p_cut,
)
from specdec.kernels.triton_import import tl, triton

if TYPE_CHECKING:
    from specdec.row_sampling import RowSampling

DEFAULT_BLOCK = 2048
MAX_COLS = 1 << 30
RULE_INTS: tl.constexpr = tl.constexpr(6)  # a ``KeepRule`` row: filtered, thr_k, cut_k, thr_p, cut_p, shift
RULE_FLOATS: tl.constexpr = tl.constexpr(2)  # and m, min_p


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
        hi, lo, shift, m = row_stats(x_row, n_cols, t, BLOCK)
        thr_k = lo - 1  # off: every key is above
        cut_k = -1
        if k < n_cols:
            thr_k, ties = count_select(x_row, n_cols, shift, lo, hi, k, BLOCK)
            if ties > 0:
                cut_k = tie_cut(x_row, ids_row, n_cols, False, shift, thr_k, ties, t, m, 0.0, float("inf"), BLOCK)
        thr_p = thr_k
        cut_p = cut_k
        n_c = n_cols
        listed = nucleus & (m > float("-inf"))  # (a row of -inf alone is NaN: nothing to select)
        if listed:
            thr_p, cut_p, n_c = top_p_cut(x_row, ids_row, n_cols, shift, t, m, thr_k, cut_k, top_p, BLOCK, MASS_BLOCK)
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
            s = kept_sum(x_row, ids_row, tl.where(listed, n_c, n_cols), listed, shift, t, m, thr_k, cut_k,
                          thr_p, cut_p, min_p, BLOCK)
            norm = tl.full((BLOCK,), 0.0, tl.float32) + s
            for start in range(0, n_cols, BLOCK):
                cols, key, e, ok = load_block(x_row, ids_row, start, n_cols, False, shift, t, m, BLOCK)
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
