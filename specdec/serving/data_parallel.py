"""Data-parallel replicas behind one server: ``DataParallelExecutor`` has the Executor's API over M replicas
(``ReplicaProcess``es on their own devices, or in-process Executors) and routes each request with ``Router``:
to the replica with the least outstanding work, unless the replica that last served the same first prompt block
(whose prefix cache holds it) is not much busier (docs/parallel.md)."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from specdec.outputs import RequestOutput
from specdec.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from specdec.serving.executor import IterationStats, Load
from specdec.serving.request_streams import OutputReaders, UnknownRequest


@dataclass
class _Ticket:
    """One routed request's share of its replica's outstanding work."""

    replica: int
    prompt_tokens: int
    max_tokens: int
    remaining: int  # tokens still to prefill or generate (an upper bound: it may stop early)
    done: bool = False


class Router:
    """Chooses a replica per request and tracks each replica's outstanding work: requests, and tokens still to
    prefill or generate (prompt + max_tokens at admission, less what has come out since). Thread-safe.

    Affinity: the first ``block_size`` prompt tokens (the first block the prefix cache can hold) map to the
    replica that last took such a prompt (``affinity_entries`` most recent kept). That replica is kept while its
    outstanding tokens exceed the least loaded replica's by at most max(``affinity_slack``, the prompt's
    length): a prefix hit saves at most the prompt's prefill, so past that balancing wins."""

    def __init__(self, num_replicas: int, block_size: int, affinity_slack: int = 256,
                 affinity_entries: int = 4096) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"num_replicas and block_size must be >= 1, got {num_replicas} and {block_size}")
        self.block_size, self.affinity_slack, self.affinity_entries = block_size, affinity_slack, affinity_entries
        self.tokens = [0] * num_replicas
        self.requests = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica so far
        self._homes: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._lock = threading.Lock()

    def route(self, prompt_ids: list[int] | None, max_tokens: int | None, alive: list[bool],
              beside: _Ticket | None = None) -> _Ticket:
        """Pick a replica among the ``alive`` ones for a prompt (token ids; None: text, routed by load only) and
        count the request against it; with ``beside``, that ticket's replica (another sample of the prompt).
        ``max_tokens`` None (generate until a stop or the context's end, which only the replica knows) counts
        as the default reply length, ``DEFAULT_MAX_NEW_TOKENS``, until outputs come back."""
        max_tokens = DEFAULT_MAX_NEW_TOKENS if max_tokens is None else max_tokens
        candidates = [i for i, ok in enumerate(alive) if ok]
        if not candidates:
            raise RuntimeError("no replica is running")
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else 0
        key = tuple(prompt_ids[:self.block_size]) if prompt_tokens >= self.block_size else None
        with self._lock:
            least = min(candidates, key=lambda i: (self.tokens[i], self.requests[i], self.routed[i], i))
            home = self._homes.get(key) if key is not None else None
            slack = max(self.affinity_slack, prompt_tokens)
            pick = home if home in candidates and self.tokens[home] - self.tokens[least] <= slack else least
            pick = beside.replica if beside is not None and beside.replica in candidates else pick
            if key is not None:
                self._homes[key] = pick
                self._homes.move_to_end(key)
                while len(self._homes) > self.affinity_entries:
                    self._homes.popitem(last=False)
            ticket = _Ticket(pick, prompt_tokens, max_tokens, prompt_tokens + max_tokens)
            self.tokens[pick] += ticket.remaining
            self.requests[pick] += 1
            self.routed[pick] += 1
        return ticket

    def progress(self, ticket: _Ticket, out: RequestOutput) -> None:
        """Count what ``out`` (an output of the ticket's request) did; its final output ends the ticket."""
        if out.finished:
            self.finish(ticket)
            return
        generated = len(out.token_ids)
        remaining = max(0, ticket.max_tokens - generated) + (0 if generated else ticket.prompt_tokens)
        with self._lock:
            if not ticket.done:
                self.tokens[ticket.replica] += remaining - ticket.remaining
                ticket.remaining = remaining

    def finish(self, ticket: _Ticket) -> None:
        with self._lock:
            if not ticket.done:
                ticket.done = True
                self.tokens[ticket.replica] -= ticket.remaining
                self.requests[ticket.replica] -= 1


