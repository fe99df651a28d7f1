"""A server over a tensor-parallel group (docs/parallel.md): requests arrive on rank 0 only, so rank 0's executor
broadcasts every change it makes to its engine, in order, and the other ranks make the same changes to theirs.

Every rank's engine is the same deterministic function of what is applied to it (specdec/parallel.py: scheduler,
allocator, prefix cache and stop checks use no clock and no randomness, and the collectives leave the same logits
on every rank), so the same adds, aborts and steps in the same order keep every rank's batches, blocks and tokens
identical. The operations, each one ``torch.distributed.broadcast_object_list`` from rank 0:
``("add", prompt, params, request_id)``, ``("abort", request_id)``, ``("step",)``, ``("idle",)`` (a heartbeat
while rank 0 waits for requests, so that the others' waiting collective does not reach the group's timeout) and
``("stop",)``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

IDLE_SECONDS = 10.0  # how long rank 0 waits for a request before it tells the other ranks it is idle


class StepMirror:
    """Rank 0's side: ``send`` broadcasts one operation to the other ranks of ``group`` (None: the default group),
    which apply it in ``follow``."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.sent = 0

    def send(self, *op) -> None:
        dist.broadcast_object_list([op], src=0, group=self.group)
        self.sent += 1


def follow(engine, group=None) -> int:
    """A rank other than 0: apply rank 0's operations to ``engine`` until ``("stop",)``; returns how many came.
    An add that fails, or a step that raises, failed the same way on rank 0 (the same inputs), which then aborts
    what it aborts; those aborts come here next."""
    live: dict[str, object] = {}  # request id -> this rank's Request
    received = 0
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            op, received = box[0], received + 1
            kind = op[0]
            if kind == "stop":
                return received
            if kind == "add":
                _, prompt, params, rid = op
                try:
                    live[rid] = engine.add_request(prompt, params, rid)
                except Exception:  # noqa: BLE001 - refused on rank 0 as well
                    log.debug("request %s refused", rid)
            elif kind == "abort":
                req = live.pop(op[1], None)
                if req is not None and not req.finished:
                    engine.scheduler.abort(req)
            elif kind == "step":
                try:
                    engine.step()
                except Exception:  # noqa: BLE001 - rank 0's step failed too: its aborts follow
                    log.exception("engine step failed")
                for rid in [rid for rid, req in live.items() if req.finished]:
                    del live[rid]
