"""A CI-sized load test of the real server: many concurrent streaming clients of mixed lengths, some
disconnecting mid-stream. Every completed stream equals the same request run alone (greedy), nothing
fails except the deliberate disconnects, and no KV block leaks. bench/serve_load.py is the full size (its
small run is the last test here)."""

from __future__ import annotations

import time

import pytest
from serving_helpers import mixed_jobs, run_alone, run_concurrently, with_tokenizer

from specdec.drafters.ngram import ngram_lookup
from specdec.engine import SpecConfig, SpecEngine
from specdec.serving.executor import Executor
from specdec.serving.server import ServerThread, build_app

pytestmark = pytest.mark.usefixtures("single_thread")
NUM_CLIENTS = 40


# a small pool and batch cap, so requests queue, share the pool and get admitted as others finish; the n-gram
# engine looks chains up on the device (CPU: the padded step and the torch reference) with a pool small enough that
# requests are preempted and come back to history rows other requests used meanwhile; its steps are pipelined;
# target-only decoding pipelined (opt-in) under the same pressure
ENGINES = {"draft": dict(tree="chain:4", num_blocks=160, max_batch_size=16),
           "ngram_device": dict(tree="chain:4", num_blocks=40, max_batch_size=16, policy="max_utilization",
                                cuda_graphs=True, ngram_device=True, pipeline=True),
           "decode_pipelined": dict(num_blocks=40, max_batch_size=16, policy="max_utilization", cuda_graphs=True,
                                    pipeline=True)}
DRAFTS = {"ngram_device": "ngram", "decode_pipelined": None}  # else the tiny draft model


@pytest.fixture(scope="module", params=list(ENGINES))
def server(request, tiny_dirs, tiny_draft, tmp_path_factory):
    target = with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("load") / "llama")
    draft = DRAFTS.get(request.param, tiny_draft)
    engine = SpecEngine(draft, str(target), SpecConfig(**ENGINES[request.param]))
    preempted, checked = [], []
    preempt = engine.scheduler.preempt
    engine.scheduler.preempt = lambda req: preempted.append(req.request_id) or preempt(req)
    follow = engine.verifier.followup
    if draft == "ngram":  # after each commit, every device chain is what the host scan finds in the row's text
        committed = follow.committed

        def checking(rows):
            committed(rows)
            for req in rows:
                n, chain = follow.chains.get(req, (-1, None))
                if n == len(req.tokens):
                    checked.append(chain == ngram_lookup(req.tokens, follow.k))
        follow.committed = checking
    executor = Executor(engine)
    srv = ServerThread(build_app(executor, "tiny")).start()
    yield srv.url, executor, (preempted, checked)
    srv.stop()
    executor.shutdown()


def test_concurrent_streams_equal_requests_run_alone(server):
    url, executor, (preempted, checked) = server
    jobs = mixed_jobs(NUM_CLIENTS, seed=1, long_tokens=200)
    alone = run_alone(url, jobs)
    results, _ = run_concurrently(url, jobs)
    deliberate = [i for i, j in enumerate(jobs) if j.disconnect_after is not None]
    assert 2 <= len(deliberate) <= NUM_CLIENTS // 4
    for i, res in enumerate(results):
        assert res.status == 200 and res.error is None, (i, res)
        if i in deliberate:
            assert res.disconnected and res.finish_reason is None
        else:
            assert res.finish_reason in ("stop", "length") and res.text == alone[i], i
    deadline = time.monotonic() + 30
    while executor.run_on_loop(lambda e: e.scheduler.has_work):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert executor.run_on_loop(lambda e: e.all_blocks_free())
    assert max(s.num_waiting for s in executor.iteration_stats()) > 0  # the queue really filled
    follow, pipe = executor.run_on_loop(lambda e: (e.verifier.followup, e.pipeline))
    if pipe is not None:  # steps queued on the device, kept and dropped, through preemptions
        assert follow.launches > 100 and preempted and pipe.adopted > 50 and pipe.dropped > 0
    if hasattr(follow, "chains"):  # the n-gram engine: its lookups ran on the device, right
        assert len(checked) > 100 and all(checked)


def test_bench_serve_load_client_small(tmp_path):
    """bench/serve_load.py (the full-size load client, run as ``python -m bench.serve_load`` from the repository
    root) end to end at a small size: its checks pass and its report is written."""
    import json

    from bench.serve_load import main

    out = tmp_path / "load.json"
    assert main(["--target", "tiny", "--clients", "8", "--long-tokens", "16", "--threads", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["completed"] + report["disconnected"] == 8
