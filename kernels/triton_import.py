"""``triton`` and ``triton.language`` for the kernel modules, or stand-ins where Triton is not installed.

Triton is a dependency on Linux only. The models and drafters import the op functions that live beside their
kernels, so a kernel module must import without Triton: the stand-ins let ``@triton.jit`` definitions and
``tl.constexpr`` annotations evaluate, and the engine then runs the torch backend, whose ops call the torch
references (``use_triton`` False), so no stand-in kernel is ever launched.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:
    AVAILABLE = False

    class _Missing:
        """Any attribute is another stand-in; ``jit`` returns the function it decorates; calling one raises."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, name: str) -> _Missing:
            return _Missing(f"{self._name}.{name}")

        def __call__(self, *args, **kwargs):
            raise ImportError(f"{self._name} needs Triton, which is not installed (pip install triton, Linux)")

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = _Missing("triton")
    tl = _Missing("triton.language")
    tl.constexpr = lambda value=None: value  # module-level constants: tl.constexpr(-(1 << 63))

__all__ = ["AVAILABLE", "tl", "triton"]
