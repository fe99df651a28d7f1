"""Executor: an asynchronous API around one SpecEngine, driven by a single background loop thread.

Callers on any thread (or in any asyncio event loop) ``enqueue`` requests, read their outputs as a
stream or await the final one, and ``cancel`` them. Every engine call happens on the loop thread;
other threads talk to it only through queues. A request that fails (bad input, a fault the engine
isolated to its row, an error while its output is built, an exception escaping an engine step it
took part in) ends with ``finish_reason == "error"``; the loop and the other requests go on.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from specdec.engine import SpecEngine
from specdec.outputs import AcceptanceStats, RequestOutput, logprob_fields, request_output
from specdec.sampling_params import SamplingParams
from specdec.scheduler.request import Request
from specdec.serving.request_streams import Channel, RequestStreams
from specdec.serving.tensor_parallel import IDLE_SECONDS

log = logging.getLogger(__name__)


@contextmanager
def frozen_startup_heap() -> Iterator[int]:
    """Collect, then move every object alive now (the models' modules, the tokenizer, the imported libraries: some
    400k objects, whose full collection took ~0.2 s on a 2-core CPU) out of the garbage collector's view for the
    block, so that a long-running server's oldest-generation collections scan only what came after and do not
    stall every stream for that long. A serving process enters it once its engine is built and serves inside it;
    yields how many objects were frozen. On leaving, they are unfrozen: a frozen object is never freed, and at
    exit triton's nanobind bindings print some 30 lines of "leaked instances" warnings for theirs."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()


class EngineStepError(RuntimeError):
    """An engine step raised; the requests running in it were ended (their KV freed)."""


@dataclass(frozen=True)
class IterationStats:
    """What one engine step did, recorded on the loop thread right after it."""

    step: int
    wall_time: float  # time.time() at the end of the step
    step_seconds: float
    batch_size: int  # requests that ran (prefill chunks + speculating rows)
    num_prefill: int
    new_tokens: int  # output tokens committed in this step
    drafted: int
    accepted: int
    kv_blocks_used: int  # allocated blocks, prefix-cache blocks included
    kv_blocks_total: int
    num_waiting: int  # queue length after the step
    num_running: int


class Load(NamedTuple):
    """The engine's load right now (updated by the loop after every step and message)."""

    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int


@dataclass
class _Live:
    """Loop-thread bookkeeping of one admitted request."""

    req: Request
    channel: Channel
    drafted: int = 0
    accepted: int = 0
    num_output: int = 0
    forwards: int = 0  # target forwards (speculating steps) seen so far


_STOP = object()


