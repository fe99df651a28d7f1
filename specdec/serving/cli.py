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
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    s.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: by memory)")
    s.add_argument("--max-batch-size", type=int, default=64, help="most requests running at once")
    s.add_argument("--policy", default="guaranteed_no_evict", choices=["guaranteed_no_evict", "max_utilization"],
                   help="KV admission: admit only what can finish, or greedily with preemption by recompute")
    s.add_argument("--no-prefix-cache", action="store_true", help="turn off prefix reuse across requests")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that sets none (completions: 16, as OpenAI)")
    s.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-serve", help="benchmark a running server: Poisson arrivals, TTFT/TPOT/latency")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    b.add_argument("--dataset", default="sharegpt", help="sharegpt (evaluation split), mtbench or PATH.jsonl")
    b.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    b.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    b.add_argument("--concurrency", type=int, default=64, help="at most this many requests in flight")
    b.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request")
    b.add_argument("--temperature", type=float, default=0.0, help="temperature of each request (0 = greedy)")
    b.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions or /v1/completions")
    b.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per request")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    b.add_argument("--label", default=None, help="a name for this run in the JSON (default: none)")
    b.add_argument("--json", default=None, help="write the full report here (default: not written)")
    b.set_defaults(func=cmd_bench_serve)


def cmd_serve(args) -> int:
    """Check every argument and bind the port, then load the models and serve on the bound socket."""
    from specdec.cli.checks import UsageError, build, check_model, check_positive, load
    from specdec.cli.common import device_dtype
    from specdec.engine import SpecConfig, SpecEngine

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not _importable(m)]
    if missing:
        raise UsageError("serve", _MISSING.format(", ".join(missing)))
    device, dtype = device_dtype(args)  # every argument is checked before a model loads
    check_positive("--default-max-tokens", args.default_max_tokens)
    cfg = build(SpecConfig, tree=args.tree, device=device, dtype=dtype, num_blocks=args.num_blocks,
                max_batch_size=args.max_batch_size, policy=args.policy, prefix_cache=not args.no_prefix_cache)
    check_model("--target", args.target)
    check_model("--draft", args.draft, extra=("ngram", "none"))
    sock = bind_socket(args.host, args.port)
    try:
        target = load("--target", args.target, dtype, device)
        draft = args.draft if args.draft in ("ngram", "none") else load("--draft", args.draft, dtype, device,
                                                                          target=target)
        engine = SpecEngine(None if draft == "none" else draft, target, cfg)
        _serve(engine, args, sock)
    finally:
        sock.close()
    return 0


def _serve(engine, args, sock) -> None:
    import uvicorn

    from specdec.serving.executor import Executor
    from specdec.serving.server import build_app

    name = args.served_model_name or args.target
    with Executor(engine) as executor:
        app = build_app(executor, name, default_chat_max_tokens=args.default_max_tokens)
        print(f"serving {name!r} (draft {args.draft}, tree {args.tree}, {engine.pool.num_blocks} KV blocks) "
              f"on http://{args.host}:{args.port}", file=sys.stderr)
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])


def bind_socket(host: str, port: int):
    """A listening TCP socket on ``host:port``; UsageError naming --port (out of range, in use) or --host."""
    import socket

    from specdec.cli.checks import UsageError

    if not 1 <= port <= 65535:
        raise UsageError("--port", f"must be in [1, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise UsageError("--host", f"{host!r} is not an address of this machine ({err.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise UsageError("--port", f"cannot listen on {host}:{port} ({err.strerror}); is another server "
                                   f"running there? Pick another --port") from None
    return sock


def cmd_bench_serve(args) -> int:
    from specdec.benchmark.data import DATASET_NAMES
    from specdec.cli.checks import UsageError, check_dataset, check_positive
    from specdec.serving.bench_client import BenchServeConfig, print_report, run_bench

    if not _importable("httpx"):
        raise UsageError("bench-serve", "needs httpx: pip install 'specdec[serve]'")
    for flag, value in (("--num-prompts", args.num_prompts), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        check_positive(flag, value)
    if not args.request_rate > 0:
        raise UsageError("--request-rate", f"must be > 0 (inf = all at once), got {args.request_rate}")
    check_dataset("--dataset", args.dataset, DATASET_NAMES)
    check_server("--url", args.url)
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


def check_server(flag: str, url: str, timeout_s: float = 10.0) -> None:
    """An OpenAI-compatible server answers ``GET url/v1/models``; UsageError naming ``flag`` otherwise."""
    import httpx

    from specdec.cli.checks import UsageError

    try:
        reply = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s)
        models = reply.json()["data"] if reply.status_code == 200 else None
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise UsageError(flag, f"nothing answers at {url!r} ({type(err).__name__}: {err}); start a server "
                               f"first (`specdec serve`) or give its address") from None
    except (ValueError, KeyError, TypeError):
        models = None
    if not models:
        raise UsageError(flag, f"{url!r} is not an OpenAI-compatible server: GET /v1/models answered "
                               f"{reply.status_code} without a model list")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None

