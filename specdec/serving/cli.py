"""``specdec serve`` (OpenAI-compatible server) and ``specdec bench-serve`` (load generator against one)."""

from __future__ import annotations

import sys

_MISSING = ("specdec serve needs fastapi, uvicorn and prometheus-client: pip install 'specdec[serve]' "
            "(missing: {})")


def add_serve_parsers(sub, add_model_args) -> None:
    """Register ``serve`` and ``bench-serve`` on the ``specdec`` subcommand parser."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)")
    s.add_argument("--target", default="smollm2-135m", help="target: smollm2-135m, a HF folder or a .gguf")
    s.add_argument("--draft", default="ngram", help="draft model name/path, 'ngram', or 'none' (target only)")
    s.add_argument("--tree", default="chain:4", help="chain:K | topk:WxD | dynamic:BUDGET")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: by memory)")
    s.add_argument("--max-batch-size", type=int, default=64)
    s.add_argument("--policy", default="guaranteed_no_evict", choices=["guaranteed_no_evict", "max_utilization"])
    s.add_argument("--no-prefix-cache", action="store_true")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that sets none (completions: 16, as OpenAI)")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse (413) request bodies longer than this, before parsing them (default: 2 MiB)")
    s.add_argument("--log-level", default="info")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-serve", help="benchmark a running server: Poisson arrivals, TTFT/TPOT/latency")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    b.add_argument("--dataset", default="sharegpt", help="sharegpt (evaluation split), mtbench or PATH.jsonl")
    b.add_argument("--num-prompts", type=int, default=100)
    b.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    b.add_argument("--concurrency", type=int, default=64, help="at most this many requests in flight")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    b.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per request")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    b.add_argument("--label", default=None, help="a name for this run in the JSON")
    b.add_argument("--json", default=None, help="write the full report here")
    b.set_defaults(func=cmd_bench_serve)


def cmd_serve(args) -> int:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not _importable(m)]
    if missing:
        print(_MISSING.format(", ".join(missing)), file=sys.stderr)
        return 2
    import uvicorn

    from specdec.cli.checks import UsageError, build
    from specdec.cli.common import device_dtype
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.serving.executor import Executor
    from specdec.serving.server import DEFAULT_MAX_REQUEST_BYTES, build_app

    device, dtype = device_dtype(args)
    cfg = build(SpecConfig, tree=args.tree, device=device, dtype=dtype, num_blocks=args.num_blocks,
                max_batch_size=args.max_batch_size, policy=args.policy, prefix_cache=not args.no_prefix_cache)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UsageError("--max-request-bytes", f"must be an int >= 1, got {args.max_request_bytes}")
    draft = None if args.draft == "none" else args.draft
    engine = SpecEngine(draft, args.target, cfg)
    name = args.served_model_name or args.target
    with Executor(engine) as executor:
        app = build_app(executor, name, default_chat_max_tokens=args.default_max_tokens,
                        max_request_bytes=DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None
                        else args.max_request_bytes)
        print(f"serving {name!r} (draft {args.draft}, tree {args.tree}, {engine.pool.num_blocks} KV blocks) "
              f"on http://{args.host}:{args.port}", file=sys.stderr)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_bench_serve(args) -> int:
    from specdec.serving.bench_client import BenchServeConfig, print_report, run_bench

    cfg = BenchServeConfig(url=args.url, dataset=args.dataset, num_prompts=args.num_prompts,
                           request_rate=args.request_rate, concurrency=args.concurrency, max_tokens=args.max_tokens,
                           temperature=args.temperature, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
                           seed=args.seed, label=args.label)
    report = run_bench(cfg)
    print_report(report)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None

