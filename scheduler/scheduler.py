"""Continuous batching: admission under a KV capacity policy, chunked prefill, preemption."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.kvcache.allocator import BlockAllocator, OutOfBlocks
from specdec.kvcache.block_table import BlockTables
from specdec.kvcache.sliding_window import RELEASED, WindowReuse, live_blocks
from specdec.scheduler.request import Request, RequestStatus


class CapacityPolicy(enum.Enum):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"  # admit only what can finish
    MAX_UTILIZATION = "max_utilization"  # admit greedily, preempt by recompute


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_num_tokens: int = 2048  # prefill tokens per step
    policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    # Grouped admission: while rows run, waiting requests are admitted only once this many rows are free (or as
    # many as wait), or the head of the queue has been held back for ``admit_max_wait`` steps. A pipelined engine
    # drops its queued step whenever a new row joins the batch, so admitting rows one by one as they free up
    # would drop it at almost every step of a large batch.
    admit_min_free: int = 1
    admit_max_wait: int = 8
    # Prefill ahead: up to this many requests beyond ``max_batch_size`` are admitted and prefilled while every decode
    # row is taken, and wait, their prompt's KV computed, for a row to free: a row that ends is taken at the next step
    # by a request whose prefill is done, so grouped admission leaves no row idle while the group gathers.
    admit_ahead: int = 0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if not isinstance(self.policy, CapacityPolicy):
            object.__setattr__(self, "policy", CapacityPolicy(self.policy))
        if not 1 <= self.admit_min_free <= self.max_batch_size:
            raise ValueError(f"admit_min_free must be in [1, max_batch_size={self.max_batch_size}], "
                             f"got {self.admit_min_free}")
        if self.admit_max_wait < 0:
            raise ValueError(f"admit_max_wait must be >= 0, got {self.admit_max_wait}")
        if self.admit_ahead < 0:
            raise ValueError(f"admit_ahead must be >= 0, got {self.admit_ahead}")

    @property
    def max_running(self) -> int:
        """Requests admitted at once: the decode rows and those prefilled ahead."""
        return self.max_batch_size + self.admit_ahead


@dataclass
class PrefillChunk:
    req: Request
    start: int
    end: int


@dataclass
class StepBatch:
    """What one engine step runs: prefill chunks, and rows that speculate (draft + verify)."""

    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    joining: list[Request] = field(default_factory=list)  # decode from the next step: their prefill ends in this one
    #                                                       or ended earlier (prefilled ahead), and a row is free

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """Owns the queues, the allocator bookkeeping and the block tables of all requests.

    ``lookahead`` is the number of positions past the sequence a speculating row writes
    (the draft tree's node budget). With ``window`` (every model attends through a sliding
    window) blocks below every future query's window are released at the start of each step,
    prefill blocks are allocated chunk by chunk, and capacity counts a request's window-bounded
    peak instead of its full length.
    """

    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator, tables: BlockTables,
                 block_size: int, lookahead: int, prefix_cache=None, window: WindowReuse | None = None) -> None:
        self.cfg, self.allocator, self.tables = cfg, allocator, tables
        self.block_size, self.lookahead = block_size, lookahead
        self.prefix_cache = prefix_cache
        self.window = window
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.failed: list[Request] = []  # failed since the engine last took them (take_failed)
        self._arrivals = 0
        self._held = 0  # consecutive steps that held back the waiting requests (grouped admission)
        self._short: tuple[int, int, int] | None = None  # see _has_free_blocks

    def add(self, req: Request) -> None:
        req.arrival = self._arrivals
        self._arrivals += 1
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def _max_blocks(self, req: Request) -> int:
        """Most blocks ``req`` holds at once from now on (its full length without a window)."""
        full = self.blocks_for(req.num_prompt + req.params.max_new_tokens + self.lookahead + 1)
        if self.window is None:
            return full
        return min(full, self.window.peak(len(req.tokens) - 1 - req.num_computed, self._chunk_cap(req.num_prompt)))

    def blocks_needed(self, num_prompt: int, max_new_tokens: int) -> int:
        """Blocks a request must be able to hold at once to run at all, even after a preemption."""
        full = self.blocks_for(num_prompt + max_new_tokens + self.lookahead + 1)
        if self.window is None:
            return full
        return min(full, self.window.peak(num_prompt + max_new_tokens - 1, self._chunk_cap(num_prompt)))

    def _chunk_cap(self, num_prompt: int) -> int:
        """Longest prefill chunk of a request. Windowed: no longer than its first prefill could be
        (or the window), so recomputing a long sequence after a preemption needs no more blocks."""
        if self.window is None:
            return self.cfg.max_num_tokens
        return min(self.cfg.max_num_tokens, max(num_prompt - 1, self.window.max_window))

    def schedule(self) -> StepBatch:
        """Admit what fits, then pick prefill chunks and speculating rows for one step."""
        batch = StepBatch()
        if self.window is not None:
            for req in self.running:
                self.release_outside_window(req)
        self._admit()
        budget = self.cfg.max_num_tokens
        running = RequestStatus.RUNNING  # a preempted request is WAITING again: status, not list membership
        for req in list(self.running):  # req.num_computed >= len(req.tokens) - 1: req.prefill_done, inlined
            if req.num_computed >= len(req.tokens) - 1 or req.status is not running or budget == 0 or \
                    self._wait_for_shared_prefix(req):  # status: a request preempted by an earlier chunk
                continue
            end = min(len(req.tokens) - 1, req.num_computed + min(budget, self._chunk_cap(req.num_prompt)))
            if not self._reserve(req, end, batch):  # a no-op unless blocks are allocated per chunk
                continue
            batch.prefill.append(PrefillChunk(req, req.num_computed, end))
            if self.prefix_cache is not None:
                self.prefix_cache.note_in_progress(req, req.num_computed, end)
            budget -= end - req.num_computed
        self._promote(batch)
        bs, joining = self.block_size, {id(r) for r in batch.joining}
        for req in list(self.running):  # (prefill done: inlined; joining rows decode from the next step)
            if req.decoding and req.num_computed >= len(req.tokens) - 1 and req.status is running and \
                    id(req) not in joining:
                reach = len(req.tokens) + self.lookahead
                if len(req.blocks) * bs >= reach or self._reserve(req, reach, batch):  # most rows have the blocks
                    batch.decode.append(req)
        if batch.preempted:
            batch.decode = [r for r in batch.decode if r.status is running]
            batch.prefill = [c for c in batch.prefill if c.req.status is running]  # drop preempted rows' chunks
            batch.joining = [r for r in batch.joining if r.status is running]
        return batch

    def _promote(self, batch: StepBatch) -> None:
        """Give free decode rows to running requests that are not decoding yet, oldest first: those whose prefill
        ends in this step's chunks (they decode from the next step: ``batch.joining``), and those prefilled ahead
        (already done: they take the rows of requests that ended). A request prefilled ahead decodes in this step
        when nothing else does or when nothing is prefilled ahead (``admit_ahead`` 0: a prompt the prefix cache held
        whole), else from the next step too, so that a pipelined engine takes it into the step it queues now."""
        free = self.cfg.max_batch_size - sum(1 for r in self.running if r.decoding)
        if free <= 0:
            return
        ending = {id(c.req) for c in batch.prefill if c.end >= len(c.req.tokens) - 1}
        ahead_waits = self.cfg.admit_ahead > 0 and any(r.decoding for r in self.running)
        for req in self.running:
            if free == 0:
                break
            if req.decoding or req.status is not RequestStatus.RUNNING:
                continue
            if id(req) in ending or (req.prefill_done and ahead_waits):
                batch.joining.append(req)
            elif not req.prefill_done:
                continue
            req.decoding = True
            free -= 1

    def _wait_for_shared_prefix(self, req: Request) -> bool:
        """Prefix-aware skipping: wait while another request computes our next block; adopt it after."""
        pc = self.prefix_cache
        if pc is None:
            return False
        if pc.pending_block(req):
            return True
        if pc.adopt(req):
            self.tables.set_row(req.bt_row, req.blocks)
        return req.prefill_done

    def _admit(self) -> None:
        most = self.cfg.max_running
        free = most - len(self.running)
        if self.running and 0 < free < min(self.cfg.admit_min_free, len(self.waiting)) and \
                self._held < self.cfg.admit_max_wait:
            self._held += 1
            return
        self._held = 0
        while self.waiting and len(self.running) < most:
            req = self.waiting[0]
            if not self._can_admit(req):
                break
            self.waiting.pop(0)
            req.bt_row = self.tables.acquire_row()
            req.status = RequestStatus.RUNNING
            if self.prefix_cache is not None:
                self.prefix_cache.attach(req)
            self.tables.set_row(req.bt_row, req.blocks)
            self.running.append(req)
            try:
                if self.window is None:
                    self.allocator_grow(req, len(req.tokens) - 1)
                else:  # windowed prefill blocks come chunk by chunk; a long cached prefix is dropped now
                    self.release_outside_window(req)
            except OutOfBlocks as err:  # the pool shrank below what admission counted on
                self.fail(req, err)

    def _can_admit(self, req: Request) -> bool:
        if self.cfg.policy is CapacityPolicy.GUARANTEED_NO_EVICT:
            reserved = sum(max(0, self._max_blocks(r) - len(live_blocks(r.blocks))) for r in self.running)
            return self._has_free_blocks(reserved + self._max_blocks(req))
        return self._has_free_blocks(min(self.blocks_for(len(req.tokens) + self.lookahead), self._max_blocks(req)))

    def _has_free_blocks(self, need: int) -> bool:
        """Whether ``need`` blocks are free, evicting cached prefixes for them where that makes them free.

        Counting the cache's evictable blocks visits every cached node, so it happens only when the free list
        falls short, and the eviction then frees a slack beyond ``need`` (``RadixPrefixCache.make_room``): with a
        pool full of cached prefixes (a long-running server), admitting request after request walks the cache
        once per slack, not once per request. A count that fell short is not repeated for as many blocks or more
        until a block is released (nothing else can make more blocks free or evictable)."""
        alloc, cache = self.allocator, self.prefix_cache
        free = alloc.num_free
        if free >= need or cache is None:
            return free >= need
        short = self._short  # (frees, free blocks, need) of the last count that fell short
        if short is not None and short[0] == alloc.frees and free <= short[1] and need >= short[2]:
            return False
        if free + cache.num_evictable() < need:
            self._short = (alloc.frees, free, need)
            return False
        cache.make_room(need)
        return True

    def allocator_grow(self, req: Request, num_positions: int) -> None:
        """Give ``req`` blocks covering ``num_positions`` logical positions (may raise OutOfBlocks)."""
        need = self.blocks_for(num_positions) - len(req.blocks)
        if need <= 0:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.make_room(need)
        req.blocks += self.allocator.allocate(need)
        self.tables.set_row(req.bt_row, req.blocks)

    def _reserve(self, req: Request, num_positions: int, batch: StepBatch) -> bool:
        """Grow ``req`` to ``num_positions``, preempting later arrivals if the pool is full.

        When preemption cannot help (GUARANTEED_NO_EVICT promised the blocks, or ``req`` runs
        alone) ``req`` fails with finish_reason "error"; the other requests are untouched."""
        while True:
            try:
                self.allocator_grow(req, num_positions)
                return True
            except OutOfBlocks as err:
                if self.cfg.policy is CapacityPolicy.GUARANTEED_NO_EVICT or self.running == [req]:
                    self.fail(req, err)
                    return False
                victim = max(self.running, key=lambda r: r.arrival)
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return False

    def release_outside_window(self, req: Request) -> None:
        """Drop ``req``'s references to blocks no future query of any model can read (windowed
        engines only); their block-table entries become RELEASED. Shared blocks stay with their
        other holders (the prefix cache, other requests)."""
        if self.window is None:
            return
        dead = min(self.window.num_dead_blocks(req.num_computed, req.num_computed_draft), len(req.blocks))
        first = dead
        while first > 0 and req.blocks[first - 1] != RELEASED:  # released entries form a prefix
            first -= 1
        if first == dead:
            return
        self.allocator.free(req.blocks[first:dead])
        req.blocks[first:dead] = [RELEASED] * (dead - first)
        self.tables.set_row(req.bt_row, req.blocks)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s KV and requeue it at the front; it is recomputed from its tokens."""
        self.running.remove(req)
        self._release(req)
        req.num_computed = req.num_computed_draft = 0
        req.status, req.decoding = RequestStatus.WAITING, False
        self.waiting.insert(0, req)

    def shrink(self, req: Request) -> None:
        """Free blocks past what the request's next step reserves (its tokens and ``lookahead`` tree slots):
        blocks of rejected tree slots inside that reach stay, so a speculating row does not free a block
        after every step only to allocate it again at the next (their slots are never read before a later
        verify forward writes them)."""
        keep = self.blocks_for(len(req.tokens) + self.lookahead)
        if len(req.blocks) > keep:
            self.allocator.free(req.blocks[keep:])
            del req.blocks[keep:]
            self.tables.set_row(req.bt_row, req.blocks)

    def abort(self, req: Request) -> None:
        """Drop a request that is waiting or running (its consumer went away); frees its KV."""
        if req in self.waiting:
            self.waiting.remove(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            return
        self.finish(req, "abort")

    def fail(self, req: Request, err: Exception) -> None:
        """End ``req`` with finish_reason "error" and ``err`` as its cause; frees its KV."""
        if req in self.waiting:
            self.waiting.remove(req)
        req.error = err
        self.finish(req, "error")
        self.failed.append(req)

    def take_failed(self) -> list[Request]:
        """The requests failed since the last call (the engine reports them to their callers)."""
        failed, self.failed = self.failed, []
        return failed

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(req)
        else:
            self.allocator.free(live_blocks(req.blocks))
        req.blocks = []
        if req.bt_row >= 0:
            self.tables.release_row(req.bt_row)
            req.bt_row = -1


def commit_accepted(sched: Scheduler, stopper, pool, rows: list[Request], results) -> None:
    """Adopt each row's accepted path into its sequence, append tokens, apply stop rules.

    ``results[i]`` has ``accepted_nodes``, ``accepted_tokens``, ``bonus_token`` and
    ``draft_computed`` (nodes whose draft KV was written). KV of accepted node a_j moves from
    position L + a_j to L + j - 1 for both models, in one call for the whole batch.
    """
    import torch

    src, dst = [], []
    for req, res in zip(rows, results):
        nodes = res.accepted_nodes  # a path: increasing indices, node j >= j; all in place when the last is
        if not nodes or nodes[-1] == len(nodes) - 1 or res.kv_moved:  # (kv_moved: moved on the device)
            continue
        base = len(req.tokens)
        for j, node in enumerate(nodes):
            if node != j:
                src.append(_slot(req, base + node, sched.block_size))
                dst.append(_slot(req, base + j, sched.block_size))
    if src:
        dev = pool.storage.device
        pool.move_slots(*(torch.tensor(s).to(dev, non_blocking=True) for s in (src, dst)))  # no stream sync
    shrink_reach = sched.lookahead + sched.block_size - 1  # Scheduler.shrink keeps blocks_for(len(tokens) + lookahead)
    for req, res in zip(rows, results):
        nodes = res.accepted_nodes
        base, m = len(req.tokens), len(nodes)
        req.num_computed = base + m
        if res.draft_computed is None or req.num_computed_draft >= base:  # (else the draft did not run: it lags)
            req.num_computed_draft = base + _draft_kept(nodes, res.draft_computed)
        reason, appended = stopper.extend(req, [*res.accepted_tokens, res.bonus_token])
        if res.logprobs is not None and req.logprobs is not None:
            stopper.add_logprobs(req, res.logprobs[:appended])
        req.stats.record(res.num_drafted, res.max_depth, min(m, appended), appended)
        if reason:  # running requests' text is decoded incrementally where it is streamed
            stopper.finalize_text(req, reason)
            sched.finish(req, reason)
        elif len(req.blocks) * sched.block_size > len(req.tokens) + shrink_reach:  # shrink has blocks to free
            sched.shrink(req)


def _draft_kept(nodes: list[int], done: frozenset[int] | None) -> int:
    """How many accepted ``nodes`` keep their draft KV: the path's longest prefix in ``done`` (the nodes whose
    draft KV was written; None: a model-free drafter, nothing of the draft to track, so all)."""
    if done is None:
        return len(nodes)
    for j, node in enumerate(nodes):
        if node not in done:
            return j
    return len(nodes)


def _slot(req: Request, pos: int, block_size: int) -> int:
    return req.blocks[pos // block_size] * block_size + pos % block_size
