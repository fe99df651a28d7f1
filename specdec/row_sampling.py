"""Per-row sampling parameters of a padded batch as device tensors, and the target distribution they shape.

``RowSampling`` carries ``SamplingParams`` semantics row by row (``sampling_rows`` builds it in one host->device
copy); ``shape_probs_rows`` is ``acceptance.shape_probs`` with those per-row parameters, one op over the whole
batch, as the sampled rule (``sampled_rule.accept_sampled``) computes its kept sets inside a captured step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specdec.kernels.nucleus import filtered_probs


class RowSampling(NamedTuple):
    """Per-row sampling parameters as tensors on the device (``SamplingParams`` semantics)."""

    temperature: Tensor  # (B,) float; 0 = greedy
    top_k: Tensor  # (B,) int64; 0 = off
    top_p: Tensor  # (B,) float in (0, 1]; 1 = off
    filtered: bool = True  # host flag: False promises no row uses top-k/top-p/min-p (skips the sort)
    any_greedy: bool = True  # host flag: False promises no row has temperature 0 (skips the greedy rule)
    min_p: Tensor | None = None  # (B,) float in [0, 1]; 0 = off; None: 0 for every row


def sampling_rows(params: Sequence, device: torch.device | str) -> RowSampling:
    """``RowSampling`` of SamplingParams-like objects (temperature, top_k, top_p, min_p if they have it): one
    host->device copy."""
    host = torch.tensor([[p.temperature, p.top_k, p.top_p, getattr(p, "min_p", 0.0)] for p in params],
                        dtype=torch.float64).reshape(-1, 4)
    dev = host.to(device)  # (B, 4)
    filtered = any((p.top_k or 0) > 0 or p.top_p < 1.0 or getattr(p, "min_p", 0.0) > 0 for p in params)
    return RowSampling(dev[:, 0], dev[:, 1].long(), dev[:, 2], filtered, any(p.temperature == 0 for p in params),
                       dev[:, 3])


def shape_probs_rows(logits: Tensor, sampling: RowSampling, use_triton: bool = False) -> Tensor:
    """``shape_probs`` with per-row parameters: (B, ..., V) logits -> (B, ..., V) probabilities (float32 or
    wider), row b shaped with temperature[b], top_k[b], top_p[b], min_p[b]; the same values ``shape_probs`` gives.

    Inside the captured rule each op here is a kernel over (B, Q, V), so the host flags skip what no row needs
    (the filter without top-k/top-p/min-p, the one-hot without greedy rows), and per-row choices are folded into
    (B,) factors where that gives the same bits (dividing by 1, comparing with +inf). ``use_triton``: the filter
    is ``kernels.nucleus``' kernel (no sort), else its sort-based reference."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (B, ..., V)
    view = (-1,) + (1,) * (x.dim() - 1)  # per-row parameter -> broadcast over (..., V)
    t = sampling.temperature.to(x.dtype).view(view)
    greedy = t == 0 if sampling.any_greedy else None
    if greedy is not None:
        t = torch.where(greedy, torch.ones_like(t), t)
    probs = torch.softmax(x / t, dim=-1)  # (B, ..., V)
    if sampling.filtered:
        probs = filtered_probs(x, t, probs, sampling, use_triton=use_triton)
    if greedy is None:
        return probs
    top = torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)  # one-hot argmax (first maximum)
    return torch.where(greedy, top, probs)