class DataParallelExecutor(OutputReaders):
    """The Executor's API (``prepare``, ``enqueue``, ``astream``/``stream``, ``result``/``aresult``, ``cancel``,
    ``load``, ``add_stats_listener``, ``iteration_stats``, ``alive``, ``shutdown``) over ``replicas``, each an
    Executor-like with the same API whose engine has KV blocks of ``block_size`` tokens. Owns the replicas: its
    ``shutdown`` stops them. ``run_on_replicas(fn)`` runs ``fn(engine)`` on every replica's loop."""

    def __init__(self, replicas: list, block_size: int, affinity_slack: int = 256) -> None:
        if not replicas:
            raise ValueError("DataParallelExecutor needs at least one replica")
        self.replicas = list(replicas)
        self.router = Router(len(replicas), block_size, affinity_slack)
        self._tickets: dict[str, _Ticket] = {}
        self._lock = threading.Lock()
        self._prepare_turn = itertools.count()

    # ------------------------------------------------------------------ requests

    def prepare(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids, checked by one running replica (in turn: tokenising spreads over them)."""
        return self._tokenizing_replica().prepare(prompt, params)

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids, decoded by one running replica (in turn, as ``prepare``)."""
        return self._tokenizing_replica().detokenize(ids)

    def _tokenizing_replica(self):
        """The next running replica in turn (any, when none runs: its call then fails as a stopped one does)."""
        alive = [r for r in self.replicas if r.alive] or self.replicas
        return alive[next(self._prepare_turn) % len(alive)]

    @property
    def max_model_len(self) -> int:
        """The most tokens a request may hold (every replica serves the same model)."""
        return self.replicas[0].max_model_len

    def enqueue(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                beside: str | None = None) -> str:
        """Route one request to a replica (token ids route with prefix affinity; ``beside``: the replica of that
        live request) and queue it there."""
        params = params or SamplingParams()
        ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
        with self._lock:
            near = self._tickets.get(beside) if beside is not None else None
        ticket = self.router.route(ids, params.max_new_tokens, [r.alive for r in self.replicas], near)
        with self._lock:
            if request_id is not None and request_id in self._tickets:
                self.router.finish(ticket)
                raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            rid = self.replicas[ticket.replica].enqueue(prompt, params, request_id)
        except BaseException:
            self.router.finish(ticket)
            raise
        with self._lock:
            self._tickets[rid] = ticket
        return rid

    def enqueue_samples(self, prompt, params: list[SamplingParams]) -> list[str]:
        """One request per sample of ``prompt`` (``params[i]``: sample i's), all on one replica, where they share
        the prompt's KV; their ids."""
        first = self.enqueue(prompt, params[0])
        return [first] + [self.enqueue(prompt, p, beside=first) for p in params[1:]]

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[RequestOutput]:
        ticket, replica = self._owner(request_id)
        try:
            for out in replica.stream(request_id, timeout):
                self.router.progress(ticket, out)
                yield out
        finally:
            self._forget(request_id, ticket)

    async def astream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        ticket, replica = self._owner(request_id)
        try:
            async for out in replica.astream(request_id):
                self.router.progress(ticket, out)
                yield out
        finally:
            self._forget(request_id, ticket)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            ticket = self._tickets.get(request_id)
        if ticket is not None:
            self.replicas[ticket.replica].cancel(request_id)

    def _owner(self, request_id: str) -> tuple[_Ticket, Any]:
        with self._lock:
            ticket = self._tickets.get(request_id)
        if ticket is None:
            raise UnknownRequest(request_id)
        return ticket, self.replicas[ticket.replica]

    def _forget(self, request_id: str, ticket: _Ticket) -> None:
        self.router.finish(ticket)
        with self._lock:
            self._tickets.pop(request_id, None)

    # ------------------------------------------------------------------ the replicas

    @property
    def load(self) -> Load:
        """The replicas' loads added up."""
        loads = [r.load for r in self.replicas]
        return Load(*(sum(x) for x in zip(*loads)))

    @property
    def alive(self) -> bool:
        """Every replica runs (one that stopped is routed around, but the server reports itself unhealthy)."""
        return all(r.alive for r in self.replicas)

    def add_stats_listener(self, fn) -> None:
        for r in self.replicas:
            r.add_stats_listener(fn)

    def iteration_stats(self) -> list[IterationStats]:
        """Every replica's recent steps, by time."""
        return sorted((s for r in self.replicas for s in r.iteration_stats()), key=lambda s: s.wall_time)

    def run_on_replicas(self, fn, timeout: float | None = 60.0) -> list:
        """``[fn(engine) of replica 0, ...]``, each on its replica's loop between steps (for a ReplicaProcess
        ``fn`` must pickle)."""
        return [r.run_on_loop(fn, timeout) for r in self.replicas]

    def status(self) -> list[dict]:
        """Per replica: whether it runs, its load, and what the router counts against it."""
        rt = self.router
        return [{"replica": i, "alive": r.alive, "num_waiting": r.load.num_waiting, "num_running": r.load.num_running,
                 "kv_blocks_used": r.load.kv_blocks_used, "kv_blocks_total": r.load.kv_blocks_total,
                 "outstanding_requests": rt.requests[i], "outstanding_tokens": rt.tokens[i], "routed": rt.routed[i]}
                for i, r in enumerate(self.replicas)]

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    def __enter__(self) -> DataParallelExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def held_blocks(engine) -> int:
    """KV blocks that requests hold in ``engine``'s pool: allocated blocks less those only its prefix cache keeps
    (exact once the engine is drained; a ``run_on_replicas`` function)."""
    alloc, cache = engine.allocator, engine.scheduler.prefix_cache
    return alloc.num_blocks - alloc.num_free - (cache.num_evictable() if cache is not None else 0)
