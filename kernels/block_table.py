"""Per-step staging of the active rows of the host block table into a device buffer.

Choice: one Triton kernel that reads the pinned host table directly through unified virtual
addressing (page-locked memory from ``pin_memory()`` is mapped into the device address space,
so the kernel dereferences the host pointer over PCIe/C2C). Compared with "gather on the host
into a pinned staging buffer, then one non_blocking copy", this needs no host-side gather, no
second pinned buffer (and no double-buffering against a copy still in flight), and it is
captured by CUDA graphs as an ordinary kernel that reads the *current* host table on every
replay. The host must not change rows of an active batch between launch and completion (the
engine edits the table only between steps, after the previous step has synchronised).

``row_ids`` may live on the device (a static graph input) or in pinned host memory.
On CPU (TRITON_INTERPRET=1) every tensor is a CPU tensor and the kernel runs interpreted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.arg_checks import INDEX_DTYPES, check_launchable, check_tensor, next_pow2


@triton.jit
def _stage_rows_kernel(
    host_ptr, rows_ptr, out_ptr, max_blocks,
    stride_h0, stride_h1, stride_o0, stride_o1,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < max_blocks
    row = tl.load(rows_ptr + b).to(tl.int64)
    vals = tl.load(host_ptr + row * stride_h0 + cols * stride_h1, mask=ok)
    tl.store(out_ptr + b * stride_o0 + cols * stride_o1, vals, mask=ok)


def stage_block_tables_reference(
    host_table: torch.Tensor,  # (R, max_blocks) int32
    row_ids: torch.Tensor,  # (B,) int64
    out: torch.Tensor,  # (>=B, max_blocks) int32
) -> torch.Tensor:  # (B, max_blocks) view of out
    """Copy ``host_table[row_ids]`` into ``out[:B]`` and return that view."""
    b = row_ids.shape[0]
    rows = host_table.index_select(0, row_ids.to(host_table.device))  # (B, max_blocks)
    out[:b].copy_(rows)
    return out[:b]


def stage_block_tables(
    host_table: torch.Tensor,  # (R, max_blocks) int32, pinned host memory (or on out's device)
    row_ids: torch.Tensor,  # (B,) int64, on out's device or pinned
    out: torch.Tensor,  # (>=B, max_blocks) int32 on the device
) -> torch.Tensor:  # (B, max_blocks) view of out
    """Same result as ``stage_block_tables_reference``, in one kernel launch and no host sync.

    Row ids must lie in [0, R) (not checked: that would need a sync).
    """
    _check_args(host_table, row_ids, out)
    b, max_blocks = row_ids.shape[0], host_table.shape[1]
    if b == 0 or max_blocks == 0:
        return out[:b]
    block = min(1024, next_pow2(max_blocks))
    _stage_rows_kernel[(b, triton.cdiv(max_blocks, block))](
        host_table, row_ids, out, max_blocks,
        host_table.stride(0), host_table.stride(1), out.stride(0), out.stride(1),
        BLOCK=block, num_warps=1 if block <= 256 else 4,
    )
    return out[:b]


def _readable_from(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a kernel on ``device`` may dereference ``t``: same device, or pinned host memory."""
    return t.device == device or (device.type == "cuda" and t.device.type == "cpu" and t.is_pinned())


def _check_args(host_table, row_ids, out) -> None:
    check_tensor("out", out, shape=(None, None), dtypes=(torch.int32,))
    dev = out.device
    check_launchable(_stage_rows_kernel, dev)
    check_tensor("host_table", host_table, shape=(None, out.shape[1]), dtypes=(torch.int32,))
    check_tensor("row_ids", row_ids, shape=(None,), dtypes=INDEX_DTYPES)
    for name, t in (("host_table", host_table), ("row_ids", row_ids)):
        if not _readable_from(t, dev):
            raise ValueError(f"{name} must be in pinned host memory or on {dev}, got {t.device} "
                             f"(pinned={t.is_pinned() if t.device.type == 'cpu' else 'n/a'})")
    if row_ids.shape[0] > out.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, fewer than row_ids ({row_ids.shape[0]})")
