"""How many bytes of GPU memory an engine's KV pool gets: ``gpu_memory_utilization`` as vLLM users know it.

The fraction is of the GPU's total memory (not of what is free now, so a second engine in the process is
sized like the first), and covers the engine's weights and its KV pool together. The pool never takes more
than ``FREE_SHARE`` of what is actually available (free memory plus torch's cached but unused blocks), so
activations, graphs and other engines still fit.
"""

from __future__ import annotations

import torch

from specdec.errors import FieldError

FREE_SHARE = 0.9


def weight_bytes(models) -> int:
    """Bytes of the distinct parameters and buffers of ``models`` (tensors shared between them counted once)."""
    seen, total = set(), 0
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def kv_budget(utilization: float, total: int, available: int, weights: int) -> int:
    """``utilization * total - weights``, at most ``FREE_SHARE * available``; FieldError naming
    gpu_memory_utilization when that leaves nothing for the KV pool."""
    budget = min(int(utilization * total) - weights, int(FREE_SHARE * available))
    if budget <= 0:
        gib = 2**30
        raise FieldError("SpecConfig", "gpu_memory_utilization",
                         f"leaves no GPU memory for the KV pool ({utilization} x {total / gib:.1f} GiB total, "
                         f"{weights / gib:.2f} GiB of weights, {available / gib:.1f} GiB available): raise it, or "
                         "set num_blocks / kv_memory_bytes", utilization)
    return budget


def gpu_kv_budget(utilization: float, device: torch.device, models) -> int:
    """The KV pool's bytes on CUDA ``device`` for an engine running ``models`` (:func:`kv_budget`)."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return kv_budget(utilization, total, free + cached, weight_bytes(models))
