"""One engine replica in its own process: an ``Executor`` in a child started by ``torch.multiprocessing``, and
``ReplicaProcess``, its caller's side in the server's process, with the Executor's API (docs/parallel.md).

Two ``multiprocessing`` queues connect them. Parent to child: ("add", id, prompt, params), ("cancel", id),
("prepare", call, prompt, params), ("detokenize", call, ids), ("call", call, fn), ("stop",). Child to parent:
("ready", ReplicaInfo) or ("failed", traceback) once, then ("out", id, output), ("stats", IterationStats), ("reply",
call, ok, value). A request's outputs cross as deltas (no prompt, no earlier tokens) except its first and final
ones, so streaming costs the same per step however long the request is. Tokenising (``prepare``, ``detokenize``)
runs on the child's worker threads, off its engine loop and off the server's event loop.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import queue
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.multiprocessing as mp

from specdec.outputs import AcceptanceStats, RequestOutput
from specdec.sampling_params import SamplingParams
from specdec.serving.executor import Executor, IterationStats, Load, frozen_startup_heap
from specdec.serving.request_streams import Channel, RequestStreams

log = logging.getLogger(__name__)
_POLL_S = 0.5  # how often a blocked reader checks that the other side still lives


@dataclass(frozen=True)
class EngineRecipe:
    """How a replica builds its engine: ``SpecEngine(draft, target, config)`` on its own device (picklable: it
    travels to the child). ``threads``: torch CPU threads of the child (None: torch's default)."""

    draft: Any
    target: Any
    config: Any  # a SpecConfig whose device is this replica's
    threads: int | None = None

    def build(self):
        from specdec.engine import SpecEngine

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        return SpecEngine(self.draft, self.target, self.config)


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica reports about its engine."""

    device: str
    block_size: int
    num_blocks: int
    pid: int
    max_model_len: int


class ReplicaValueError(ValueError):
    """A ValueError raised in a replica that could not cross to the server as itself (its class does not
    pickle); same message, and the field it named."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return ReplicaValueError, (str(self), self.field)


def portable(err: BaseException | None) -> BaseException | None:
    """``err`` if it survives pickling, else an exception of the same kind (ValueError or RuntimeError) with its
    message (and a ValueError's ``field``)."""
    if err is None:
        return None
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any exception class whose constructor differs from its args
        if isinstance(err, ValueError):
            return ReplicaValueError(str(err), getattr(err, "field", None))
        return RuntimeError(f"{type(err).__name__}: {err}")


class ReplicaProcess(RequestStreams):
    """The Executor API (``enqueue``, ``prepare``, ``astream``/``stream``, ``cancel``, ``run_on_loop``, ``load``,
    ``add_stats_listener``, ``shutdown``) over an Executor in a child process built from ``recipe``.

    ``context``: a ``torch.multiprocessing`` start method ("spawn" by default: safe with CUDA). ``run_on_loop``'s
    function must be picklable (a module-level function). Construction returns once the child started; call
    ``wait_ready`` (or ``start_replicas``) before the first request."""

    def __init__(self, recipe: EngineRecipe, index: int = 0, context: str = "spawn") -> None:
        super().__init__(id_prefix=f"r{index}")
        self.index = index
        ctx = mp.get_context(context)
        self._to_child, self._from_child = ctx.Queue(), ctx.Queue()
        # (a replica of a tensor-parallel group starts its other ranks: a daemonic process may not have children)
        self._process = ctx.Process(target=_child_main, args=(recipe, self._to_child, self._from_child),
                                    name=f"specdec-replica-{index}",
                                    daemon=recipe.config.tensor_parallel_size == 1)
        self._process.start()
        self.info: ReplicaInfo | None = None
        self.load = Load(0, 0, 0, 0)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._listeners: list = []
        self._partial: dict[str, RequestOutput] = {}  # the latest output of each live request (deltas add to it)
        self._stopped = threading.Event()
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------ start, stop

    def wait_ready(self, timeout: float = 600.0) -> ReplicaInfo:
        """Block until the child built its engine; RuntimeError with the child's traceback if it failed."""
        first = self._get_first(timeout)
        if first[0] == "failed":
            self._process.join(5)
            raise RuntimeError(f"replica {self.index} failed to start:\n{first[1]}")
        self.info = first[1]
        self.load = Load(0, 0, 0, self.info.num_blocks)
        self._reader = threading.Thread(target=self._read, name=f"specdec-replica-{self.index}-reader", daemon=True)
        self._reader.start()
        return self.info

    def _get_first(self, timeout: float) -> tuple:
        waited = 0.0
        while True:
            try:
                return self._from_child.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
                if not self._process.is_alive():
                    return ("failed", f"the process exited with code {self._process.exitcode}")
                if waited > timeout:
                    self._process.kill()
                    return ("failed", f"no engine within {timeout} s")

    @property
    def alive(self) -> bool:
        return self.info is not None and self._process.is_alive() and not self._stopped.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what still runs in the child, stop it and wait for it (killed after ``timeout``)."""
        if self._process.is_alive():
            self._to_child.put(("stop",))
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._stopped.set()
        if self._reader is not None:
            self._reader.join(timeout)

    def __enter__(self) -> ReplicaProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ caller side (any thread)

    def _submit(self, rid: str, prompt, params: SamplingParams | None, channel: Channel) -> None:
        self._to_child.put(("add", rid, prompt, params))

    def cancel(self, request_id: str) -> None:
        self._to_child.put(("cancel", request_id))

    def prepare(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """As ``Executor.prepare``, on one of the child's worker threads (this thread waits)."""
        return self._ask("prepare", prompt, params or SamplingParams()).result()

    def detokenize(self, ids: list[int]) -> str:
        """As ``Executor.detokenize``, on one of the child's worker threads (this thread waits)."""
        return self._ask("detokenize", ids).result()

    @property
    def max_model_len(self) -> int:
        """As ``Executor.max_model_len`` (reported when the replica started)."""
        return self.info.max_model_len

    def run_on_loop(self, fn, timeout: float | None = 60.0) -> Any:
        """``fn(engine)`` on the child's loop thread between steps (``fn`` must pickle); its result or exception."""
        return self._ask("call", fn, timeout).result()

    def add_stats_listener(self, fn) -> None:
        """Call ``fn(stats)`` on this side's reader thread after every step of the child's engine."""
        self._listeners.append(fn)

    def _ask(self, kind: str, *args) -> Future:
        future: Future = Future()
        if not self.alive:
            future.set_exception(RuntimeError(f"replica {self.index} is not running"))
            return future
        call = next(self._call_ids)
        with self._lock:
            self._calls[call] = future
        self._to_child.put((kind, call, *args))
        return future

    # ------------------------------------------------------------------ reader thread

    def _read(self) -> None:
        while not self._stopped.is_set():
            try:
                msg = self._from_child.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    break
                continue
            except (EOFError, OSError):
                break
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - one bad message must not stop the replica's outputs
                log.exception("replica %d: handling %s failed", self.index, msg[0])
        self._fail_everything(RuntimeError(f"replica {self.index} stopped (exit code {self._process.exitcode})"))

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            self._deliver(msg[1], msg[2])
        elif kind == "stats":
            stats: IterationStats = msg[1]
            self.load = Load(stats.num_waiting, stats.num_running, stats.kv_blocks_used, stats.kv_blocks_total)
            for fn in self._listeners:
                fn(stats)
        elif kind == "reply":
            with self._lock:
                future = self._calls.pop(msg[1])
            if msg[2]:
                future.set_result(msg[3])
            else:
                future.set_exception(msg[3])

    def _deliver(self, rid: str, out: RequestOutput) -> None:
        """Rebuild a delta into the full output (prompt and earlier tokens) and hand it to the request's reader."""
        before = self._partial.get(rid)
        if before is not None and not out.finished:  # (the first and the final output come whole)
            out = replace(out, prompt_token_ids=before.prompt_token_ids, token_ids=before.token_ids + out.new_token_ids,
                          text=before.text + out.new_text, logprobs=None if out.logprobs is None else
                          before.logprobs + out.new_logprobs)
        if out.finished:
            self._partial.pop(rid, None)
        else:
            self._partial[rid] = out
        with self._lock:
            channel = self._channels.get(rid)
        if channel is not None:
            channel.put(out)

    def _fail_everything(self, err: Exception) -> None:
        """The child is gone: every unfinished request ends with an error, every pending call raises."""
        with self._lock:
            calls, self._calls = self._calls, {}
            live = list(self._channels.items())
        for future in calls.values():
            future.set_exception(err)
        for rid, channel in live:
            channel.put(RequestOutput(rid, [], [], "", "error", AcceptanceStats(), error=err))


# ---------------------------------------------------------------------- the child


def _child_main(recipe: EngineRecipe, inbox, outbox) -> None:
    """Build the engine, report ready (or the failure), then serve the parent's messages until "stop" or until
    the parent is gone."""
    try:
        executor = _executor(recipe)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        outbox.put(("failed", traceback.format_exc()))
        return
    engine = executor.engine
    with frozen_startup_heap():
        outbox.put(("ready", ReplicaInfo(str(engine.device), engine.config.block_size, engine.allocator.num_blocks,
                                         os.getpid(), executor.max_model_len)))
        executor.add_stats_listener(lambda s: outbox.put(("stats", s)))
        workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdec-replica-prepare")
        sent: dict[str, int] = {}  # outputs sent per live request (the first and the final go whole)
        try:
            _serve_parent(executor, inbox, outbox, workers, sent)
        finally:
            executor.shutdown()
            workers.shutdown(wait=False, cancel_futures=True)


def _executor(recipe: EngineRecipe) -> Executor:
    """The replica's Executor over ``recipe``'s engine. A recipe with ``tensor_parallel_size`` N > 1 makes the replica
    a tensor-parallel group: this process is its rank 0 (on ``config.device``, cuda:K: ranks on GPUs K .. K + N - 1)
    and starts ranks 1 .. N - 1 (``_follower_main``, daemonic: they end with it); its executor sends them every
    operation (``serving.tensor_parallel``), as a tensor-parallel server's rank 0 does."""
    size = recipe.config.tensor_parallel_size
    if size == 1:
        return Executor(recipe.build())
    from specdec.parallel import control_group, free_port
    from specdec.serving.tensor_parallel import StepMirror

    port, ctx = free_port(), mp.get_context("spawn")
    for rank in range(1, size):
        ctx.Process(target=_follower_main, args=(recipe, rank, size, port), name=f"specdec-replica-rank-{rank}",
                    daemon=True).start()
    return Executor(_rank_engine(recipe, 0, size, port), mirror=StepMirror(control_group(size)))


def _rank_engine(recipe: EngineRecipe, rank: int, size: int, port: int):
    """Join the replica's group as ``rank`` and build this rank's engine on its device."""
    from specdec.defaults import resolve_auto
    from specdec.parallel import join_local_group

    config = resolve_auto(recipe.config, recipe.draft, recipe.target)  # (an "auto" device: this rank's is named)
    device = join_local_group(rank, size, port, config.device)
    return replace(recipe, config=replace(config, device=device)).build()


def _follower_main(recipe: EngineRecipe, rank: int, size: int, port: int) -> None:
    """Rank ``rank`` of a tensor-parallel replica: its part of the engine, applying what rank 0 sends until "stop"
    (or until rank 0 is gone: the group's collective then fails)."""
    import torch.distributed as dist

    from specdec.parallel import control_group
    from specdec.serving.tensor_parallel import follow

    engine = _rank_engine(recipe, rank, size, port)
    with frozen_startup_heap():
        try:
            follow(engine, control_group(size))
        finally:
            dist.destroy_process_group()


def _serve_parent(executor: Executor, inbox, outbox, workers: ThreadPoolExecutor, sent: dict) -> None:
    parent = mp.parent_process()
    while True:
        try:
            msg = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "add":
            rid, prompt, params = msg[1:]
            executor.enqueue(prompt, params, rid, sink=partial(_send_output, outbox, sent, rid))
        elif kind == "cancel":
            executor.cancel(msg[1])
        elif kind in ("prepare", "detokenize"):
            workers.submit(_reply, outbox, msg[1], getattr(executor, kind), *msg[2:])
        elif kind == "call":
            workers.submit(_reply, outbox, msg[1], executor.run_on_loop, *msg[2:])


def _send_output(outbox, sent: dict, rid: str, out: RequestOutput) -> bool:
    """(The child's loop thread.) Send one output of request ``rid``: whole when it is the first or the final one,
    else only what is new."""
    n = sent.get(rid, 0)
    if out.finished:
        sent.pop(rid, None)
        out = replace(out, error=portable(out.error))
    else:
        sent[rid] = n + 1
        if n:
            out = replace(out, prompt_token_ids=[], token_ids=[], text="",
                          logprobs=None if out.logprobs is None else [])  # (prompt_logprobs whole: they are
            # filled by the prefill, after the first output was sent)
    outbox.put(("out", rid, out))
    return True


def _reply(outbox, call: int, fn, *args) -> None:
    try:
        outbox.put(("reply", call, True, fn(*args)))
    except Exception as err:  # noqa: BLE001 - handed back to the caller, who raises it
        outbox.put(("reply", call, False, portable(err)))


def start_replicas(recipes: list[EngineRecipe], context: str = "spawn", timeout: float = 600.0) -> list[ReplicaProcess]:
    """One ReplicaProcess per recipe (replica i builds ``recipes[i]``), started together; returns once all are
    ready, or stops them all and raises the first failure."""
    replicas = [ReplicaProcess(r, i, context) for i, r in enumerate(recipes)]
    try:
        for r in replicas:
            r.wait_ready(timeout)
    except BaseException:
        for r in replicas:
            r.shutdown()
        raise
    return replicas
