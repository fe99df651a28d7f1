"""The Gumbel-max choice's pass over a row's columns, and that pass split over several programs per row.

A sampled row's score at column v is x / T + G(v) (float64), G its Gumbel noise (``kernels.gumbel_noise``); a
greedy row's is x itself. ``gumbel_max_range`` and ``argmax_lanes`` keep, per lane of a block, the best score of the
columns the lane reads and its first column; ``first_best`` reduces the lanes to the row's answer, the lowest column
among those holding the best score. ``kernels.gumbel_choice`` builds its choices from them.

When the rows are too few to fill the GPU (``gumbel_splits``), the pass over every column is split: S programs per
row each write the best score of a chunk of columns, its first column and its largest logit
(``gumbel_max_partials``), and one program per row reduces them (``reduce_partials``: the best score, among equal
ones the lowest column; each chunk's column is its first, so the lowest of them is the row's first), the same token
as one program walking the row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from specdec.kernels.arg_checks import check_launchable, grid_processors, next_pow2
from specdec.kernels.gumbel_noise import ROUGH_ERR, gumbel_at, gumbel_rough, row_noise_key
from specdec.kernels.triton_import import tl, triton
from torch import Tensor

NO_INDEX = 2**31 - 1  # "no column": no lane improved on -inf
# the split pass's programs: smaller than a row's program so that more fit on an SM at once, and about this many
# per SM in all; guesses, not measured on a GPU yet (bench/bench_kernels.py::test_split_choice)
SPLIT_BLOCK = 1024
SPLIT_WARPS = 4
SPLIT_PROGRAMS_PER_SM = 4
# a pass over at least this many blocks scores through the rough noise (``gumbel_max_range``'s ROUGH): a walk's
# k-th block holds a new best about 1 / k of the time, so over n blocks ~ln n + 0.6 are scored exactly, and every
# block pays for the rough noise and the bound's reductions. On the H100 a walk of 48 blocks took 46-58% of the
# exact walk's time with the bound, while batch 64's split pass (chunks of 6 blocks) took 37 us a step with it
# against 33 without (bench/RESULTS.md, session 34)
ROUGH_MIN_BLOCKS = 8


@triton.jit
def gumbel_max_block(x, cols, ok, t, sub0, sub1, best, best_i):
    """The lanes' running (best score, first column) updated with a block's columns ``cols`` where ``ok``: x (float32
    logits) / t (float64) + G, G the exact float64 noise (``gumbel_at``), the block's later columns never displacing
    an equal score. Scores are computed exactly only in blocks where some column could reach the best so far: a
    column's float32 score from ``gumbel_rough`` is within ``ROUGH_ERR`` plus 2**-20 of its x / t of the exact one, so
    a column whose upper bound is below the larger of the lanes' best and the block's best lower bound is beaten by
    some column exactly (and is left out); after a row's first blocks, a block rarely holds a new best, and most
    blocks cost one hash and two float32 logs a column instead of two hashes and two float64 logs."""
    xt = x / t.to(tl.float32)
    rough = xt + gumbel_rough(sub0, sub1, cols)
    err = ROUGH_ERR + tl.abs(xt) * 9.5367431640625e-07  # + |x / t| 2**-20 (float32's x / t is within 2**-22 of it)
    # bounds of the exact score: none where the rough one is not finite (a flagged column, float32 overflow, NaN),
    # except that x = -inf scores -inf exactly
    finite = tl.abs(rough) < float("inf")
    lo_b = tl.where(ok & finite, rough - err, float("-inf"))
    hi_b = tl.where(x == float("-inf"), float("-inf"), tl.where(finite, rough + err, float("inf")))
    floor = tl.maximum(tl.max(best, axis=0), tl.max(lo_b, axis=0).to(tl.float64))
    need = ok & (hi_b.to(tl.float64) >= floor)
    if tl.max(need.to(tl.int32), axis=0) > 0:
        best, best_i = gumbel_max_exact(x, cols, need, t, sub0, sub1, best, best_i)
    return best, best_i


@triton.jit
def gumbel_max_exact(x, cols, ok, t, sub0, sub1, best, best_i):
    """The lanes' running (best score, first column) updated with a block's columns ``cols`` where ``ok``, every
    score x / t + G computed exactly (float64, ``gumbel_at``)."""
    score = x.to(tl.float64) / t + gumbel_at(sub0, sub1, cols)
    better = (score > best) & ok  # strict: NaN never wins, the earlier column keeps a tie
    return tl.where(better, score, best), tl.where(better, cols, best_i)


@triton.jit
def gumbel_max_range(x_row, t, sub0, sub1, lo, hi, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr,
                     ROUGH: tl.constexpr):
    """Per lane, the best x / t + G (float64) of a sampled row's columns [lo, hi) it reads and its first column;
    and the largest x (float32) of those columns. ROUGH: blocks scored through ``gumbel_max_block`` (worth it over
    many blocks; over one or two, nearly every block holds a new best and would pay for both noises)."""
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    xmax = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane, reduced once after the walk
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hi
        x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        xmax = tl.maximum(xmax, x)
        if ROUGH:
            best, best_i = gumbel_max_block(x, cols, ok, t, sub0, sub1, best, best_i)
        else:
            best, best_i = gumbel_max_exact(x, cols, ok, t, sub0, sub1, best, best_i)
    return best, best_i, tl.max(xmax, axis=0)


@triton.jit
def argmax_lanes(x_row, lo, hi, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr):
    """Per lane, the largest x (float64) of the row's columns [lo, hi) it reads and its first column (a greedy
    row)."""
    best = tl.full([BLOCK], float("-inf"), tl.float64)
    best_i = tl.full([BLOCK], NO_INDEX, tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < hi
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float64)
        better = (x > best) & ok
        best = tl.where(better, x, best)
        best_i = tl.where(better, cols, best_i)
    return best, best_i


@triton.jit
def first_best(best, best_i, NO_INDEX: tl.constexpr):
    """The first column holding the lanes' best score (NO_INDEX when no lane improved on -inf)."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where((best == top) & (best_i != NO_INDEX), best_i, NO_INDEX), axis=0)


