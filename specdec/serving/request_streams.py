"""The caller's side of an engine that runs elsewhere (a loop thread, another process): request ids, one output
channel per request, streaming and awaiting outputs, cancelling. ``Executor`` (one engine on a loop thread) and
``ReplicaProcess`` (an Executor in a child process) share it; they only say how a request and a cancellation
reach their engine."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from specdec.outputs import RequestOutput
from specdec.sampling_params import SamplingParams


class UnknownRequest(KeyError):
    """No live or unread request has this id."""


class Channel:
    """Carries one request's outputs from the engine's side to its consumer.

    Bound to the asyncio loop that was running when the request was enqueued, if any; then the consumer awaits,
    otherwise it blocks on a thread-safe queue. With ``sink`` there is no consumer here: every output goes to
    ``sink(out)`` (which returns False once nobody wants more), e.g. to another process.
    """

    def __init__(self, sink: Callable[[RequestOutput], bool] | None = None) -> None:
        self.sink = sink
        try:
            self.loop: asyncio.AbstractEventLoop | None = None if sink else asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.items: asyncio.Queue | queue.SimpleQueue = asyncio.Queue() if self.loop else queue.SimpleQueue()

    def put(self, out: RequestOutput) -> bool:
        """Deliver ``out``; False when its consumer is gone (the request should end)."""
        if self.sink is not None:
            return self.sink(out)
        if self.loop is None:
            self.items.put(out)
            return True
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, out)
        except RuntimeError:  # the loop was closed
            return False
        return True


class OutputReaders:
    """``result`` and ``aresult`` over a class's ``stream`` and ``astream``."""

    def result(self, request_id: str, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; its final output (full text and token ids)."""
        for out in self.stream(request_id, timeout):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id!r} ended without a final output")

    async def aresult(self, request_id: str) -> RequestOutput:
        async for out in self.astream(request_id):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id!r} ended without a final output")


class RequestStreams(OutputReaders):
    """``enqueue(prompt, params) -> id``; ``stream(id)`` / ``astream(id)`` / ``result(id)`` / ``aresult(id)``;
    ``cancel(id)``. The first output of every request acknowledges it (no new tokens, ``finish_reason`` None, or
    "error" with the refusal in ``.error``); each request has one reader, and a reader that stops early cancels
    its request.

    A subclass delivers outputs with ``Channel.put`` and implements ``_submit`` (hand a request to the engine),
    ``cancel`` and ``alive``."""

    def __init__(self, id_prefix: str = "req") -> None:
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._id_prefix = id_prefix

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, rid: str, prompt, params: SamplingParams | None, channel: Channel) -> None:
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """End a request early (finish_reason "abort") and free its KV; a finished one is left alone."""
        raise NotImplementedError

    def enqueue(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                sink: Callable[[RequestOutput], bool] | None = None) -> str:
        """Queue one request and return its id. Its outputs go to the calling thread, or to the calling coroutine's
        event loop when called from one, or with ``sink`` to ``sink(out)`` (then there is no reader here: the id is
        not registered, so the caller keeps ids unique). A text or chat prompt is tokenised by the engine's side:
        pass ``prepare``'s token ids to keep that off its loop."""
        if not self.alive:
            raise RuntimeError("the executor was shut down; create a new one")
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        channel = Channel(sink)
        if sink is None:
            with self._lock:
                if rid in self._channels:
                    raise ValueError(f"request_id {rid!r} is already in use")
                self._channels[rid] = channel
        self._submit(rid, prompt, params, channel)
        return rid

    def enqueue_samples(self, prompt, params: list[SamplingParams]) -> list[str]:
        """One request per sample of ``prompt`` (``params[i]``: sample i's), queued together; their ids."""
        return [self.enqueue(prompt, p) for p in params]

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Outputs of a request enqueued from a thread, up to and including the final one."""
        channel = self._channel(request_id, asyncio_bound=False)
        try:
            while True:
                try:
                    out = channel.items.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(f"no output for request {request_id!r} within {timeout} s") from None
                yield out
                if out.finished:
                    return
        finally:  # a reader that stops early cancels its request
            self._close(request_id)

    async def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request enqueued from a coroutine, up to and including the final one."""
        channel = self._channel(request_id, asyncio_bound=True)
        try:
            while True:
                out = await channel.items.get()
                yield out
                if out.finished:
                    return
        finally:  # a reader that stops early (or is cancelled) cancels its request
            self._close(request_id)

    def _channel(self, request_id: str, asyncio_bound: bool) -> Channel:
        with self._lock:
            channel = self._channels.get(request_id)
        if channel is None:
            raise UnknownRequest(request_id)
        if (channel.loop is not None) != asyncio_bound:
            where = "a coroutine (use astream/aresult)" if channel.loop else "a thread (use stream/result)"
            raise RuntimeError(f"request {request_id!r} was enqueued from {where}")
        return channel

    def _close(self, request_id: str) -> None:
        """The reader is done with a request: forget its channel and cancel it (no-op once finished)."""
        with self._lock:
            self._channels.pop(request_id, None)
        self.cancel(request_id)
