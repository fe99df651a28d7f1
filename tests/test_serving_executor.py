"""Executor: requests from threads and from asyncio, cancel, per-iteration statistics, and failures that
end one request (or one step's requests) while the loop and the other requests go on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.serving import executor as executor_module
from specdec.serving.executor import EngineStepError, Executor

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 140)), [3] * 20]
PARAMS = SamplingParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny_target):
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64))
    return [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]


@pytest.fixture()
def executor(tiny_target, tiny_draft):
    ex = Executor(SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=96)))
    yield ex
    ex.shutdown()
    assert not ex.alive


def test_threads_get_their_own_outputs(executor, reference):
    results = {}

    def client(i):
        rid = executor.enqueue(PROMPTS[i], PARAMS)
        outs = list(executor.stream(rid, timeout=60))
        results[i] = outs

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in results.items():
        ack, final = outs[0], outs[-1]
        assert ack.prompt_token_ids == PROMPTS[i] and not ack.new_token_ids and not ack.finished
        assert final.token_ids == reference[i]
        assert sum((o.new_token_ids for o in outs), []) == reference[i]
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


def test_asyncio_and_cancel(executor, reference):
    async def main():
        ids = [executor.enqueue(p, PARAMS) for p in PROMPTS]
        long = executor.enqueue(PROMPTS[0], SamplingParams(max_new_tokens=300, ignore_eos=True))
        seen = []
        async for out in executor.astream(long):
            seen.append(out)
            if len(seen) == 3:
                executor.cancel(long)
        finals = await asyncio.gather(*(executor.aresult(i) for i in ids))
        return seen[-1], finals

    last, finals = asyncio.run(main())
    assert last.finish_reason == "abort" and len(last.token_ids) < 300
    assert [f.token_ids for f in finals] == reference
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


def test_iteration_stats(executor, reference):
    ids = [executor.enqueue(p, PARAMS) for p in PROMPTS]
    finals = [executor.result(i, timeout=60) for i in ids]
    stats = executor.iteration_stats()
    assert sum(s.new_tokens for s in stats) == sum(len(f.token_ids) for f in finals)
    assert max(s.batch_size for s in stats) > 1  # requests were batched
    assert sum(s.num_prefill for s in stats) >= len(PROMPTS)
    assert sum(s.drafted for s in stats) == sum(f.stats.drafted for f in finals)
    assert sum(s.accepted for s in stats) == sum(f.stats.accepted for f in finals)
    assert all(s.kv_blocks_total == 96 and 0 <= s.kv_blocks_used <= 96 for s in stats)
    assert max(s.kv_blocks_used for s in stats) > 0
    assert stats[-1].num_running == 0 and stats[-1].num_waiting == 0


def test_a_bad_request_fails_alone(executor, reference):
    bad = executor.enqueue([999_999], PARAMS)  # token id outside the vocabulary
    good = executor.enqueue(PROMPTS[1], PARAMS)
    out = executor.result(bad, timeout=60)
    assert out.finish_reason == "error" and "vocabulary" in str(out.error)
    assert executor.result(good, timeout=60).token_ids == reference[1]


def test_an_output_error_fails_only_that_request(executor, reference, monkeypatch):
    real = executor_module.request_output

    def flaky(req, stopper):
        if req.request_id == "victim" and req.num_output >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req, stopper)

    monkeypatch.setattr(executor_module, "request_output", flaky)
    ids = [executor.enqueue(p, PARAMS) for p in PROMPTS]
    victim = executor.enqueue(PROMPTS[2], PARAMS, request_id="victim")
    out = executor.result(victim, timeout=60)
    assert out.finish_reason == "error" and isinstance(out.error, UnicodeDecodeError)
    assert [executor.result(i, timeout=60).token_ids for i in ids] == reference
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


def test_a_failed_step_fails_its_requests_and_the_loop_lives_on(executor, reference, monkeypatch):
    engine = executor.engine
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    first = [executor.enqueue(p, PARAMS) for p in PROMPTS]
    outs = [executor.result(i, timeout=60) for i in first]
    assert all(o.finish_reason == "error" and isinstance(o.error, EngineStepError) for o in outs)
    assert executor.alive
    later = executor.enqueue(PROMPTS[3], PARAMS)
    assert executor.result(later, timeout=60).token_ids == reference[3]
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


def test_duplicate_request_id_is_refused(executor):
    executor.enqueue(PROMPTS[0], PARAMS, request_id="x")
    with pytest.raises(ValueError, match="request_id"):
        executor.enqueue(PROMPTS[0], PARAMS, request_id="x")
    assert executor.result("x", timeout=60).finished


def test_shutdown_ends_live_requests_and_refuses_new_ones(tiny_target):
    ex = Executor(SpecEngine(None, tiny_target, SpecConfig(num_blocks=64)))
    rid = ex.enqueue(PROMPTS[0], SamplingParams(max_new_tokens=400, ignore_eos=True))
    outputs = ex.stream(rid, timeout=60)
    next(outputs)  # admitted
    ex.shutdown()
    assert list(outputs)[-1].finish_reason == "abort"
    assert ex.engine.all_blocks_free()
    with pytest.raises(RuntimeError, match="shut down"):
        ex.enqueue(PROMPTS[0], PARAMS)


def test_a_fault_in_one_row_of_a_batch_fails_only_that_request(executor, reference, monkeypatch):
    """The engine isolates a forward that raises for one row; through the executor only that request
    ends with an error, and the batch's other requests finish with their reference tokens."""
    verifier = executor.engine.verifier
    real_verify = verifier.verify

    def verify(rows, *args, **kwargs):
        if any(r.request_id == "victim" and r.num_output >= 2 for r in rows):
            raise FloatingPointError("injected fault in the victim's row")
        return real_verify(rows, *args, **kwargs)

    monkeypatch.setattr(verifier, "verify", verify)
    ids = [executor.enqueue(p, PARAMS) for p in PROMPTS]
    victim = executor.enqueue(PROMPTS[2], PARAMS, request_id="victim")
    out = executor.result(victim, timeout=60)
    assert out.finish_reason == "error" and "injected" in str(out.error)
    assert [executor.result(i, timeout=60).token_ids for i in ids] == reference
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


def test_a_server_freezes_its_startup_heap_before_it_serves(monkeypatch):
    """``specdec serve``'s last step before uvicorn runs: every object alive then (engine, models, libraries) is
    frozen out of the collector's view, so an oldest-generation collection in a long-running server does not scan
    them (a full collection of them took ~0.2 s on a 2-core CPU: a stall of every stream)."""
    import gc
    from types import SimpleNamespace

    import uvicorn

    from specdec.serving import cli

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(gc.get_freeze_count()))
    marker = [object() for _ in range(1000)]  # alive before the server starts: must be frozen
    args = SimpleNamespace(served_model_name=None, model="tiny", default_max_tokens=16, max_request_bytes=None,
                           draft="none", tree="chain:1", host="127.0.0.1", port=0, log_level="warning", api_key=None)
    gc.unfreeze()
    try:
        cli._run_server(SimpleNamespace(add_stats_listener=lambda fn: None, load=None), args, None, "stand-ins")
        assert len(seen) == 1 and seen[0] >= len(marker)
    finally:
        gc.unfreeze()  # (the test process goes on collecting)
    assert gc.get_freeze_count() == 0 and marker