@triton.jit
def reduce_partials(best_ptr, first_ptr, xmax_ptr, row, n_split, SPLIT: tl.constexpr, NO_INDEX: tl.constexpr):
    """A row's pass from its n_split partials (SPLIT a power of two >= n_split): the first column holding the best
    score (NO_INDEX when none beat -inf) and the largest x."""
    s = tl.arange(0, SPLIT)
    ok = s < n_split
    at = row * n_split + s
    best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
    first = tl.load(first_ptr + at, mask=ok, other=NO_INDEX)
    xmax = tl.max(tl.load(xmax_ptr + at, mask=ok, other=float("-inf")), axis=0)
    return first_best(best, first, NO_INDEX), xmax


@triton.jit
def _gumbel_max_partials_kernel(x_ptr, t_ptr, key0_ptr, key1_ptr, pos_ptr, best_ptr, first_ptr, xmax_ptr, n_cols,
                                chunk, stride_x, stride_t, stride_key0, stride_key1, stride_pos,
                                BLOCK: tl.constexpr, NO_INDEX: tl.constexpr, ROUGH: tl.constexpr):
    # program (row, s) walks columns [s chunk, (s + 1) chunk) of its row as one program per row walks them all,
    # and writes at (row, s) of the (R, S) partials its best score (x itself on a greedy row), the first column
    # holding it (NO_INDEX: none beat -inf) and its largest x (-inf on a greedy row, which does not read it)
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, n_cols)
    x_row = x_ptr + row * stride_x
    t = tl.load(t_ptr + row * stride_t).to(tl.float64)
    xmax = tl.full((), float("-inf"), tl.float32)
    if t > 0:
        sub0, sub1 = row_noise_key(key0_ptr, key1_ptr, pos_ptr, row, stride_key0, stride_key1, stride_pos)
        best, best_i, xmax = gumbel_max_range(x_row, t, sub0, sub1, lo, hi, BLOCK, NO_INDEX, ROUGH)
    else:
        best, best_i = argmax_lanes(x_row, lo, hi, BLOCK, NO_INDEX)
    at = row * tl.num_programs(1) + tl.program_id(1)
    tl.store(best_ptr + at, tl.max(best, axis=0))
    tl.store(first_ptr + at, first_best(best, best_i, NO_INDEX))
    tl.store(xmax_ptr + at, xmax)


