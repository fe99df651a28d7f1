"""Fault isolation: a failure while computing a batch fails only the requests that caused it.

A batched forward that raises does not say which row was at fault, so the batch is retried
row by row from a snapshot of the rows' mutable state; rows that fail alone are failed, the
others keep the results of their solo run. A ``RequestFault`` names its requests, which are
failed at once, and the rest is retried as one batch. See docs/design.md, "Fault isolation".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdec.errors import RequestFault
from specdec.scheduler.request import Request

log = logging.getLogger(__name__)


class Snapshot:
    """What a draft/verify/prefill attempt may change in a request, so a retry starts identically:
    the computed counts and the token count (a sampled row's noise depends on its key and positions only)."""

    def __init__(self, reqs: Sequence[Request]) -> None:
        # per request: (num_computed, num_computed_draft, len(tokens))
        self._states = {r: (r.num_computed, r.num_computed_draft, len(r.tokens)) for r in reqs}

    def restore(self, req: Request) -> None:
        num_computed, num_computed_draft, num_tokens = self._states[req]
        req.num_computed, req.num_computed_draft = num_computed, num_computed_draft
        del req.tokens[num_tokens:]


def run_isolated(items: list, req_of: Callable[[Any], Request], call: Callable[[list], list],
                 fail: Callable[[Request, Exception], None]) -> tuple[list, list]:
    """``call(items)`` returns one result per item; returns (items that succeeded, their results).

    When ``call`` raises, every item's request is restored to its state before the call and the
    work is retried without the culprit; ``fail(req, err)`` is called once for each culprit.
    """
    snap = Snapshot([req_of(it) for it in items])
    try:
        return items, call(items)
    except Exception as err:  # noqa: BLE001 - whatever one request triggers must not stop the others
        for it in items:
            snap.restore(req_of(it))
        named = set(err.request_ids) if isinstance(err, RequestFault) else set()
        culprits = [it for it in items if req_of(it).request_id in named]
        if not culprits and len(items) > 1:  # (a fault no request is named for: a bug, or one row's bad input)
            log.warning("a batch of %d requests raised %s: %s; retrying them one by one", len(items),
                        type(err).__name__, err, exc_info=err)
        if culprits:
            for it in culprits:
                fail(req_of(it), err)
            return run_isolated([it for it in items if it not in culprits], req_of, call, fail)
        if len(items) == 1:
            fail(req_of(items[0]), err)
            return [], []
    done, results = [], []
    for it in items:
        ok, res = run_isolated([it], req_of, call, fail)
        done += ok
        results += res
    return done, results


def check_finite(rows: Sequence[Request], logits: Sequence[torch.Tensor | None], what: str) -> None:
    """Raise ``RequestFault`` naming the rows whose logits contain NaN or infinity (one host sync)."""
    pairs = [(req, lg) for req, lg in zip(rows, logits) if lg is not None]
    if not pairs:
        return
    finite = torch.stack([torch.isfinite(lg).all() for _, lg in pairs]).tolist()
    bad = [req.request_id for (req, _), ok in zip(pairs, finite) if not ok]
    if bad:
        raise RequestFault(bad, f"{what} logits are not finite (NaN or infinity) for request(s) {bad}")


def check_finite_flags(rows: Sequence[Request], finite: Sequence[int], what: str) -> None:
    """``check_finite`` for flags already computed on the device (1 = the row's logits are finite; for a sampled
    row also the distribution they give at its temperature: ``flag_overflow``)."""
    bad = [req for req, ok in zip(rows, finite) if not ok]
    if not bad:
        return
    ids, sampled = [r.request_id for r in bad], [r.request_id for r in bad if not r.params.greedy]
    also = f"; for the sampled request(s) {sampled}, or the sampling distribution they give at the request's " \
           "temperature is not finite (the logits divided by it overflow)" if sampled else ""
    raise RequestFault(ids, f"{what} logits are not finite (NaN or infinity) for request(s) {ids}{also}")


def flag_overflow(outcome: torch.Tensor, logits, rows: Sequence[Request], sampled: Sequence[int],
                  lengths: Sequence[int]) -> torch.Tensor:
    """``outcome`` (B, Q + 3) of a padded step whose last column flags finite rows, with the flag cleared for the
    ``sampled`` rows whose logits (the step's (B * Q, V) output, or one (n, V) tensor per row) divided by their
    temperature overflow over their ``lengths`` real queries: their sampling distribution is not finite. On the
    device, without a sync (the step's one read carries it)."""
    b, q = outcome.shape[0], outcome.shape[1] - 3
    dev = outcome.device
    full = getattr(logits, "logits", None)
    at = torch.tensor(list(sampled), dtype=torch.int64).to(dev)
    if isinstance(full, torch.Tensor):
        x = full.view(b, q, full.shape[-1])[at]  # (S, Q, V)
    else:
        x = torch.stack([torch.nn.functional.pad(logits[i], (0, 0, 0, q - logits[i].shape[0])) for i in sampled])
    # (a greedy row, penalized, divides by 1: its argmax needs finite logits only)
    host = torch.tensor([[lengths[i], rows[i].params.temperature or 1.0] for i in sampled],
                        dtype=torch.float32).to(dev)
    real = torch.arange(q, device=dev) < host[:, :1]  # (S, Q)
    peak = torch.where(real, x.float().abs().amax(-1), 0.0).amax(-1)  # (S,) the largest |logit| of each row
    out = outcome.clone()
    out[at, -1] *= torch.isfinite(peak / host[:, 1]).to(out.dtype)  # (x / t as the rule computes it, float32)
    return out


def check_distribution(req: Request, probs: torch.Tensor, what: str) -> None:
    """Raise ``RequestFault`` naming ``req`` when its sampling distribution ``probs`` holds NaN or infinity
    (finite logits divided by a small temperature can overflow), so that the row fails instead of sampling."""
    if not bool(torch.isfinite(probs).all()):
        raise distribution_fault([req], what)


def distribution_fault(reqs: Sequence[Request], what: str) -> RequestFault:
    """The ``RequestFault`` of sampled requests whose ``what`` ("target", "draft") distribution is not finite."""
    ids = [r.request_id for r in reqs]
    temps = sorted({r.params.temperature for r in reqs})
    return RequestFault(ids, f"the {what} sampling distribution of request(s) {ids} is not finite (NaN or infinity) "
                             f"at temperature {', '.join(map(str, temps))}: the logits divided by it overflow")
