"""What both draft trainers (layer drafts and eagle drafts) share besides their options (``training.configs``):
the learning-rate schedule and the periodic loss report."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of ``step``: linear warm-up over ``warmup_steps``, then cosine decay to
    ``min_lr_ratio * lr`` at ``total_steps`` (held there after it)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    frac = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def report_losses(losses: list[float], pending: list[torch.Tensor], bar, label: str, last: int) -> None:
    """Move the pending per-step losses to ``losses`` (one device read), advance the progress bar and show
    the mean of the last ``last`` losses as ``label``; empties ``pending``."""
    losses += torch.stack(pending).float().cpu().tolist()
    bar.update(len(pending))
    bar.set_postfix({label: f"{sum(losses[-last:]) / len(losses[-last:]):.4f}"})
    pending.clear()
