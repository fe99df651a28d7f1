"""Where greedy speculative and target-only outputs part, and whether float rounding explains it.

Two greedy runs of the same model part at the first position where their tokens differ.  In
bfloat16 that happens legitimately when the target's two best tokens are nearly tied: a 1-token
decode forward and a (K+1)-token verify forward add the same numbers in different orders, so
their bf16 logits differ by a few rounding errors and can order a near-tie differently.

:func:`classify_divergences` recomputes the target's logits for the shared prefix in float32 and
calls a divergence a ``numerical_tie`` when the two tokens' float32 logits are within
:func:`tie_bound` of each other and of the best float32 logit, else a ``mismatch``.  A run made
in float32 has no bf16 rounding to blame: every divergence there is a ``mismatch``.  The bound is
derived in docs/divergence.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NUMERICAL_TIE = "numerical_tie"
MISMATCH = "mismatch"
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TIE_SIGMAS = 4.0  # how many standard deviations of accumulated rounding the bound allows


@dataclass(frozen=True)
class Divergence:
    """The first position where two token sequences differ, and the two tokens there (None = ended)."""

    position: int
    spec_token: int | None
    target_token: int | None


def first_divergence(spec: Sequence[int], target: Sequence[int]) -> Divergence | None:
    """The first index where ``spec`` and ``target`` differ (one ending early counts), else None."""
    for i, (a, b) in enumerate(zip(spec, target)):
        if a != b:
            return Divergence(i, int(a), int(b))
    if len(spec) == len(target):
        return None
    n = min(len(spec), len(target))
    at = lambda seq: int(seq[n]) if n < len(seq) else None
    return Divergence(n, at(spec), at(target))


def tie_bound(logit_scale: float, hidden_norm: float, weight_norm: float, hidden_size: int,
              num_layers: int, dtype: str) -> float:
    """Largest float32 logit gap that rounding in two ``dtype`` forwards of one model can flip.

    Each forward's logit is off from float32 by at most ``E = u*|z| + s*u*sqrt(2L)*|h|*|w|/sqrt(d)``
    (output rounding, plus ``s`` standard deviations of the rounding accumulated over the 2L
    residual additions, seen through one LM-head row); two forwards ordering the pair differently
    means the float32 gap is at most ``2E``.  ``dtype="float32"`` returns 0.0 (no tie is allowed).
    """
    if dtype == "float32":
        return 0.0
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if hidden_size < 1 or num_layers < 1:
        raise ValueError(f"hidden_size and num_layers must be >= 1, got {hidden_size}, {num_layers}")
    u = UNIT_ROUNDOFF[dtype]
    accumulated = TIE_SIGMAS * u * math.sqrt(2 * num_layers) * hidden_norm * weight_norm / math.sqrt(hidden_size)
    return 2.0 * (u * abs(logit_scale) + accumulated)


def float32_reference(loaded) -> torch.nn.Module:
    """A float32 transformers copy of ``loaded`` (its weights, as stored, upcast) on the same device."""
    from specdec.benchmark.hf import to_hf_model

    return to_hf_model(loaded).float().requires_grad_(False)


@torch.inference_mode()
def _final_hidden(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The float32 final-norm hidden state (d,) after the prefix ``ids``."""
    device = ref.lm_head.weight.device
    x = torch.tensor([ids], device=device)  # (1, T)
    return ref.model(input_ids=x).last_hidden_state[0, -1].float()  # (d,)


@torch.inference_mode()
def classify_one(ref: torch.nn.Module, prefix: list[int], div: Divergence, dtype: str,
                 num_layers: int) -> dict:
    """Classify one divergence with the float32 model ``ref`` on ``prefix`` (prompt + shared output).

    Returns ``{position, spec_token, target_token, fp32_top_token, logit_gap, top_gap, bound,
    class}``; ``logit_gap`` is |z_spec - z_target|, ``top_gap`` the best float32 logit minus the
    larger of the two.  A sequence that ended (token None) or a float32 run is always a mismatch.
    """
    out = {"position": div.position, "spec_token": div.spec_token, "target_token": div.target_token,
           "fp32_top_token": None, "logit_gap": None, "top_gap": None, "bound": 0.0, "class": MISMATCH}
    h = _final_hidden(ref, prefix)  # (d,)
    w = ref.lm_head.weight.float()  # (V, d)
    logits = w @ h  # (V,)
    out["fp32_top_token"] = int(logits.argmax())
    if div.spec_token is None or div.target_token is None:
        return out
    pair = [div.spec_token, div.target_token]
    za, zb = (float(logits[t]) for t in pair)
    top = float(logits.max())
    bound = tie_bound(max(abs(za), abs(zb)), float(h.norm()), float(w[pair].norm(dim=1).max()),
                      h.numel(), num_layers, dtype)
    out.update(logit_gap=abs(za - zb), top_gap=top - max(za, zb), bound=bound)
    if bound > 0 and abs(za - zb) <= bound and top - max(za, zb) <= bound:
        out["class"] = NUMERICAL_TIE
    return out


def classify_divergences(records: list[dict], prompt_ids: list[list[int]], reference, dtype: str,
                         num_layers: int) -> list[dict]:
    """Add ``record["divergence"]`` to each greedy record: None if identical, else :func:`classify_one`.

    ``reference`` is the float32 model or a zero-argument callable making it (built only when some
    record diverges).  Sampled records get ``divergence = None`` and are not checked.
    """
    for rec, ids in zip(records, prompt_ids, strict=True):
        rec["divergence"] = None
        if not rec["greedy"]:
            continue
        spec, target = rec["spec"]["token_ids"], rec["target_only"]["token_ids"]
        div = first_divergence(spec, target)
        if div is None:
            continue
        if callable(reference) and not isinstance(reference, torch.nn.Module):
            reference = reference()
        rec["divergence"] = classify_one(reference, list(ids) + list(spec[:div.position]), div, dtype, num_layers)
    return records
