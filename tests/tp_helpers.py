"""Running a function on N gloo ranks (spawned processes) for the tensor-parallel tests, with a deadline.

``run_ranks(fn, size, *args)`` starts ``size`` processes; each joins a gloo group (``backend="nccl"``: an NCCL group,
rank r on GPU r) on a free local port and returns ``fn(rank, size, *args)``. It gives back the ranks' results in rank
order, raises with the failing rank's traceback, and kills every process still alive at the deadline (no test hangs on a
lost rank)."""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specdec.parallel import free_port

GROUP_TIMEOUT = timedelta(seconds=60)


def run_ranks(fn, size: int, *args, timeout: float = 90.0, backend: str = "gloo") -> list:
    """``[fn(0, size, *args), ..., fn(size - 1, size, *args)]``, each run in its own process of a ``backend``
    group."""
    ctx = mp.get_context("forkserver")  # ranks fork from one clean server that imported the engine once
    ctx.set_forkserver_preload(["specdec.engine", "torch._dynamo", "tp_helpers"])  # (_dynamo: meta-device init)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, size, port, args, results, backend), daemon=True)
             for rank in range(size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel ranks {dead} exited without a result" if dead else
                                       f"tensor-parallel ranks gave no result within {timeout} s "
                                       f"(have ranks {sorted(got)})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(size)]


def _rank_main(fn, rank: int, size: int, port: int, args, results, backend: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=GROUP_TIMEOUT)
        try:
            results.put((rank, True, fn(rank, size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def sharded_logits_diff(rank: int, size: int, models: list, prompts: list[list[int]]) -> list[float]:
    """For each whole model (a ``LlamaForCausalLM``, sent by the parent so that no rank imports transformers): max
    |logits of the rank's sharded model - the whole model's| over the prompts (fused projections, float32)."""
    from specdec.models.tensor_parallel import TensorParallel, shard_model
    from specdec.training.dense_attention import dense_hidden

    tp = TensorParallel.current(size)
    diffs = []
    for whole in models:
        whole.fuse()
        part = shard_model(whole, tp).fuse()
        worst = 0.0
        with torch.inference_mode():
            for ids in prompts:
                x = torch.tensor([ids])
                want = whole.compute_logits(dense_hidden(whole, x)[0])  # (S, V)
                got = part.compute_logits(dense_hidden(part, x)[0])  # (S, V)
                assert got.shape == want.shape, (got.shape, want.shape)
                worst = max(worst, (got - want).abs().max().item())
        diffs.append(worst)
    return diffs


def passes(draft) -> int:
    """How often ``engine_runs`` generates: twice with an n-gram drafter (so that it drafts from the first
    pass's text and tokens are accepted), else once."""
    return 2 if draft == "ngram" else 1


def engine_runs(rank: int, size: int, models: tuple, runs: list[tuple], prompts: list[list[int]],
                max_new: int) -> list:
    """For each (drafter argument, SpecConfig options) in ``runs`` ("model": the draft model): a tensor-parallel
    engine of ``size`` ranks over ``models`` (the whole target and draft ``LlamaForCausalLM``) generates
    ``prompts`` greedily (``max_new`` tokens, EOS ignored), ``passes(draft)`` times (later times from cached
    prefixes, and with an n-gram drafter from the first time's text). Returns per run (token ids per prompt of
    each time, whether all blocks are free after, the number of preemptions, the number of draft tokens
    accepted)."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.loading.base import LoadedModel
    from specdec.sampling_params import SamplingParams

    model, draft_model = models
    target = LoadedModel("tiny", model, None, model.config)
    loaded = {"model": LoadedModel("tiny-draft", draft_model, None, draft_model.config)}
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out = []
    for draft, options in runs:
        eng = SpecEngine(loaded.get(draft, draft), target, SpecConfig(tensor_parallel_size=size, **options))
        assert eng.pool.specs[0].num_kv_heads == max(1, model.config.num_kv_heads // size)  # the rank's heads
        preempted = _count_preemptions(eng.scheduler)
        tokens = [[o.token_ids for o in eng.generate(prompts, params)] for _ in range(passes(draft))]
        out.append((tokens, eng.all_blocks_free(), len(preempted), eng.stats.accepted))
    return out


def _count_preemptions(scheduler) -> list:
    """From now on, the ids of the requests ``scheduler`` preempts (as conftest's ``count_preemptions``)."""
    seen, preempt = [], scheduler.preempt

    def counting(req):
        seen.append(req.request_id)
        return preempt(req)

    scheduler.preempt = counting
    return seen


def cli_rank(rank: int, size: int, argv: list[str]) -> tuple[int, str]:
    """``specdec ARGV`` run as rank ``rank`` of ``size`` (torchrun's environment variables, the group already
    joined): (exit status, what it printed to stdout)."""
    import contextlib
    import io

    from specdec.cli.main import main

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def sampled_runs(rank: int, size: int, models: tuple, runs: list[tuple], prompts: list[list[int]],
                 params: list) -> list:
    """For each (drafter argument, SpecConfig options) in ``runs`` ("model": the draft model): a tensor-parallel
    engine of ``size`` ranks over ``models`` generates ``prompts`` with ``params`` (one SamplingParams per prompt,
    together in one batch). Returns per run (token ids per prompt, whether all blocks are free after)."""
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.loading.base import LoadedModel

    model, draft_model = models
    target = LoadedModel("tiny", model, None, model.config)
    loaded = {"model": LoadedModel("tiny-draft", draft_model, None, draft_model.config)}
    out = []
    for draft, options in runs:
        eng = SpecEngine(loaded.get(draft, draft), target, SpecConfig(tensor_parallel_size=size, **options))
        tokens = [o.token_ids for o in eng.generate(prompts, params)]
        out.append((tokens, eng.all_blocks_free()))
    return out


def serve_rank(rank: int, size: int, target: str, draft: str | None, config, jobs: list[tuple], prompts: list[str],
               idle: float) -> tuple:
    """One rank of a tensor-parallel server (``serving.tensor_parallel``), the tiny models, ``config`` with
    ``tensor_parallel_size`` = ``size``. Rank 0 serves (the real app, the openai client): waits ``idle`` seconds
    (heartbeats), sends ``jobs`` ((prompt index, stream, temperature, seed)) all at once, then a streamed request
    it leaves after one chunk and ``jobs[0]`` again, shuts down and returns (texts, operations sent, every block
    free); another rank follows and returns (operations received, every
    block free)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    import specdec.serving.executor as executor_module
    from specdec.engine import SpecEngine
    from specdec.serving.executor import Executor
    from specdec.serving.server import ServerThread, build_app
    from specdec.serving.tensor_parallel import StepMirror, follow

    executor_module.IDLE_SECONDS = idle / 4
    engine = SpecEngine(draft, target, config)
    if rank:
        return follow(engine), engine.all_blocks_free()
    mirror = StepMirror()
    with Executor(engine, mirror=mirror) as executor:
        srv = ServerThread(build_app(executor, "tiny")).start()
        try:
            time.sleep(idle)
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

            def ask(job: tuple) -> str:
                i, stream, temperature, seed = job
                kw = dict(model="tiny", prompt=prompts[i], max_tokens=16, temperature=temperature, seed=seed)
                if not stream:
                    return client.completions.create(**kw).choices[0].text
                return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)

            with ThreadPoolExecutor(len(jobs)) as pool:
                texts = list(pool.map(ask, jobs))
            chunks = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=200, stream=True)
            next(iter(chunks))  # a reader that leaves: the server aborts its request on every rank
            chunks.close()
            texts.append(ask(jobs[0]))  # the ranks still agree afterwards
        finally:
            srv.stop()
    return texts, mirror.sent, engine.all_blocks_free()


def pool_blocks(rank: int, size: int, model, budgets: list[int]) -> tuple[int, int]:
    """A tensor-parallel engine over ``model`` whose KV budget (``engine_setup.kv_budget``, on CUDA each rank's own
    free memory) is ``budgets[rank]``: (its pool's blocks, the blocks of one given the least budget outright)."""
    import specdec.engine as engine_module
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.loading.base import LoadedModel

    target = LoadedModel("tiny", model, None, model.config)
    least = SpecEngine(None, target, SpecConfig(tensor_parallel_size=size, block_size=4, kv_memory_bytes=min(budgets)))
    engine_module.kv_budget = lambda *args: budgets[rank]
    eng = SpecEngine(None, target, SpecConfig(tensor_parallel_size=size, block_size=4))
    return eng.pool.num_blocks, least.pool.num_blocks


def graphed_sharded_logits(rank: int, size: int, model, prompt: list[int], other: list[int]) -> tuple[float, float]:
    """This rank's part of ``model`` (moved to its GPU) captured in a CUDA graph, its all-reduces and all-gather
    inside: max |logits - the whole model's| for ``prompt`` (the captured run) and for ``other`` (the same length,
    copied into the graph's input and replayed)."""
    from specdec.models.tensor_parallel import TensorParallel, shard_model
    from specdec.training.dense_attention import dense_hidden

    whole = model.to("cuda").fuse()
    part = shard_model(whole, TensorParallel.current(size)).fuse()
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        part.compute_logits(dense_hidden(part, ids)[0])  # (warm-up: NCCL's communicator and the kernels, eagerly)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = part.compute_logits(dense_hidden(part, ids)[0])
        diffs = []
        for tokens in (prompt, other):
            ids.copy_(torch.tensor([tokens], device="cuda"))
            graph.replay()
            want = whole.compute_logits(dense_hidden(whole, ids)[0])
            diffs.append((out - want).abs().max().item())
    return diffs[0], diffs[1]


def epoch_choices(rank: int, size: int, agreed: bool) -> list[int]:
    """The budgets an ``EpochBudget`` holds over 200 steps of 16 rows where this rank measures its own step costs
    (rank 0: budget 7 the fastest; rank 1: budget 7 dearer, so 3), with each ended epoch's decisions agreed on
    rank 0's (``parallel.from_rank0``) when ``agreed``; the steps are test_epoch_budget's."""
    from functools import partial

    from test_epoch_budget import OPTIONS, rows_of, run

    from specdec.budget_policy import EpochBudget, EpochConfig
    from specdec.parallel import from_rank0

    config = EpochConfig(epoch_steps=4, epoch_rows=0, first_row_steps=0, hold_epochs=2)
    ctrl = EpochBudget(OPTIONS, config, agree=partial(from_rank0, size=size) if agreed else None)
    tok = {0: 1.0, 3: 1.6, 7: 2.0, 15: 2.2}
    ms = [{0: 1.0, 3: 1.3, 7: 1.4, 15: 2.0}, {0: 1.0, 3: 1.3, 7: 2.2, 15: 2.6}][rank]
    return run(ctrl, rows_of(16), tok.__getitem__, lambda n: ms[n] * 1e-3, 200)


def parts_placed(rank: int, size: int, model) -> tuple[set, set]:
    """``shard_models`` of a whole ``model`` on the CPU with ``device`` meta (a stand-in for this rank's GPU): the
    devices of the part's parameters, and of the whole model's after (untouched)."""
    from specdec.engine import SpecConfig
    from specdec.loading.base import LoadedModel
    from specdec.parallel import shard_models

    whole = LoadedModel("tiny", model, None, model.config)
    part, _ = shard_models(whole, None, SpecConfig(tensor_parallel_size=size, device="cpu"), torch.device("meta"))
    return {p.device.type for p in part.model.parameters()}, {p.device.type for p in model.parameters()}
