"""Whether a bench measurement was disturbed (a busy machine, threads fighting each other): the same short
target-only probe is timed before and after a batch size's measured runs, and the two must agree within
``DISTURBED_SPREAD``; otherwise the speedups of that batch size are not to be trusted."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

DISTURBED_SPREAD = 0.25  # the slower probe may take at most 25% longer than the faster one
PROBE_TOKENS = 8


def time_probe(engine, group, params) -> float:
    """Seconds of one short ``engine.generate(group)`` (``PROBE_TOKENS`` new tokens, same sampling)."""
    short = replace(params, max_new_tokens=min(PROBE_TOKENS, params.max_new_tokens))
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    engine.generate(group, short)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    engine.forget_drafts()
    return time.perf_counter() - start


def disturbance_note(batch_size: int, before: float, after: float, spread: float = DISTURBED_SPREAD) -> str | None:
    """A warning when the probes ``before`` and ``after`` (seconds) differ by more than ``spread``, else None."""
    fast, slow = sorted((before, after))
    if slow <= fast * (1 + spread):
        return None
    return (f"warning: batch size {batch_size}: the measurement was disturbed (the same target-only probe took "
            f"{before * 1e3:.0f} ms before and {after * 1e3:.0f} ms after, more than {spread:.0%} apart); its "
            "speedups are not reliable (a busy machine? on the CPU try --threads 1)")
