"""Caches of read-only device tensors that CUDA graphs may read.

A captured graph replays the addresses its kernels read, and it does not keep the tensors behind them alive. A
tensor from a plain ``functools.lru_cache`` that a graph read is freed when the cache evicts it; the allocator
then hands its memory to other tensors and every later replay reads their bytes. (At batch 64 several engines
in one process made more tree shapes than such a cache held; captured steps then read tree depths and masks
from freed memory and faulted.) ``graph_constant`` keeps every entry that was returned while a
stream was being captured for as long as the process lives; the rest are evicted as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def graph_constant(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache(maxsize)`` for functions of hashable arguments returning read-only tensors, whose
    entries returned during a stream capture are never evicted (``held`` lists them)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        held: dict[tuple, T] = {}

        @functools.wraps(fn)
        def get(*args):
            if args in held:
                return held[args]
            value = cached(*args)
            if capturing():
                held[args] = value
            return value

        get.held = held
        get.cache_info = cached.cache_info
        get.cache_clear = cached.cache_clear  # (the held entries stay: a graph may still read them)
        return get

    return wrap
