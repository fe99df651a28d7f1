"""Who receives a request's outputs: the ``stream()`` call that submitted it, and no one else.

Every engine step produces outputs for whatever requests it advanced, whichever stream happened
to drive it. The router puts each output into the queue of the stream that owns the request, so
interleaved streams on one engine never see each other's requests and a request that finishes
while another stream drives the engine still reaches its own stream.
"""

from __future__ import annotations

from collections import deque

from specdec.outputs import RequestOutput
from specdec.scheduler.request import Request


class OutputQueue:
    """The requests one ``stream()`` call submitted and their outputs not yet yielded, in order.
    ``finals_only``: only finished requests' outputs are built and queued (``generate`` without a progress
    bar keeps nothing else, so the per-step outputs and their incremental detokenisation are skipped)."""

    def __init__(self, finals_only: bool = False) -> None:
        self.requests: list[Request] = []
        self.pending: deque[RequestOutput] = deque()
        self.finals_only = finals_only

    @property
    def done(self) -> bool:
        """All of this stream's requests have finished (their final outputs may still be pending)."""
        return all(r.finished for r in self.requests)


class Router:
    """Maps each live request to the queue that receives its outputs."""

    def __init__(self) -> None:
        self._owner: dict[Request, OutputQueue] = {}

    def own(self, queue: OutputQueue, req: Request) -> None:
        if req in self._owner:
            raise ValueError(f"request {req.request_id!r} already belongs to a stream")
        self._owner[req] = queue
        queue.requests.append(req)

    def wanting(self, reqs: list[Request]) -> list[Request]:
        """The requests of ``reqs`` whose output has a receiver now, in order: an owning stream that takes
        every output, or the request has finished."""
        owner = self._owner.get
        return [r for r in reqs if (q := owner(r)) is not None and (r.finished or not q.finals_only)]

    def deliver(self, req: Request, out: RequestOutput) -> None:
        """Queue ``out`` for the stream owning ``req``; a finished request leaves the router."""
        queue = self._owner.pop(req) if req.finished else self._owner[req]
        queue.pending.append(out)

    def release(self, queue: OutputQueue) -> None:
        """Forget a closed stream's requests (the caller aborted the unfinished ones)."""
        for req in queue.requests:
            if self._owner.get(req) is queue:
                del self._owner[req]
