"""Argument checks shared by the kernel wrappers: every failure is a ValueError naming the argument."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - triton without the interpreter module
    InterpretedFunction = ()  # isinstance(x, ()) is always False

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Return ``t`` if it is a tensor of the given shape (None = any size), dtype and device.

    ``last_dim_contiguous`` demands stride 1 on the last dimension (other strides are free).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        sizes = zip(shape, t.shape, strict=False)
        if t.dim() != len(shape) or any(s is not None and s != g for s, g in sizes):
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {t.stride()}")
    return t


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (TRITON_INTERPRET=1 when its module loaded)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, device: torch.device) -> None:
    """Raise ValueError unless ``kernel`` can run on ``device`` (CPU needs TRITON_INTERPRET=1 at import)."""
    if device.type == "cuda":
        if isinstance(kernel, InterpretedFunction):
            raise ValueError("CUDA tensors given but the kernels were built with TRITON_INTERPRET=1")
        return
    if device.type == "cpu" and isinstance(kernel, InterpretedFunction):
        return
    raise ValueError(
        f"tensors on {device} cannot run the Triton kernels: use CUDA, or CPU with TRITON_INTERPRET=1 "
        "set before specdec.kernels modules are imported"
    )


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (what a grid must fill)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def grid_processors(device: torch.device) -> int:
    """The processors a grid is sized to fill: ``sm_count`` on CUDA, 8 elsewhere (the interpreter: grids split as
    on a small GPU, so that the split paths get tested)."""
    return sm_count(device) if device.type == "cuda" else 8


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
