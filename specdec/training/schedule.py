"""What both draft trainers (layer drafts and eagle drafts) share: the config checks (counts, warm-up
default, optimiser fields), the learning-rate schedule and the periodic loss report."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The run-control options both training configs share (keyword-only: each config's own fields come first);
    ``check_optimizer_fields`` validates them with the rest of the optimiser's."""

    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    stop_after: int | None = None
    seed: int = 0
    resume: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    save_dtype: str = "bfloat16"

    @property
    def autocast(self) -> bool:
        """bf16 autocast for the training forwards: on CUDA unless ``dtype`` is float32."""
        return self.device.startswith("cuda") and self.dtype != "float32"


def check_counts(cfg, require: Callable[[bool, str, str, object], None], names: tuple[str, ...]) -> None:
    """Check that the int fields ``names`` of a training config are >= 1, then default ``warmup_steps``
    (None) to a tenth of ``steps``, at most 100."""
    for name in names:
        value = getattr(cfg, name)
        require(isinstance(value, int) and value >= 1, name, "an int >= 1", value)
    if cfg.warmup_steps is None:
        object.__setattr__(cfg, "warmup_steps", min(100, cfg.steps // 10))


def check_optimizer_fields(cfg, require: Callable[[bool, str, str, object], None]) -> None:
    """Check lr, warmup_steps, min_lr_ratio, weight_decay, grad_clip, stop_after, seed and device of a
    training config; ``require(ok, name, rule, value)`` raises the config's own error."""
    require(cfg.lr > 0, "lr", "a number > 0", cfg.lr)
    require(0 <= cfg.warmup_steps <= cfg.steps, "warmup_steps", f"in [0, steps={cfg.steps}]", cfg.warmup_steps)
    require(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]", cfg.min_lr_ratio)
    require(cfg.weight_decay >= 0, "weight_decay", "a number >= 0", cfg.weight_decay)
    require(cfg.grad_clip >= 0, "grad_clip", "a number >= 0 (0 = off)", cfg.grad_clip)
    require(cfg.stop_after is None or 1 <= cfg.stop_after <= cfg.steps, "stop_after",
            f"None or in [1, steps={cfg.steps}]", cfg.stop_after)
    require(isinstance(cfg.seed, int) and cfg.seed >= 0, "seed", "an int >= 0", cfg.seed)
    require(cfg.device.split(":")[0] in ("cpu", "cuda"), "device", "cpu, cuda or cuda:N", cfg.device)


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
