"""SpecEngine: the draft -> verify loop over a continuous batch on one shared KV pool."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch

from specdec.budget_policy import make_controller
from specdec.defaults import resolve_auto
from specdec.drafters.base import Proposal
from specdec.engine_guard import EngineGuard
from specdec.engine_setup import (
    agree_with_rank0,
    as_loaded,
    attention_backend,
    check_same_vocab,
    device_ngram,
    feature_width,
    fuse_verify,
    kv_budget,
    kv_spec,
    load_device,
    make_drafter,
    make_pipeline,
    on_device,
    proposer_kind,
    setup_graphs,
)
from specdec.errors import FieldError
from specdec.fault_isolation import run_isolated
from specdec.kvcache.allocator import BlockAllocator, OutOfBlocks
from specdec.kvcache.block_table import BlockTables
from specdec.kvcache.pool import KVPool
from specdec.kvcache.sliding_window import window_reuse_for
from specdec.loading.registry import resolve_dtype
from specdec.loading.roles import check_roles
from specdec.logprobs import prompt_logprobs, wants_prompt_logprobs
from specdec.outputs import AcceptanceStats, RequestOutput, request_output
from specdec.plan import resolve_plan
from specdec.prompts import PromptError, as_prompt_list, is_chat, to_prompt_ids
from specdec.repetition_penalty import bad_word_ids
from specdec.routing import OutputQueue, Router
from specdec.runner import ModelRunner, RowInput
from specdec.sampling_params import SamplingParams, sample_requests
from specdec.scheduler.request import Request, RequestStatus
from specdec.scheduler.scheduler import CapacityPolicy, Scheduler, SchedulerConfig, StepBatch, commit_accepted
from specdec.scheduler.stop import StopChecker
from specdec.spec_config import SpecConfig
from specdec.verifier import Verifier, request_stream


class SpecEngine:
    """``SpecEngine(draft, target).generate(prompts, params)``: lossless speculative decoding.

    draft: a model name/path/LoadedModel, ``"ngram"``, or None or ``"none"`` (target-only decoding).
    """

    def __init__(self, draft: Any, target: Any, config: SpecConfig | None = None) -> None:
        if isinstance(draft, str) and draft.strip().lower() == "none":  # (the CLI's --draft none)
            draft = None
        if config is not None and not isinstance(config, SpecConfig):
            raise TypeError(f"config must be a SpecConfig (e.g. SpecConfig(**options)) or None, got "
                            f"{type(config).__name__}")
        self.config = cfg = resolve_auto(config or SpecConfig(), draft, target)  # "auto" fields -> defaults.py's
        check_roles(draft, target)  # an EAGLE draft given as the target is refused before anything loads
        self.device = torch.device(cfg.device)
        with on_device(self.device):  # (its GPU current while it loads, captures and warms up)
            dtype = resolve_dtype(cfg.dtype)
            load_on = torch.device(load_device(cfg.tensor_parallel_size, self.device))
            self.target = as_loaded(target, dtype, load_on)
            self.draft = None if draft is None or draft == "ngram" else as_loaded(draft, dtype, load_on, self.target)
            if self.draft is not None:
                check_same_vocab(self.draft, self.target)
            if cfg.tensor_parallel_size > 1:  # this rank's part of each model (docs/parallel.md)
                from specdec.parallel import shard_models

                self.target, self.draft = shard_models(self.target, self.draft, cfg, self.device)
            backend = attention_backend(cfg, self.device)
            proposer = proposer_kind(draft, self.draft)
            self.plan = resolve_plan(cfg, self.device, proposer, backend.name,
                                     0 if proposer == "none" else cfg.tree_spec.budget)
            plan = self.plan
            specs = [kv_spec(self.target.config)] + ([kv_spec(self.draft.config)] if self.draft else [])
            budget = None if cfg.num_blocks is not None else kv_budget(cfg, self.device, self.target, self.draft)
            if budget is not None and cfg.tensor_parallel_size > 1:  # every rank the same blocks (its own free memory)
                from specdec.parallel import agree_min

                budget = agree_min(budget, cfg.tensor_parallel_size)
            self.pool = KVPool(specs, cfg.block_size, num_blocks=cfg.num_blocks, memory_bytes=budget, dtype=dtype,
                               device=self.device, feature_width=feature_width(self.draft, proposer))
            max_blocks = -(-self.target.config.max_position_embeddings // cfg.block_size) + 8
            self.tables = BlockTables(cfg.max_batch_size + plan.admit_ahead, max_blocks, self.device)
            self.allocator = BlockAllocator(self.pool.num_blocks)
            self.runner = ModelRunner(self.pool, self.tables, backend, self.device)
            self.drafter = make_drafter(draft, self.draft, cfg, self.device, self.runner, self.target.config.vocab_size)
            self.graph_report = setup_graphs(self.target, self.draft, self.drafter, self.pool, self.runner, cfg,
                                             self.device, max_blocks, plan.padded)
            self.adaptive = make_controller(plan.adaptive, self.drafter, self.runner.graphs, epochs=plan.budget_epochs,
                                            agree=agree_with_rank0(cfg.tensor_parallel_size))
            self.drafter.pipelined = plan.pipeline  # before the scheduler reads the drafter's lookahead
            prefix_cache = self._make_prefix_cache() if cfg.prefix_cache else None
            window = None if not cfg.window_reuse else window_reuse_for(
                self.target.config, self.draft and self.draft.config, self.drafter.uses_kv, cfg.block_size,
                self.drafter.lookahead)
            sched_cfg = SchedulerConfig(cfg.max_batch_size, cfg.max_num_tokens, CapacityPolicy(cfg.policy),
                                        plan.admit_min_free, admit_ahead=plan.admit_ahead)
            self.scheduler = Scheduler(sched_cfg, self.allocator, self.tables, cfg.block_size, self.drafter.lookahead,
                                       prefix_cache, window)
            self.verifier = Verifier(self.target.model, self.runner, self.drafter.target_features)
            if plan.ngram_device:
                device_ngram(self.drafter, self.verifier, self.runner, cfg, plan, max_blocks * cfg.block_size)
            if plan.fused_verify:
                fuse_verify(self.drafter, self.verifier, self.adaptive, self.graph_report)
            self.pipeline = make_pipeline(self.drafter, self.verifier, self.runner, plan) if plan.pipeline else None
            self.proposer = self.pipeline or self.drafter  # propose(rows): adopts a queued step when pipelined
            self.stopper = StopChecker(self.target.tokenizer)
            self.stats = AcceptanceStats()
            self.router = Router()
            self._ids = itertools.count()
            self.guard = EngineGuard()  # held by stream()'s engine work: several threads may generate at once
            if plan.warm_up:
                seconds = self.warm_up()
                if self.graph_report is not None:
                    self.graph_report.warm_up_seconds = seconds
                    self.graph_report.parts = self.runner.graphs.parts()

    def _make_prefix_cache(self):
        from specdec.kvcache.radix_cache import RadixPrefixCache

        return RadixPrefixCache(self.allocator, self.config.block_size)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Validate and queue one request; bad input raises a ValueError naming the field.

        Its outputs are not routed anywhere: the caller drives ``step()`` and reads the Request. A request is one
        sample: ``params.n`` > 1 is refused here (``generate``/``stream`` run n requests, ``sample_requests``).
        """
        params = SamplingParams() if params is None else params
        ids = self.prepare(prompt, params)
        if params.n != 1:
            raise FieldError("SamplingParams", "n", "must be 1 for add_request, which queues one sample (generate "
                             "and stream run n > 1 as n requests: sampling_params.sample_requests)", params.n)
        if request_id is not None and any(r.request_id == request_id
                                          for r in (*self.scheduler.waiting, *self.scheduler.running)):
            raise ValueError(f"request_id {request_id!r} is already in use by a request that has not finished")
        return self._queue(ids, params, request_id, self._prompt_text(prompt, ids))

    def _queue(self, ids: list[int], params: SamplingParams, request_id: str | None,
               prompt_text: str | None) -> Request:
        """Queue one sample (``params.n`` 1) of a prompt whose token ids ``prepare`` gave (and checked)."""
        params = self._bounded(ids, params)
        req = Request(request_id or str(next(self._ids)), ids, params, self._eos_ids())
        req.prompt_text = prompt_text
        if params.bad_words:
            req.bad_word_ids = bad_word_ids(params.bad_words, self.target.tokenizer)
        if not params.greedy:
            req.stream = request_stream(params.seed)
        self.scheduler.add(req)
        return req

    def _eos_ids(self) -> tuple[int, ...]:
        """The target's EOS token ids: its config's and its tokenizer's."""
        eos = tuple(self.target.config.eos_token_ids)
        if self.target.tokenizer is not None and self.target.tokenizer.eos_token_id is not None:
            eos = tuple(sorted(set(eos) | {self.target.tokenizer.eos_token_id}))
        return eos

    def _prompt_text(self, prompt, ids: list[int]) -> str | None:
        """``RequestOutput.prompt``: a text prompt itself, a chat's rendered text (its ids decoded), else None."""
        if isinstance(prompt, str):
            return prompt
        tok = self.target.tokenizer
        return tok.decode(ids) if is_chat(prompt) and tok is not None else None

    def prepare(self, prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked against the model and the pool as ``add_request`` checks them; bad
        input raises a ValueError naming the field. It reads no state that steps change, so any thread may call
        it (a server tokenises off the thread that runs the engine)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        for name, instead in (("stop", "stop_token_ids"), ("bad_words", "logit_bias={id: -100}")):
            if getattr(params, name) and self.target.tokenizer is None:
                raise FieldError("SamplingParams", name, f"needs a model with a tokenizer ({self.target.name!r} has "
                                 f"none; use {instead})", getattr(params, name))
        if params.bad_words:  # (tokenised again as the request is queued: here a tokenizer's error names the field)
            try:
                bad_word_ids(params.bad_words, self.target.tokenizer)
            except Exception as err:  # noqa: BLE001 - third-party tokenizers raise anything
                raise FieldError("SamplingParams", "bad_words", f"could not be tokenised ({type(err).__name__}: "
                                 f"{err})", params.bad_words) from err
        ids = self._truncated(to_prompt_ids(prompt, self.target.tokenizer), params.truncate_prompt_tokens)
        self._validate(ids, params)
        return ids

    def _truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last ``keep`` tokens (``SamplingParams.truncate_prompt_tokens``; -1: the longest prompt that
        leaves room for one output token), or all of them."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.target.config.max_position_embeddings - 1 - self.drafter.lookahead
        return ids[-keep:] if len(ids) > keep else ids

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids ``ids`` as the target's tokenizer decodes them, special tokens kept (a chat's
        rendered ids give back its template's text); a PromptError naming ``tokens[i]`` for an id outside the
        vocabulary, or ``tokens`` for a model without a tokenizer. Any thread may call it, as ``prepare``."""
        tok = self.target.tokenizer
        if tok is None:
            raise PromptError(f"{self.target.name!r} has no tokenizer: its token ids have no text", "tokens")
        vocab = self.target.config.vocab_size
        bad = next((i for i, t in enumerate(ids)
                    if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"tokens[{bad}] must be a token id in [0, {vocab}), got {ids[bad]!r}", f"tokens[{bad}]")
        return tok.decode(list(ids))

    def _bounded(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """``params`` with a number of new tokens: ``max_new_tokens=None`` (vLLM's ``max_tokens=None``) becomes the
        room the prompt ``ids`` leaves: as many as the model's context leaves after it (and the draft tree's
        lookahead), or as the KV pool holds for the request if that is fewer; with ``fit_max_new_tokens``, a
        ``max_new_tokens`` over that room becomes the room."""
        if params.max_new_tokens is not None and not params.fit_max_new_tokens:
            return params
        room = self.target.config.max_position_embeddings - len(ids) - self.drafter.lookahead
        if params.max_new_tokens is not None:
            room = min(room, params.max_new_tokens)
        held = _largest(room, lambda m: self.scheduler.blocks_needed(len(ids), m) <= self.pool.num_blocks)
        return dataclasses.replace(params, max_new_tokens=max(1, held))

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        cfg = self.target.config
        if not ids:
            raise PromptError("prompt is empty: it must have at least 1 token")
        limit, lookahead = cfg.max_position_embeddings, self.drafter.lookahead
        longest = limit - 1 - lookahead  # the longest prompt that leaves room for one output token
        if len(ids) > longest:  # checked before the ids are scanned: a huge prompt is refused at once
            raise PromptError(f"prompt has {len(ids)} tokens; the model's max length {limit} leaves no room for "
                              f"output (prompt must be <= {longest} tokens)")
        blocks, needed = self.pool.num_blocks, self.scheduler.blocks_needed
        if needed(len(ids), 1) > blocks:  # no max_new_tokens helps: the prompt is at fault
            raise PromptError(f"prompt has {len(ids)} tokens; the KV pool's {blocks} blocks hold a prompt of at "
                              f"most {_largest(len(ids), lambda n: needed(n, 1) <= blocks)} tokens (with one output "
                              "token): send a shorter prompt or raise num_blocks/kv_memory_bytes")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        self._validate_processors(params)
        params = self._bounded(ids, params)
        if len(ids) + params.max_new_tokens + lookahead > limit:
            raise FieldError("SamplingParams", "max_new_tokens", f"with a {len(ids)}-token prompt exceeds the "
                             f"model's max length {limit}; allowed: <= {limit - len(ids) - lookahead}",
                             params.max_new_tokens)
        need = needed(len(ids), params.max_new_tokens)
        if need > blocks:
            most = _largest(params.max_new_tokens, lambda m: needed(len(ids), m) <= blocks)
            raise FieldError("SamplingParams", "max_new_tokens", f"with a {len(ids)}-token prompt needs {need} KV "
                             f"blocks; the pool has {blocks}, which hold at most {most} new tokens (raise "
                             "num_blocks/kv_memory_bytes or lower max_new_tokens)", params.max_new_tokens)

    def _validate_processors(self, params: SamplingParams) -> None:
        """The token ids of ``logit_bias`` and ``allowed_token_ids`` are in the vocabulary, and ``min_tokens`` leaves
        some allowed token to generate before it is reached."""
        vocab = self.target.config.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise FieldError("SamplingParams", name, f"holds token id {bad}, outside the vocabulary [0, {vocab})",
                                 bad)
        if params.min_tokens and params.allowed_token_ids is not None:
            ending = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids()))
            if ending.issuperset(params.allowed_token_ids):
                raise FieldError("SamplingParams", "min_tokens", "leaves no token to generate: allowed_token_ids "
                                 "holds only ending tokens (EOS, stop_token_ids), which min_tokens holds back",
                                 params.min_tokens)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Request]:
        """One engine step; returns the requests that made progress, finished or failed.

        A failure that concerns some requests (an exception in their forward or draft, non-finite
        logits, no KV block left for them) fails just those (finish_reason "error", the cause in
        ``error``); the step goes on for the others. Outputs go to the stream that owns a request.
        """
        t0 = time.perf_counter()
        with on_device(self.device):  # (a serving loop's thread starts on GPU 0; graphs replay on their own GPU)
            batch, prefilled = self._schedule()  # schedule, then the prefill chunks' forward
            rows, results = run_isolated(batch.decode, _itself, self._speculate, self._fail)  # propose/verify/accept
            self._commit(rows, results)  # commit
        progressed = list(dict.fromkeys(prefilled + rows + self.scheduler.take_failed()))
        self._route(progressed)
        if self.adaptive is not None and rows:  # the whole step, routing included, is what a budget costs
            self.adaptive.observe_step(time.perf_counter() - t0)
        return progressed

    def _schedule(self) -> tuple[StepBatch, list[Request]]:
        """``scheduler.schedule()`` and the forward of its prefill chunks (target, then the draft's KV or features):
        the batch and the prefilled requests."""
        batch = self.scheduler.schedule()
        if batch.empty and self.scheduler.has_work and not self.scheduler.failed:
            self._fail_stuck()
        prefilled = self._prefill(batch)
        self.drafter.step_prefilled = bool(prefilled)
        self.drafter.joining = self._joining(batch.joining)
        if self.adaptive is not None:  # a prefill's device work would be timed as part of the verify
            self.adaptive.timing_valid = not prefilled
        return batch, prefilled

    def _joining(self, promoted: list[Request]) -> tuple[Request, ...]:
        """The requests that decode from the next step (``StepBatch.joining``: their prefill ended in this step, or
        earlier when they were prefilled ahead) and may join the step a pipelined engine queues now
        (``StepPipeline.queue``): their prompt is done, and they get now the KV blocks the next step's schedule would
        give them (its tree and the queued one's) as far as the pool holds them (a row left short of them makes
        ``StepPipeline.queue`` queue nothing); none without a pipeline, or with a sliding window (whose blocks come
        chunk by chunk)."""
        sched = self.scheduler
        if self.pipeline is None or sched.window is not None:
            return ()
        joining = tuple(r for r in promoted if r.prefill_done and r.status is RequestStatus.RUNNING)
        for req in joining:
            try:
                sched.allocator_grow(req, len(req.tokens) + sched.lookahead)
            except OutOfBlocks:
                break
        return joining

    def _speculate(self, rows: list[Request]) -> list:
        """propose -> verify -> accept for the decode rows, under this step's budget: the proposer's trees (device
        tensors, or the step the pipeline queued for them), then one target forward over them with the acceptance
        rule for greedy and sampled rows and the step's one read. With a budget controller (``plan.adaptive``) the
        same two calls run under the budget it chooses (``BudgetController.speculate`` at every step, or a pipelined
        engine's ``EpochBudget``), else under the tree's full budget."""
        if not rows:
            return []
        if self.adaptive is not None:
            return self.adaptive.speculate(rows, self.proposer, self.verifier)
        proposal: Proposal = self.proposer.propose(rows)
        return self.verifier.verify_proposal(rows, proposal)

    def _commit(self, rows: list[Request], results: list) -> None:
        """``commit_accepted`` (adopt the accepted KV, stop rules, free blocks), then the drafter's bookkeeping
        (features, histories) and the finished requests' statistics."""
        commit_accepted(self.scheduler, self.stopper, self.pool, rows, results)
        self.drafter.accepted(rows, results)
        for req in rows:
            if req.finished:
                self.stats.merge(req.stats)

    def _prefill(self, batch: StepBatch) -> list[Request]:
        chunks, _ = run_isolated(batch.prefill, _chunk_request, self._prefill_chunks, self._fail)
        if self.scheduler.prefix_cache is not None:
            for c in chunks:
                self.scheduler.prefix_cache.insert(c.req)
        return [c.req for c in chunks]

    def _prefill_chunks(self, chunks: list) -> list[None]:
        if not chunks:
            return []
        rows = [RowInput(c.req, c.req.tokens[c.start:c.end], list(range(c.start, c.end)), c.start, c.end,
                         want_logits="all" if wants_prompt_logprobs(c.req, c.start) else "none") for c in chunks]
        fwd = self.runner.forward(0, self.target.model, rows, self.drafter.target_features)  # (features: to slots)
        prompt_logprobs(chunks, fwd.logits, self.stopper)  # (rows that want logits: their prompt's log-probabilities)
        if not fwd.draft_kv:  # (a graphed prefill wrote the draft model's KV in the same replays)
            self.drafter.prefill(chunks)
        for c in chunks:
            c.req.num_computed = c.end
            if fwd.draft_kv or not self.drafter.uses_kv:
                c.req.num_computed_draft = c.end
        return [None] * len(chunks)

    def _fail(self, req: Request, err: Exception) -> None:
        """Fail one request after a compute fault. Its KV is not trusted: the prefix cache forgets the
        blocks it holds, and the blocks only it holds are zeroed (NaN left in a free block could leak
        into other rows through padded attention, where 0 * NaN is NaN) before they are freed."""
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.discard(req)
        own = [b for b in req.blocks if self.allocator.refcount(b) == 1]
        if own:
            self.pool.storage[torch.tensor(own, device=self.pool.storage.device)] = 0
        req.text = self.stopper.decode(req.output_ids, req.params.skip_special_tokens)
        self.scheduler.fail(req, err)

    def _fail_stuck(self) -> None:
        """Nothing could be scheduled although requests wait: the pool lost blocks it was sized
        with. The oldest waiting request fails instead of the whole engine."""
        sched = self.scheduler
        if sched.running or not sched.waiting:
            raise RuntimeError("scheduler made no progress although requests are running")
        req = sched.waiting[0]
        need = sched.blocks_for(len(req.tokens) + sched.lookahead)
        sched.fail(req, OutOfBlocks(need, self.allocator.num_free))

    def _route(self, reqs: list[Request]) -> None:
        for req in self.router.wanting(reqs):
            out = request_output(req, self.stopper)
            if out.new_token_ids or out.finished:
                self.router.deliver(req, out)

    def generate(self, prompts, params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; one RequestOutput per prompt, in order.

        A prompt that fails validation, or a request that fails while running, yields an output
        with finish_reason "error" and the cause in ``error``; the other prompts run normally.
        Only final outputs are built (without ``use_tqdm``), so ``new_token_ids``/``new_text`` hold the
        whole output. A prompt with ``SamplingParams.n`` > 1 yields one output whose ``outputs`` are its n
        samples' (``RequestOutput.of_samples``).
        """
        final: dict[str, RequestOutput] = {}
        order = []
        for out in self.stream(prompts, params, use_tqdm=use_tqdm, _order=order, _finals_only=not use_tqdm):
            if out.finished:
                final[out.request_id] = out
        return [final[rid] if rid in final else RequestOutput.of_samples(rid, [final[s] for s in sample_ids])
                for rid, sample_ids in order]

    def stream(self, prompts, params=None, use_tqdm: bool = False, _order=None,
               _finals_only: bool = False) -> Iterator[RequestOutput]:
        """Yield incremental outputs (``new_token_ids``/``new_text``) of these prompts' requests.

        Only this call's requests are yielded, even when other streams drive the same engine, on this
        thread or on others (``guard`` serialises their steps). A prompt with ``SamplingParams.n`` > 1 runs as n
        requests (``sample_requests``), each yielded under its own id. A params entry of the wrong type raises
        TypeError before anything is queued; if the submission fails half-way, or the consumer stops early,
        this call's requests are aborted.
        """
        prompt_list = as_prompt_list(prompts)
        plist = _params_list(params, len(prompt_list))
        order = _order if _order is not None else []
        queue, bar = OutputQueue(finals_only=_finals_only), None
        try:
            for prompt, p in zip(prompt_list, plist):
                rid = str(next(self._ids))
                samples = sample_requests(rid, SamplingParams() if p is None else p)
                order.append((rid, [sid for sid, _ in samples]))
                try:
                    ids = self.prepare(prompt, samples[0][1])  # tokenised and checked outside the guard, once
                    text = self._prompt_text(prompt, ids)
                    with self.guard:
                        for sid, sp in samples:  # (together: the scheduler lets them share the prompt's KV)
                            self.router.own(queue, self._queue(ids, sp, sid, text))
                except ValueError as err:
                    queue.pending.append(RequestOutput(rid, [], [], "", "error", AcceptanceStats(), error=err))
            bar = _progress(use_tqdm, sum(r.params.max_new_tokens for r in queue.requests))
            while queue.pending or not queue.done:
                if not queue.pending:
                    with self.guard:
                        if not queue.done and not queue.pending:  # another thread's step may have finished them
                            self.step()
                    continue
                out = queue.pending.popleft()
                if bar is not None:
                    bar.update(len(out.new_token_ids))
                yield out
        finally:  # a failed submission, an error or an early stop must not leave requests holding KV
            if queue.requests:
                with self.guard:
                    for req in queue.requests:
                        if not req.finished:
                            self.scheduler.abort(req)
                    self.router.release(queue)
            if bar is not None:
                bar.close()

    def warm_up(self) -> float:
        """Run every batch bucket and budget the engine can step through short synthetic requests, so the graphs
        captured on first use exist before real requests arrive (``specdec.warm_up``), then forget what they
        left: statistics, drafted text, kept penalty contexts, cached prefixes, the step queued behind their last
        step. Returns the seconds it took; called at construction when ``plan.warm_up``."""
        from specdec.warm_up import warm_up

        with on_device(self.device):
            seconds = warm_up(self)
        if self.pipeline is not None:  # queued for synthetic rows that are gone: no real step may adopt it
            self.pipeline.ahead = None
        self.stats = AcceptanceStats()
        self.forget_drafts()
        self.verifier.sampled_rule.context.clear()  # (the penalized synthetic rows' contexts: 5 V bytes a row)
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.evict_all()
        return seconds

    def forget_drafts(self) -> None:
        """Make the drafter forget earlier requests' text (the n-gram table shared across requests): a
        benchmark that runs the same prompts again calls it, so replies are not drafted from themselves."""
        self.drafter.forget()

    def all_blocks_free(self) -> bool:
        """True when no request holds a block (cached prefix blocks are evicted first)."""
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.evict_all()
        return self.allocator.all_free()


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="tok", desc="generate")


def _itself(req: Request) -> Request:
    return req


def _chunk_request(chunk) -> Request:
    return chunk.req


def _params_list(params, n: int) -> list[SamplingParams | None]:
    """One SamplingParams (or None) per prompt; checked before anything is queued."""
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * n
    if len(plist) != n:
        raise ValueError(f"params has {len(plist)} entries for {n} prompts")
    for i, p in enumerate(plist):
        if p is not None and not isinstance(p, SamplingParams):
            raise TypeError(f"params[{i}] must be SamplingParams or None, got {type(p).__name__}")
    return plist


def _largest(hi: int, ok) -> int:
    """The largest n in [0, hi] with ``ok(n)``, for an ``ok`` that holds up to some n and fails after it (0 if
    it holds for none): a bisection, as ``ok`` may cost a block count each."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