@triton.jit
def _pick_kernel(best_ptr, first_ptr, xmax_ptr, out_ptr, n_split, SPLIT: tl.constexpr, NO_INDEX: tl.constexpr):
    # one program per row: its token from the partials of ``_gumbel_max_partials_kernel`` (none: column 0)
    row = tl.program_id(0).to(tl.int64)
    c, _ = reduce_partials(best_ptr, first_ptr, xmax_ptr, row, n_split, SPLIT, NO_INDEX)
    tl.store(out_ptr + row, tl.where(c == NO_INDEX, 0, c).to(tl.int64))


def gumbel_splits(rows: int, n_cols: int, block: int, device: torch.device) -> int:
    """The programs per row that a choice's pass over every token is split over: enough for the rows to make
    ``SPLIT_PROGRAMS_PER_SM`` programs per SM, at most one per ``block`` columns; 1 (one program per row) once the
    rows alone are that many. Known on the host from the shapes and the device: a CUDA graph can capture it."""
    return max(1, min(SPLIT_PROGRAMS_PER_SM * grid_processors(device) // max(rows, 1), triton.cdiv(n_cols, block)))


class GumbelPartials(NamedTuple):
    """The pass split over S programs per row: per (row, program) the best score of its chunk of columns (float64,
    -inf when none beat it), the first column holding it (int32, ``NO_INDEX`` when none) and the largest x
    (float32; -inf on greedy rows)."""

    best: Tensor  # (R, S) float64
    first: Tensor  # (R, S) int32
    xmax: Tensor  # (R, S) float32

    @property
    def split(self) -> int:
        """The kernels' SPLIT: a power of two >= S, > 1."""
        return max(2, next_pow2(self.best.shape[1]))


def split_count(splits: int | None, rows: Tensor, split_block: int) -> int:
    """``splits`` checked (None: ``gumbel_splits``'s), for rows (R, V)."""
    if split_block < 16 or split_block & (split_block - 1):
        raise ValueError(f"split_block must be a power of two >= 16, got {split_block}")
    if splits is None:
        return gumbel_splits(rows.shape[0], rows.shape[1], split_block, rows.device)
    if splits < 1:
        raise ValueError(f"splits must be >= 1 or None, got {splits}")
    return splits


def gumbel_max_partials(rows: Tensor, temperature: Tensor, key0: Tensor, key1: Tensor, position: Tensor,
                        splits: int, block: int, num_warps: int) -> GumbelPartials:
    """The pass over rows (R, V) (checked) split over ``splits`` > 1 programs per row, chunks a multiple of
    ``block`` columns (fewer programs where the chunks would leave some empty)."""
    r, v = rows.shape
    chunk = triton.cdiv(triton.cdiv(v, block), splits) * block
    s = triton.cdiv(v, chunk)
    parts = GumbelPartials(torch.empty((r, s), dtype=torch.float64, device=rows.device),
                           torch.empty((r, s), dtype=torch.int32, device=rows.device),
                           torch.empty((r, s), dtype=torch.float32, device=rows.device))
    check_launchable(_gumbel_max_partials_kernel, rows.device)
    _gumbel_max_partials_kernel[(r, s)](rows, temperature, key0, key1, position, *parts, v, chunk, rows.stride(0),
                                        temperature.stride(0), key0.stride(0), key1.stride(0), position.stride(0),
                                        BLOCK=block, NO_INDEX=NO_INDEX, ROUGH=chunk >= ROUGH_MIN_BLOCKS * block,
                                        num_warps=num_warps)
    return parts


def pick_tokens(parts: GumbelPartials, out: Tensor) -> Tensor:
    """Each row's token from its partials into ``out`` (R,) int64 (a row where none beat -inf: column 0)."""
    _pick_kernel[(out.shape[0],)](*parts, out, parts.best.shape[1], SPLIT=parts.split, NO_INDEX=NO_INDEX)
    return out
