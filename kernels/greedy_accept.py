"""Greedy acceptance of a whole verify batch in one launch: ``greedy_step_outcome`` as a Triton kernel.

The torch version is ~20 small launches over (B, Q) and (B, Q, Q) tensors (sibling tie-break, ancestor
bitmask test, an argsort for the path order, gathers, concatenations). In a replayed verify graph each
costs a launch gap of its own; here one program per row does it all over at most 64 lanes.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import check_launchable, check_tensor, next_pow2
from specdec.kernels.triton_import import tl, triton

from specdec.acceptance_batched import greedy_step_outcome


@triton.jit
def _greedy_accept_kernel(tok_ptr, par_ptr, mask_ptr, am_ptr, fin_ptr, num_ptr, out_ptr,
                          Q: tl.constexpr, QP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, QP)
    lane = idx < Q
    base = row * Q
    n = tl.load(num_ptr + row)
    tok = tl.load(tok_ptr + base + idx, mask=lane, other=0)
    par = tl.load(par_ptr + base + idx, mask=lane, other=-1)
    bits = tl.load(mask_ptr + base + idx, mask=lane, other=0)
    fin = tl.load(fin_ptr + base + idx, mask=lane, other=1).to(tl.int32)
    real = idx < n
    finite = tl.min(tl.where(real, fin, 1), axis=0)
    is_node = real & (par >= 0)
    want = tl.load(am_ptr + base + tl.maximum(par, 0), mask=lane, other=-1)  # the target's token after the parent
    correct = is_node & (tok == want)
    # among correct siblings only the first (lowest index) stays: j loses if an earlier i shares its parent
    earlier = (par[None, :] == par[:, None]) & (idx[None, :] < idx[:, None]) & correct[None, :]  # [j, i]
    correct = correct & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    ok = correct | (idx == 0)
    ok_bits = tl.sum(tl.where(ok & lane, tl.full([QP], 1, tl.int64) << idx.to(tl.int64), 0), axis=0)
    on_path = is_node & ((bits & ~ok_bits) == 0)  # the token and all its ancestors correct
    count = tl.sum(on_path.to(tl.int64), axis=0)
    last = tl.max(tl.where(on_path, idx, 0), axis=0)  # the deepest: descendants come after their ancestors
    bonus = tl.load(am_ptr + base + last)
    # the order: path indices ascending, then the other lanes ascending (``accept_greedy_padded``'s argsort)
    before = idx[None, :] < idx[:, None]  # [j, i]: i comes before j
    on_before = tl.sum((before & on_path[None, :]).to(tl.int64), axis=1)
    off_before = tl.sum((before & ~on_path[None, :] & lane[None, :]).to(tl.int64), axis=1)
    pos = tl.where(on_path, on_before, count + off_before)
    out = out_ptr + row * (Q + 3)
    tl.store(out + 2 + pos, idx.to(tl.int64), mask=lane)
    if Q == 1:  # a decode step accepts nothing: its bonus token is the argmax
        count = count * 0
        bonus = tl.load(am_ptr + base)
    tl.store(out, count)
    tl.store(out + 1, bonus)
    tl.store(out + Q + 2, finite.to(tl.int64))


def greedy_accept_triton(tokens: torch.Tensor, parents: torch.Tensor, tree_mask: torch.Tensor,
                         target_argmax: torch.Tensor, finite: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Same promise as ``greedy_step_outcome`` ((B, Q) inputs, Q <= 64 -> (B, Q + 3) int64), in one launch."""
    check_tensor("tokens", tokens, shape=(None, None), dtypes=(torch.int64,))
    b, q = tokens.shape
    if not 1 <= q <= 64:
        raise ValueError(f"tokens must have 1 .. 64 columns (one int64 ancestor mask per token), got {q}")
    for name, t, dt in (("parents", parents, torch.int64), ("tree_mask", tree_mask, torch.int64),
                        ("target_argmax", target_argmax, torch.int64), ("finite", finite, torch.bool)):
        check_tensor(name, t, shape=(b, q), dtypes=(dt,), device=tokens.device)
    check_tensor("num_tokens", num_tokens, shape=(b,), dtypes=(torch.int64,), device=tokens.device)
    check_launchable(_greedy_accept_kernel, tokens.device)
    out = torch.empty(b, q + 3, dtype=torch.int64, device=tokens.device)
    if b:
        args = [t.contiguous() for t in (tokens, parents, tree_mask, target_argmax, finite, num_tokens)]
        _greedy_accept_kernel[(b,)](*args, out, Q=q, QP=max(2, next_pow2(q)), num_warps=2 if q <= 16 else 4)
    return out


def greedy_accept(tokens, parents, tree_mask, target_argmax, finite, num_tokens, *, use_triton: bool) -> torch.Tensor:
    """A graphed step's greedy outcome (B, Q + 3): ``greedy_accept_triton`` when ``use_triton`` (the Triton
    backend), ``acceptance_batched.greedy_step_outcome`` otherwise."""
    op = greedy_accept_triton if use_triton else greedy_step_outcome
    return op(tokens, parents, tree_mask, target_argmax, finite, num_tokens)
