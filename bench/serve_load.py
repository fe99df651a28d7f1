"""Load test of the OpenAI-compatible server on this machine (CPU): N concurrent streaming clients of
mixed lengths, 10% disconnecting mid-stream. Checks that every completed stream's text equals the same
request run alone (greedy), that nothing failed except the deliberate disconnects and that no KV
block leaked; reports requests/s and TTFT p50/p99.

    python -m bench.serve_load --target tiny --clients 200 --json out.json      (from the repository root)
    python -m bench.serve_load --target smollm2-135m --draft ngram --clients 200

The server runs in this process (uvicorn in a thread) so the engine's allocator can be checked after. The
clients and the tiny model come from the test helpers (tests/serving_helpers.py, tests/conftest.py), imported
as ``tests.*`` from the repository root; tests/test_serving_load.py runs a small load through ``main``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.serving_helpers import mixed_jobs, percentile, run_alone, run_concurrently, with_tokenizer


def _models(target: str, draft: str, dtype: str):
    """(draft, target) arguments of SpecEngine; 'tiny' makes a random 3-layer Llama with a byte tokenizer."""
    import torch

    from specdec.loading.registry import load_model, truncate_layers

    if target == "tiny":
        from tests.conftest import save_tiny

        tmp = Path(tempfile.mkdtemp(prefix="serve_load_"))
        save_tiny(tmp / "raw", "llama", seed=0, num_hidden_layers=3, eos_token_id=193)
        target = str(with_tokenizer(tmp / "raw", tmp / "tiny"))
    loaded = load_model(target, dtype=getattr(torch, dtype))
    if draft.startswith("truncate:"):
        return truncate_layers(loaded, int(draft.split(":")[1])), loaded
    return (None if draft == "none" else draft), loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny", help="tiny, smollm2-135m, a HF folder or a .gguf")
    ap.add_argument("--draft", default="truncate:2", help="ngram, none, truncate:N (the target's first N layers) "
                                                          "or a draft path")
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=128, help="max_tokens of the disconnecting clients")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from specdec.engine import SpecConfig, SpecEngine
    from specdec.serving.executor import Executor
    from specdec.serving.server import ServerThread, build_app

    torch.set_num_threads(args.threads)
    draft, target = _models(args.target, args.draft, "float32")
    cfg = SpecConfig(tree=args.tree, num_blocks=args.num_blocks, max_batch_size=args.max_batch_size)
    executor = Executor(SpecEngine(draft, target, cfg))
    srv = ServerThread(build_app(executor, "model")).start()
    try:
        jobs = mixed_jobs(args.clients, seed=args.seed, long_tokens=args.long_tokens)
        t0 = time.perf_counter()
        alone = run_alone(srv.url, jobs)
        alone_s = time.perf_counter() - t0
        steps_before = executor.iteration_stats()[-1].step
        results, wall = run_concurrently(srv.url, jobs)
        report = _check(jobs, results, alone, wall, executor)
        report.update(alone_seconds=alone_s, target=args.target, draft=args.draft, tree=args.tree,
                      clients=args.clients, num_blocks=args.num_blocks, max_batch_size=args.max_batch_size,
                      engine_steps=executor.iteration_stats()[-1].step - steps_before)
    finally:
        srv.stop()
        executor.shutdown()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def _check(jobs, results, alone, wall, executor) -> dict:
    deliberate = {i for i, j in enumerate(jobs) if j.disconnect_after is not None}
    errors = [(i, r.status, r.error) for i, r in enumerate(results) if r.status != 200 or r.error]
    completed = [i for i in range(len(jobs)) if i not in deliberate]
    mismatches = [i for i in completed if results[i].text != alone[i] or results[i].finish_reason is None]
    not_cut = [i for i in deliberate if not results[i].disconnected]
    deadline = time.monotonic() + 60
    while executor.run_on_loop(lambda e: e.scheduler.has_work) and time.monotonic() < deadline:
        time.sleep(0.05)
    free = executor.run_on_loop(lambda e: e.all_blocks_free())
    ttft = [results[i].ttft for i in completed if results[i].ttft is not None]
    stats = executor.iteration_stats()
    return {
        "ok": not errors and not mismatches and not not_cut and free,
        "completed": len(completed), "disconnected": len(deliberate), "errors": errors[:5],
        "mismatches": mismatches, "all_blocks_free": free, "wall_seconds": wall,
        "requests_per_s": len(completed) / wall,
        "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
        "max_queue_length": max(s.num_waiting for s in stats), "max_batch": max(s.batch_size for s in stats),
    }


if __name__ == "__main__":
    sys.exit(main())