class Executor(RequestStreams):
    """``enqueue(prompt, params) -> id``; ``stream(id)`` / ``astream(id)`` / ``result(id)`` / ``aresult(id)``;
    ``cancel(id)``; ``iteration_stats()``. Use as a context manager or call ``shutdown()``.

    The first output of every request acknowledges it: no new tokens, ``finish_reason`` None (or
    "error" with the validation error in ``.error`` when the engine refused the request). Each request
    has one reader. The executor owns the engine: while it runs, reach the engine only through
    ``run_on_loop``.

    ``mirror``: on rank 0 of a tensor-parallel group, a ``serving.tensor_parallel.StepMirror``: every add, abort
    and step is sent to the other ranks before it is applied here (and a heartbeat while idle), so their engines
    follow this one; ``run_on_loop`` is refused then (what a function does to this engine would not be mirrored).
    """

    def __init__(self, engine: SpecEngine, stats_history: int = 1024, mirror=None) -> None:
        super().__init__()
        self.engine = engine
        self.mirror = mirror
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._stats: deque[IterationStats] = deque(maxlen=stats_history)
        self._listeners: list[Callable[[IterationStats], None]] = []
        self._steps = 0
        self.load = Load(0, 0, engine.allocator.num_blocks - engine.allocator.num_free, engine.allocator.num_blocks)
        if engine.target.tokenizer is not None:  # a fast tokenizer's first encode may reset its truncation
            engine.target.tokenizer.encode("a")  # and padding state (a write) that concurrent ``prepare`` calls read
        self._thread = threading.Thread(target=self._run, name="specdec-executor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side (any thread)

    def _submit(self, rid: str, prompt, params: SamplingParams | None, channel: Channel) -> None:
        self._inbox.put(("add", rid, prompt, params, channel))

    def prepare(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """``prompt``'s token ids, checked as the engine checks a request (a ValueError naming the field), on the
        calling thread: enqueue them, and a long prompt is not tokenised on the loop thread while others'
        requests wait. Several threads may call it at once."""
        return self.engine.prepare(prompt, params or SamplingParams())

    def detokenize(self, ids: list[int]) -> str:
        """``SpecEngine.detokenize`` on the calling thread (several threads may call it at once)."""
        return self.engine.detokenize(ids)

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt and output) a request may hold: the target's context."""
        return self.engine.target.config.max_position_embeddings

    def cancel(self, request_id: str) -> None:
        """End a request early (finish_reason "abort") and free its KV; a finished one is left alone."""
        self._inbox.put(("cancel", request_id))

    def run_on_loop(self, fn: Callable[[SpecEngine], Any], timeout: float | None = 60.0) -> Any:
        """Run ``fn(engine)`` on the loop thread between steps and return its result (or raise its exception,
        whatever it is: the loop goes on). ``fn`` may generate on the engine: the executor's own requests then
        advance in those steps too, and their readers get what they did."""
        box: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("call", fn, box))
        try:
            ok, value = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"run_on_loop: the function did not return within {timeout} s") from None
        if not ok:
            raise value
        return value

    def add_stats_listener(self, fn: Callable[[IterationStats], None]) -> None:
        """Call ``fn(stats)`` on the loop thread after every step (keep it quick; errors are logged)."""
        self._listeners.append(fn)

    def iteration_stats(self) -> list[IterationStats]:
        """The most recent steps' statistics, oldest first."""
        return list(self._stats)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is still running, stop the loop thread and wait for it."""
        if self._thread.is_alive():
            self._inbox.put((_STOP,))
            self._thread.join(timeout)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        with torch.inference_mode():  # thread-local: the loop thread never records autograd state
            self._loop()

    def _loop(self) -> None:
        idle = None if self.mirror is None else IDLE_SECONDS
        while True:
            busy = self.engine.scheduler.has_work
            try:
                msg = self._inbox.get_nowait() if busy else self._inbox.get(timeout=idle)
            except queue.Empty:
                if not busy:  # (a mirror's heartbeat: nothing to step)
                    self.mirror.send("idle")
                    continue
                msg = None
            if msg is not None and msg[0] is _STOP:
                self._abort_all()
                self._refuse_pending()
                if self.mirror is not None:
                    self.mirror.send("stop")
                return
            if msg is not None:
                try:
                    self._handle(msg)  # drain the inbox before the next step
                except Exception:  # noqa: BLE001 - one message must not kill the loop
                    log.exception("handling %s failed", msg[0])
            else:
                self._step()
            self._update_load()

    def _update_load(self) -> None:
        sched, alloc = self.engine.scheduler, self.engine.allocator
        self.load = Load(len(sched.waiting), len(sched.running), alloc.num_blocks - alloc.num_free, alloc.num_blocks)

    def _refuse_pending(self) -> None:
        """After shutdown: answer what is still in the inbox, so that no reader waits forever."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                err = RuntimeError("the executor was shut down")
                msg[4].put(RequestOutput(msg[1], [], [], "", "error", AcceptanceStats(), error=err))
            elif msg[0] == "call":
                msg[2].put((False, RuntimeError("the executor was shut down")))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "cancel":
            self._cancel(msg[1])
        elif kind == "call":
            fn, box = msg[1:]
            if self.mirror is not None:
                box.put((False, RuntimeError("run_on_loop is refused on a tensor-parallel server: what the function "
                                             "did would not be mirrored to the other ranks")))
                return
            try:
                box.put((True, fn(self.engine)))
            except BaseException as err:  # noqa: BLE001 - KeyboardInterrupt too: handed back to the caller, who raises it
                box.put((False, err))
            self._catch_up()

    def _catch_up(self) -> None:
        """Deliver what requests did outside this loop's steps (a ``run_on_loop`` function that generated ran
        steps for them too, perhaps to the end)."""
        for live in list(self._live.values()):
            self._deliver(live)

    def _add(self, rid: str, prompt, params, channel: Channel) -> None:
        try:
            if self.mirror is not None:
                self.mirror.send("add", prompt, params, rid)
            with self.engine.guard:
                req = self.engine.add_request(prompt, params, rid)
        except Exception as err:  # noqa: BLE001 - the request is refused (a ValueError: the caller's fault), the loop lives
            if not isinstance(err, (ValueError, TypeError)):
                log.exception("preparing request %s failed", rid)
            channel.put(RequestOutput(rid, [], [], "", "error", AcceptanceStats(), error=err))
            return
        live = self._live[rid] = _Live(req, channel)
        if not channel.put(RequestOutput(rid, list(req.prompt_ids), [], "", None, req.stats,
                                         **logprob_fields(req, 0))):
            self._end(live, "abort")

    def _cancel(self, rid: str) -> None:
        live = self._live.get(rid)
        if live is not None:
            self._end(live, "abort")

    def _end(self, live: _Live, reason: str, error: Exception | None = None) -> None:
        """Take a request out of the engine (KV freed) and send its final output."""
        req = live.req
        if not req.finished:
            self._abort(req)
        req.finish_reason = reason
        self._live.pop(req.request_id, None)
        out = RequestOutput(req.request_id, list(req.prompt_ids), list(req.output_ids), req.text, reason,
                            req.stats, error=error, **logprob_fields(req, req.num_output))
        live.channel.put(out)

    def _abort(self, req: Request) -> None:
        if self.mirror is not None:
            self.mirror.send("abort", req.request_id)
        self.engine.scheduler.abort(req)

    def _abort_all(self) -> None:
        for live in list(self._live.values()):
            self._end(live, "abort")

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.mirror is not None:
                self.mirror.send("step")
            with self.engine.guard:
                progressed = self.engine.step()
        except Exception as err:  # noqa: BLE001 - one failed step must not kill the loop
            log.exception("engine step failed")
            self._fail_running(err)
            return
        seconds = time.perf_counter() - t0
        drafted = accepted = new_tokens = prefill = 0
        lives = [live for req in progressed if (live := self._live.get(req.request_id)) is not None]
        for live in lives:
            req, s = live.req, live.req.stats
            prefill += s.target_forwards == live.forwards  # a prefill chunk runs no verify forward
            drafted += s.drafted - live.drafted
            accepted += s.accepted - live.accepted
            new_tokens += req.num_output - live.num_output
            live.drafted, live.accepted, live.num_output, live.forwards = (s.drafted, s.accepted, req.num_output,
                                                                          s.target_forwards)
        self._record(seconds, len(progressed), prefill, new_tokens, drafted, accepted)  # before readers wake
        for live in lives:
            self._deliver(live)

    def _deliver(self, live: _Live) -> None:
        req = live.req
        try:
            out = request_output(req, self.engine.stopper)
        except Exception as err:  # noqa: BLE001 - this request fails, the others go on
            log.exception("building the output of request %s failed", req.request_id)
            self._end(live, "error", err)
            return
        if not (out.new_token_ids or out.new_text or out.finished):
            return
        if req.finished:
            self._live.pop(req.request_id, None)
        if not live.channel.put(out) and not req.finished:
            self._end(live, "abort")

    def _fail_running(self, err: Exception) -> None:
        """After a failed step: end every running request with an error; waiting ones go on."""
        wrapped = EngineStepError(f"engine step failed: {type(err).__name__}: {err}")
        for req in list(self.engine.scheduler.running):
            live = self._live.get(req.request_id)
            if live is not None:
                self._end(live, "error", wrapped)
            else:
                self._abort(req)

    def _record(self, seconds: float, batch: int, prefill: int, new_tokens: int, drafted: int,
                accepted: int) -> None:
        self._steps += 1
        alloc, sched = self.engine.allocator, self.engine.scheduler
        stats = IterationStats(self._steps, time.time(), seconds, batch, prefill, new_tokens, drafted, accepted,
                               alloc.num_blocks - alloc.num_free, alloc.num_blocks, len(sched.waiting),
                               len(sched.running))
        self._stats.append(stats)
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
                log.exception("iteration stats listener failed")
