"""Where a device draft program's tree nodes go, in one launch (reference: ``specdec.tree_ops.tree_slots_reference``).

After the catch-up forward every forwarded tree node's KV slot and position follow from its row's length
and block table: slot of logical position len(tokens) + region index, position len(tokens) + depth.
In torch that is about a dozen small launches (gathers by row, divide, modulo, where); here one.
"""

from __future__ import annotations

import torch
from specdec.kernels.arg_checks import check_launchable, check_tensor
from specdec.kernels.triton_import import tl, triton

from specdec.tree_ops import tree_slots_reference

BLOCK = 128


@triton.jit
def _tree_slots_kernel(seq_lens_ptr, num_tokens_ptr, bt_ptr, rows_ptr, nodes_ptr, depths_ptr, slots_ptr, pos_ptr,
                       n, bt_width, block_size, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = tl.load(rows_ptr + i, mask=ok, other=0)
    length = tl.load(seq_lens_ptr + row, mask=ok, other=0)
    logical = length + tl.load(nodes_ptr + i, mask=ok, other=0)
    block = tl.load(bt_ptr + row * bt_width + logical // block_size, mask=ok, other=0)
    live = tl.load(num_tokens_ptr + row, mask=ok, other=0) > 0  # padded rows store nothing
    tl.store(slots_ptr + i, tl.where(live, block * block_size + logical % block_size, -1), mask=ok)
    tl.store(pos_ptr + i, length + tl.load(depths_ptr + i, mask=ok, other=0), mask=ok)


def tree_slots_triton(seq_lens: torch.Tensor, num_tokens: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                      nodes: torch.Tensor, depths: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_slots_reference`` in one launch: all int64; seq_lens, num_tokens (b,), block_tables (b, W)
    contiguous, rows, nodes, depths (T,) -> slots, positions (T,)."""
    b = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_tensor("seq_lens", seq_lens, shape=(None,), dtypes=(torch.int64,))
    dev = seq_lens.device
    check_tensor("num_tokens", num_tokens, shape=(b,), dtypes=(torch.int64,), device=dev)
    check_tensor("block_tables", block_tables, shape=(b, None), dtypes=(torch.int64,), device=dev)
    if not block_tables.is_contiguous():
        raise ValueError(f"block_tables must be contiguous, got strides {block_tables.stride()}")
    check_tensor("rows", rows, shape=(None,), dtypes=(torch.int64,), device=dev)
    t = rows.shape[0]
    check_tensor("nodes", nodes, shape=(t,), dtypes=(torch.int64,), device=dev)
    check_tensor("depths", depths, shape=(t,), dtypes=(torch.int64,), device=dev)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_launchable(_tree_slots_kernel, dev)
    slots, pos = torch.empty_like(rows), torch.empty_like(rows)
    if t:
        _tree_slots_kernel[(triton.cdiv(t, BLOCK),)](seq_lens, num_tokens, block_tables, rows, nodes, depths, slots,
                                                     pos, t, block_tables.shape[1], block_size, BLOCK=BLOCK)
    return slots, pos


def tree_slots(seq_lens, num_tokens, block_tables, rows, nodes, depths, block_size: int, *,
               use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV slots and positions (T,) of a device program's tree nodes: ``tree_slots_triton`` (one launch) when
    ``use_triton`` (the Triton backend), ``tree_slots_reference`` otherwise."""
    op = tree_slots_triton if use_triton else tree_slots_reference
    return op(seq_lens, num_tokens, block_tables, rows, nodes, depths, block_size)
