"""The target's token at each verify position, greedy or sampled, as one argmax: the sampled rule's core.

A sampled row's token at sequence position s is the argmax over the kept tokens (its top-k / top-p / min-p set)
of x / T + G(s, v), where G(s, v) is Gumbel noise that depends only on the request's key, the position s and
the token id v. By the Gumbel-max trick that token is distributed exactly as softmax(x / T) restricted to the
kept set and renormalised, so sampling this way is target-only sampling; and since the noise is a function of
(key, s, v) and not of a draw counter, a request's tokens are one function of its seed and the target's
distributions, whatever the tree that verified them, the batch, the budget or the pipelining. A draft token at
s is accepted when it equals that argmax, which accepts a deterministic child x with probability p(x), after
rejected siblings x1.. with p(x) / (1 - p(x1) - ...): the rejection rule's own rates.

The noise is ``kernels.gumbel_noise``'s. Greedy rows (temperature 0) take the plain argmax (first index among
equal maxima) of x, as the greedy rule does.

``choose_tokens_reference`` is the torch computation; ``choose_tokens`` is the op the rule calls.

The kernel (``choose_tokens_triton``): one program per row walks the vocabulary in blocks, computing the noise
(``gumbel_noise.gumbel_at``), and keeps a running (best score, first column) per lane, reduced at the end to the
lowest column among the lanes holding the maximum. A block is scored exactly only where a cheap float32 bound of its
scores (``gumbel_noise.gumbel_rough``) says one could reach the best so far (``gumbel_split.gumbel_max_block``): the
same token, with most blocks' float64 noise never computed. With a kept set, a block holding no kept token is only
read: under top-p the noise (most of the kernel's arithmetic) is computed for the few blocks the nucleus falls in.
Without a kept set, when the rows are too few to fill the GPU, the pass over every token is split over several
programs per row (``kernels.gumbel_split``), the same token.

``choose_filtered_triton`` is the choice over kept sets that the sampled rule runs: since a kept set is a prefix
of its row in rank order, the unfiltered choice is the answer whenever it is kept, and checking that takes one
pass; the kept set itself (``kernels.nucleus``) is computed only for the rows where that fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from specdec.kernels.arg_checks import FLOAT_DTYPES, check_launchable, check_tensor
from specdec.kernels.gumbel_noise import check_row_keys, gumbel_noise, row_noise_key
from specdec.kernels.gumbel_split import (
    NO_INDEX,
    SPLIT_BLOCK,
    SPLIT_WARPS,
    argmax_lanes,
    first_best,
    gumbel_max_block,
    gumbel_max_partials,
    gumbel_max_range,
    pick_tokens,
    reduce_partials,
    split_count,
)
from specdec.kernels.nucleus import RULE_FLOATS, RULE_INTS, KeepRule, check_nucleus_args, nucleus_rule
from specdec.kernels.nucleus_passes import keep_token, row_filter
from specdec.kernels.topk import order_key
from specdec.kernels.triton_import import tl, triton
from torch import Tensor

if TYPE_CHECKING:
    from specdec.row_sampling import RowSampling

DEFAULT_BLOCK = 2048  # with 16 warps: the fastest launch measured on the H200 (bench/gpu_sampling_kernels.py)


def choose_tokens_reference(x: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                            kept: Tensor | None = None) -> Tensor:
    """(R,) int64 token chosen for each row of logits ``x`` (R, V): the argmax of x where ``temperature`` (R,)
    is 0, else the argmax of x / temperature + G(position, v) over the tokens ``kept`` (R, V) bool marks (None:
    all), G the row's Gumbel noise (``gumbel_noise`` of key0, key1, position: (R,) int64). A row whose every
    token is dropped, or whose scores are all -inf or NaN, chooses token 0."""
    v = x.shape[-1]
    xs = x.to(torch.float64)
    t = temperature.to(torch.float64).view(-1, 1)
    sampled = t > 0
    noise = gumbel_noise(key0, key1, position, torch.arange(v, device=x.device))  # (R, V)
    score = torch.where(sampled, xs / torch.where(sampled, t, 1.0) + noise, xs)
    if kept is not None:
        score = score.masked_fill(~kept & sampled, float("-inf"))
    inf = float("inf")
    score = torch.nan_to_num(score, nan=-inf, posinf=inf, neginf=-inf)  # only NaN changes: it never wins
    return score.argmax(-1)


@triton.jit
def _choose_kernel(x_ptr, t_ptr, key0_ptr, key1_ptr, pos_ptr, kept_ptr, rule_i_ptr, rule_f_ptr, skip_ptr, out_ptr,
                   n_cols, stride_x, stride_kept, stride_t, stride_key0, stride_key1, stride_pos,
                   HAS_KEPT: tl.constexpr, HAS_RULE: tl.constexpr, SKIP: tl.constexpr, BLOCK: tl.constexpr,
                   NO_INDEX: tl.constexpr):
    # SKIP: a row whose skip flag is set reads nothing and keeps its entry of out
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if SKIP:
        n_cols = tl.where(tl.load(skip_ptr + row) == 0, n_cols, 0)  # (no block is read)
    t = tl.load(t_ptr + row * stride_t).to(tl.float64)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    if t > 0:  # sampled: x / T + G over the kept tokens
        sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, stride_key0, stride_key1, stride_pos)
        if HAS_RULE:  # the kept set as ``nucleus.KeepRule`` describes it (filtered 0: every token)
            rule_i = rule_i_ptr + row * RULE_INTS
            filtered = tl.load(rule_i)
            thr_k, cut_k = tl.load(rule_i + 1), tl.load(rule_i + 2)
            thr_p, cut_p, shift = tl.load(rule_i + 3), tl.load(rule_i + 4), tl.load(rule_i + 5)
            m = tl.load(rule_f_ptr + row * RULE_FLOATS)
            min_p = tl.load(rule_f_ptr + row * RULE_FLOATS + 1)
            t32 = tl.full((BLOCK,), 0.0, tl.float32) + t.to(tl.float32)  # (the filter's own x / t)
        for start in range(0, n_cols, BLOCK):
            cols = start + lanes
            ok = cols < n_cols
            if HAS_KEPT:
                ok = ok & (tl.load(kept_ptr + row * stride_kept + cols, mask=ok, other=0) != 0)
            if HAS_RULE:
                if filtered != 0:
                    xf = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
                    e = tl.exp(tl.math.div_rn(xf, t32) - m)
                    ok = ok & keep_token(order_key(xf) >> shift, cols, e, thr_k, cut_k, thr_p, cut_p, min_p)
            if tl.max(ok.to(tl.int32), axis=0) > 0:  # a block with no kept token (most, under top-p) is skipped
                x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
                best, best_i = gumbel_max_block(x, cols, ok, t, sub0, sub1, best, best_i)
    else:  # greedy: x itself
        best, best_i = argmax_lanes(x_row, 0, n_cols, BLOCK, NO_INDEX)
    first = first_best(best, best_i, NO_INDEX)  # a row where no lane improved on -inf chooses column 0
    first = tl.where(first == NO_INDEX, 0, first).to(tl.int64)
    if SKIP:
        tl.store(out_ptr + row, first, mask=tl.load(skip_ptr + row) == 0)
    else:
        tl.store(out_ptr + row, first)


@triton.jit
def _filtered_choice_kernel(x_ptr, t_ptr, key0_ptr, key1_ptr, pos_ptr, k_ptr, p_ptr, min_p_ptr, out_ptr, done_ptr,
                            part_best_ptr, part_first_ptr, part_xmax_ptr, n_split,
                            n_cols, rows_per_param, max_rounds, stride_x, stride_t, stride_key0, stride_key1,
                            stride_pos, stride_k, stride_p, stride_min_p,
                            HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr,
                            SPLIT: tl.constexpr):
    # SPLIT > 1 (a power of two >= n_split): pass 1 (the unfiltered choice and the largest logit) is not walked
    # here but reduced from the n_split partials ``gumbel_split.gumbel_max_partials`` wrote for the row
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    t = tl.load(t_ptr + row * stride_t).to(tl.float64)
    lanes = tl.arange(0, BLOCK)
    state = 1  # 0: a candidate to check, 1: chosen, 2: left to the kept-set kernels
    if SPLIT > 1:
        c, xmax = reduce_partials(part_best_ptr, part_first_ptr, part_xmax_ptr, row, n_split, SPLIT, NO_INDEX)
    if t > 0:
        sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, stride_key0, stride_key1, stride_pos)
        if SPLIT == 1:  # the Gumbel-max over every token, and the largest logit
            best, best_i, xmax = gumbel_max_range(x_row, t, sub0, sub1, 0, n_cols, BLOCK, NO_INDEX, True)
            c = first_best(best, best_i, NO_INDEX)
        k, nucleus, top_p, min_p = row_filter(k_ptr, p_ptr, min_p_ptr, row // rows_per_param, stride_k, stride_p,
                                              stride_min_p, n_cols, HAS_MIN_P)
        filtered = (k < n_cols) | nucleus | (min_p > 0)
        state = tl.where(filtered & (c != NO_INDEX), 0, 1)
        c = tl.where(c == NO_INDEX, 0, c)
        t32 = tl.full((BLOCK,), 0.0, tl.float32) + t.to(tl.float32)  # the kept-set kernels' x / t and mass
        m = tl.math.div_rn(xmax, t.to(tl.float32))
        rounds = 0
        while state == 0:  # c is the best score of the tokens that could be kept: is it kept?
            xc = tl.load(x_row + c).to(tl.float32)
            key_c = order_key(xc)
            # per-lane sums, reduced once after the walk (a reduction across the program's warps per block would
            # wait on shared memory three times a block)
            z_lanes = tl.zeros([BLOCK], tl.float32)
            mass_lanes = tl.zeros([BLOCK], tl.float32)
            count_lanes = tl.zeros([BLOCK], tl.int32)
            best = tl.full([BLOCK], float("-inf"), tl.float64)
            best_i = tl.full([BLOCK], NO_INDEX, tl.int32)
            for start in range(0, n_cols, BLOCK):
                cols = start + lanes
                ok = cols < n_cols
                x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
                e = tl.exp(tl.math.div_rn(x, t32) - m)
                key = order_key(x)
                ahead = ok & ((key > key_c) | ((key == key_c) & (cols < c)))  # ranked before c
                z_lanes += tl.where(ok, e, 0.0)
                mass_lanes += tl.where(ahead, e, 0.0)
                count_lanes += ahead.to(tl.int32)
                if tl.max(ahead.to(tl.int32), axis=0) > 0:  # the next candidate: the best score ranked before c
                    best, best_i = gumbel_max_block(x, cols, ahead, t, sub0, sub1, best, best_i)
            z = tl.sum(z_lanes, axis=0)
            mass = tl.sum(mass_lanes, axis=0)
            count = tl.sum(count_lanes, axis=0)
            e_c = tl.exp(tl.math.div_rn(xc, t.to(tl.float32)) - m)
            by_p = (mass < top_p * z) | (nucleus == 0)
            kept = (count < k) & by_p & (e_c >= min_p)
            # under top-k and top-p both, top-p's mass is a share of the top k's, which this pass does not sum
            unsure = kept & (k < n_cols) & nucleus
            nxt = first_best(best, best_i, NO_INDEX)
            rounds += 1
            state = tl.where(unsure | ((kept == 0) & (nxt != NO_INDEX) & (rounds >= max_rounds)), 2,
                             tl.where(kept | (nxt == NO_INDEX), 1, 0))
            c = tl.where(kept, c, tl.where(nxt == NO_INDEX, 0, nxt))  # none left: every score -inf, column 0
    else:  # greedy: x itself
        if SPLIT == 1:
            best, best_i = argmax_lanes(x_row, 0, n_cols, BLOCK, NO_INDEX)
            c = first_best(best, best_i, NO_INDEX)
        c = tl.where(c == NO_INDEX, 0, c)
    tl.store(out_ptr + row, c.to(tl.int64), mask=state == 1)
    tl.store(done_ptr + row, (state == 1).to(tl.int32))


def _check_choice_args(rows: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                       block: int) -> None:
    """The checks of a token choice's arguments past the logits' dtype and layout: rows (R, V)."""
    r, v = rows.shape
    if not 1 <= v < NO_INDEX:
        raise ValueError(f"x must have 1 .. {NO_INDEX - 1} columns, got {v}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    check_tensor("temperature", temperature, shape=(r,), dtypes=(*FLOAT_DTYPES, torch.float64), device=rows.device)
    check_row_keys(key0, key1, position, r, rows.device)


def choose_tokens_triton(x: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                         kept: Tensor | None = None, block: int = DEFAULT_BLOCK, num_warps: int = 16,
                         rule: KeepRule | None = None, skip: Tensor | None = None, out: Tensor | None = None,
                         splits: int | None = None, split_block: int = SPLIT_BLOCK, split_warps: int = SPLIT_WARPS,
                         ) -> Tensor:
    """Same promise as ``choose_tokens_reference`` (the same tokens; on CUDA the same noise bit for bit), one launch
    with one program per row (two launches where ``splits`` splits the rows). x (R, V) float16/bfloat16/float32,
    last dim contiguous (any row stride); temperature (R,) float; key0, key1, position (R,) int64 (any stride); kept
    None or (R, V) bool, last dim contiguous. ``block`` (a power of two >= 16): the columns a program reads at a
    time; ``num_warps``: its warps. ``rule``: the kept set as ``kernels.nucleus.nucleus_rule`` gives it for these
    rows (instead of ``kept``; the same choices as kept = ``nucleus_probs(...) > 0``, with no (R, V) row written or
    read). ``skip`` (R,) int32 with ``out`` (R,) int64: rows flagged nonzero keep their entry of ``out`` (chosen
    already), the others' choices are written into it. ``splits``: the programs per row of the choice without kept
    set, rule or skip (None: ``gumbel_split.gumbel_splits``; 1: one program per row, one launch), each over a chunk of
    ``split_block`` columns at a time with ``split_warps`` warps, then one per row picks the token."""
    check_tensor("x", x, shape=(None, None), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(_choose_kernel, x.device)
    r, v = x.shape
    _check_choice_args(x, temperature, key0, key1, position, block)
    if kept is not None:
        check_tensor("kept", kept, shape=(r, v), dtypes=(torch.bool,), device=x.device, last_dim_contiguous=True)
    if rule is not None:
        if kept is not None:
            raise ValueError("give kept or rule, not both")
        check_tensor("rule.ints", rule.ints, shape=(r, 6), dtypes=(torch.int32,), device=x.device)
        check_tensor("rule.floats", rule.floats, shape=(r, 2), dtypes=(torch.float32,), device=x.device)
    if (skip is None) != (out is None):
        raise ValueError("give skip and out together")
    if skip is not None:
        check_tensor("skip", skip, shape=(r,), dtypes=(torch.int32,), device=x.device)
        check_tensor("out", out, shape=(r,), dtypes=(torch.int64,), device=x.device)
    else:
        out = torch.empty(r, dtype=torch.int64, device=x.device)
    plain = kept is None and rule is None and skip is None
    if splits is not None and splits > 1 and not plain:
        raise ValueError(f"splits must be None or 1 with kept, rule or skip, got {splits}")
    s = split_count(splits, x, split_block) if plain else 1
    if r and s > 1:
        pick_tokens(gumbel_max_partials(x, temperature, key0, key1, position, s, split_block, split_warps), out)
    elif r:
        ints, floats = (x, x) if rule is None else (rule.ints.contiguous(), rule.floats.contiguous())
        _choose_kernel[(r,)](x, temperature, key0, key1, position, x if kept is None else kept, ints, floats,
                             x if skip is None else skip, out, v, x.stride(0), 0 if kept is None else kept.stride(0),
                             temperature.stride(0), key0.stride(0), key1.stride(0), position.stride(0),
                             HAS_KEPT=kept is not None, HAS_RULE=rule is not None, SKIP=skip is not None,
                             BLOCK=block, NO_INDEX=NO_INDEX, num_warps=num_warps)
    return out


def choose_filtered_triton(x: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                           sampling: RowSampling, t_filter: Tensor, block: int = DEFAULT_BLOCK, num_warps: int = 16,
                           max_rounds: int = 8, splits: int | None = None, split_block: int = SPLIT_BLOCK,
                           split_warps: int = SPLIT_WARPS) -> Tensor:
    """``choose_tokens_reference`` of the R rows of x (B, ..., V) over their kept sets (kept = ``nucleus_probs(x,
    t_filter, ..., sampling) > 0``: the top-k / top-p / min-p filter of each row's batch row) without computing
    the kept sets where it can: per row ``temperature``, ``key0``, ``key1``, ``position`` (R,) as
    ``choose_tokens_triton`` takes them, ``sampling`` and ``t_filter`` (B,) (the filter's temperatures, > 0) as
    ``nucleus_rule`` does.

    The kept set is a prefix of the row in rank order (logit descending, ties by id), so the Gumbel-max over it is
    the Gumbel-max c over every token when c is kept; when c is not, no token ranked after it is kept either, and
    the answer is the Gumbel-max over the tokens ranked before c. One program per row finds c in one pass, then in
    each further pass checks c (its rank, the mass ranked before it, its probability against min-p) and finds the
    best score ranked before it, until c is kept. A row that samples from most of its distribution (top-p 0.9)
    keeps its first c at least nine times in ten: two passes, noise computed once for most tokens, nothing written
    but the token. Rows with top-k and top-p both (top-p's share is of the top k's mass), and rows still
    unresolved after ``max_rounds`` checks, are chosen by ``nucleus_rule`` and ``choose_tokens_triton(rule=...)``,
    which skip every other row. Float rounding: as ``kernels.nucleus`` (a token whose mass ranked before it is
    within rounding of top-p may go either way). ``splits``, ``split_block``, ``split_warps``: the first pass (the
    Gumbel-max c over every token) split over programs per row as ``choose_tokens_triton`` splits its choice,
    the checks then one program per row."""
    out, done = filtered_choice_pass(x, temperature, key0, key1, position, sampling, block, num_warps, max_rounds,
                                     splits, split_block, split_warps)
    if out.numel():
        rule = nucleus_rule(x, t_filter, sampling, skip=done)
        rows = x.reshape(-1, x.shape[-1])
        choose_tokens_triton(rows if rows.stride(-1) == 1 else rows.contiguous(), temperature, key0, key1, position,
                             block=block, num_warps=num_warps, rule=rule, skip=done, out=out)
    return out


def filtered_choice_pass(x: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                         sampling: RowSampling, block: int = DEFAULT_BLOCK, num_warps: int = 16, max_rounds: int = 8,
                         splits: int | None = None, split_block: int = SPLIT_BLOCK, split_warps: int = SPLIT_WARPS,
                         ) -> tuple[Tensor, Tensor]:
    """The first kernel of ``choose_filtered_triton``: (R,) int64 tokens and (R,) int32 flags, 1 where the row's
    token is chosen, 0 where it is left to the kept-set kernels (its token entry then unwritten)."""
    check_nucleus_args(x, sampling.temperature, None, sampling)
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    check_launchable(_filtered_choice_kernel, x.device)
    r, v = rows.shape
    _check_choice_args(rows, temperature, key0, key1, position, block)
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    s = split_count(splits, rows, split_block)
    out = torch.empty(r, dtype=torch.int64, device=x.device)
    done = torch.empty(r, dtype=torch.int32, device=x.device)
    if r:
        min_p = sampling.min_p
        parts, n_split, split = (rows, rows, rows), 1, 1  # (SPLIT 1: the kernel walks pass 1 itself)
        if s > 1:
            parts = gumbel_max_partials(rows, temperature, key0, key1, position, s, split_block, split_warps)
            n_split, split = parts.best.shape[1], parts.split
        _filtered_choice_kernel[(r,)](
            rows, temperature, key0, key1, position, sampling.top_k, sampling.top_p,
            sampling.top_p if min_p is None else min_p, out, done, *parts, n_split, v, r // x.shape[0], max_rounds,
            rows.stride(0), temperature.stride(0), key0.stride(0), key1.stride(0), position.stride(0),
            sampling.top_k.stride(0), sampling.top_p.stride(0), 0 if min_p is None else min_p.stride(0),
            HAS_MIN_P=min_p is not None, BLOCK=block, NO_INDEX=NO_INDEX, SPLIT=split, num_warps=num_warps)
    return out, done


def choose_tokens(x: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                  kept: Tensor | None = None, *, use_triton: bool = False) -> Tensor:
    """``choose_tokens_triton`` when ``use_triton`` (the Triton backend), ``choose_tokens_reference`` otherwise:
    the same tokens."""
    fn = choose_tokens_triton if use_triton else choose_tokens_reference
    return fn(x, temperature, key0, key1, position, kept)
