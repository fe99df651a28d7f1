"""``specdec serve`` (OpenAI-compatible server) and ``specdec bench-serve`` (load generator against one)."""

from __future__ import annotations

import dataclasses
import os
import sys

from specdec.defaults import DEFAULT_TARGET, MAX_NUM_TOKENS

ENDPOINT_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}  # vllm bench serve --endpoint
# after SIGTERM (or Ctrl-C), how long `specdec serve` lets in-flight requests finish before it aborts them and
# exits: without a bound, a half-sent body or a long stream kept the process alive indefinitely. 10 s lets a
# typical non-streamed request finish and stays well inside the 30 s a container runtime (Kubernetes'
# terminationGracePeriodSeconds) waits before SIGKILL, leaving time to stop the engine and its replicas.
GRACEFUL_SHUTDOWN_S = 10

_MISSING = ("specdec serve needs fastapi, uvicorn and prometheus-client: pip install 'specdec[serve]' "
            "(missing: {})")


def add_serve_parsers(sub, add_model_args) -> None:
    """Register ``serve`` and ``bench-serve`` on the ``specdec`` subcommand parser."""
    from specdec.cli.bench import TREE_HELP
    from specdec.cli.common import TARGET_HELP, add_max_tokens_arg, add_target_arg
    from specdec.cli.parallel import add_parallel_args
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)")
    s.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the target, as in `vllm serve MODEL` (the same as --model)")
    add_target_arg(s, default=None, help=f"{TARGET_HELP} (default: MODEL, else {DEFAULT_TARGET})")
    s.add_argument("--draft", default=None,
                   help="draft model name/path, 'ngram', or 'none' (default: the shipped draft, else ngram)")
    s.add_argument("--tree", default=None, help=TREE_HELP)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model)")
    s.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: by --gpu-memory-utilization on cuda, 256 MiB on cpu)")
    s.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=64,
                   help="most requests running at once")
    s.add_argument("--max-num-batched-tokens", "--max-num-tokens", dest="max_num_tokens", type=int,
                   default=MAX_NUM_TOKENS,
                   help="most prompt tokens prefilled in one step (lower: a long prompt holds running requests up "
                        "for less time a step, and takes more steps)")
    s.add_argument("--policy", default="guaranteed_no_evict", choices=["guaranteed_no_evict", "max_utilization"],
                   help="KV admission: admit only what can finish, or greedily with preemption by recompute")
    s.add_argument("--no-prefix-cache", action="store_true", help="turn off prefix reuse across requests")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a chat request that sets none (completions: 16, as OpenAI), lowered "
                        "to the room its prompt leaves")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse (413) request bodies longer than this, before parsing them (default: 2 MiB)")
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every request (401 without it; /health, /metrics "
                        "and /version stay open) (default: $SPECDEC_API_KEY, else no key)")
    s.add_argument("--log-level", default="info", help="uvicorn's log level")
    add_parallel_args(s)
    add_model_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench-serve", help="benchmark a running server: Poisson arrivals, TTFT/TPOT/latency "
                                           "(flag names as in `vllm bench serve`)")
    b.add_argument("--base-url", "--url", dest="url", default="http://127.0.0.1:8000", help="the server's base URL")
    b.add_argument("--model", default=None, help="the served model id to ask for (default: the server's only one)")
    b.add_argument("--dataset-name", "--dataset", dest="dataset", default="sharegpt",
                   help="sharegpt (evaluation split), mtbench or PATH.jsonl")
    b.add_argument("--dataset-path", default=None, help="a .jsonl prompt file (default: none, --dataset-name's data)")
    b.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    b.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    b.add_argument("--max-concurrency", "--concurrency", dest="concurrency", type=int, default=64,
                   help="at most this many requests in flight")
    add_max_tokens_arg(b, 128)
    b.add_argument("--temperature", type=float, default=0.0, help="temperature of each request (0 = greedy)")
    b.add_argument("--endpoint", default="chat", choices=["chat", "completions", *ENDPOINT_PATHS],
                   help="chat (/v1/chat/completions) or completions (/v1/completions)")
    b.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per request")
    b.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    b.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may wait for the server's next bytes; then it counts as failed")
    b.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="the key of a server started with --api-key, sent as 'Authorization: Bearer KEY' "
                        "(default: $OPENAI_API_KEY, else none)")
    b.add_argument("--label", default=None, help="a name for this run in the JSON (default: none)")
    b.add_argument("--json", default=None, help="write the full report here (default: not written)")
    b.add_argument("--save-result", action="store_true",
                   help="write the report to --result-dir/--result-filename (as vllm bench serve)")
    b.add_argument("--result-dir", default=".", help="folder of --save-result")
    b.add_argument("--result-filename", default=None,
                   help="file name of --save-result (default: bench-serve-LABEL-YYYYMMDD-HHMMSS.json)")
    b.set_defaults(func=cmd_bench_serve)


def cmd_serve(args) -> int:
    """Check every argument and bind the port, then load the models (in each replica's process with
    --data-parallel-size M > 1) and serve on the bound socket."""
    from specdec.cli.checks import UsageError, build, check_model, check_positive, load
    from specdec.cli.common import device_dtype
    from specdec.cli.parallel import check_parallel
    from specdec.defaults import default_draft, default_tree
    from specdec.engine import SpecConfig, SpecEngine

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not _importable(m)]
    if missing:
        raise UsageError("serve", _MISSING.format(", ".join(missing)))
    args.model = serve_model(args)
    device, dtype = device_dtype(args)  # every argument is checked before a model loads
    check_parallel(args, device, "serve")
    args.draft = args.draft or default_draft(args.model, device)
    args.tree = args.tree or default_tree(args.draft, device)
    check_positive("--default-max-tokens", args.default_max_tokens)
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UsageError("--max-request-bytes", f"must be an int >= 1, got {args.max_request_bytes}")
    cfg = build(SpecConfig, tree=args.tree, device=device, dtype=dtype, num_blocks=args.num_blocks,
                max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, policy=args.policy,
                prefix_cache=not args.no_prefix_cache,
                gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size)
    check_model("--model", args.model)
    check_model("--draft", args.draft, extra=("ngram", "none"))
    if args.tensor_parallel_size > 1 and args.data_parallel_size == 1:
        return _serve_tensor_parallel(cfg, args, dtype)
    sock = bind_socket(args.host, args.port)
    if args.data_parallel_size > 1:
        try:
            _serve_replicas(cfg, args, sock)
        finally:
            sock.close()
        return 0
    try:
        target = load("--model", args.model, dtype, device)
        draft = args.draft if args.draft in ("ngram", "none") else load("--draft", args.draft, dtype, device,
                                                                          target=target)
        engine = SpecEngine(None if draft == "none" else draft, target, cfg)
        _serve(engine, args, sock)
    finally:
        sock.close()
    return 0


def _serve_tensor_parallel(cfg, args, dtype: str) -> int:
    """--tensor-parallel-size N: N rank processes (this command run again in each); rank 0 binds the port and
    serves, its executor sending every add, abort and step to the other ranks, which apply them to their engines
    (``serving.tensor_parallel``)."""
    import torch.distributed as dist

    from specdec.cli.checks import load
    from specdec.cli.parallel import build_engine, start_tensor_parallel
    from specdec.engine_setup import load_device
    from specdec.parallel import control_group
    from specdec.serving.executor import Executor, frozen_startup_heap
    from specdec.serving.tensor_parallel import StepMirror, follow

    code = start_tensor_parallel(args, args.model, args.draft)  # the ranks run this command; None: one of them
    if code is not None:
        return code
    sock = bind_socket(args.host, args.port) if dist.get_rank() == 0 else None
    try:
        on = load_device(args.tensor_parallel_size, cfg.device)
        target = load("--model", args.model, dtype, on)
        draft = args.draft if args.draft in ("ngram", "none") else load("--draft", args.draft, dtype, on,
                                                                          target=target)
        engine = build_engine(None if draft == "none" else draft, target, cfg)
        group = control_group(args.tensor_parallel_size)  # (gloo: the operations do not wait for the GPUs)
        if sock is None:
            with frozen_startup_heap():
                follow(engine, group)
            return 0
        with Executor(engine, mirror=StepMirror(group)) as executor:
            _run_server(executor, args, sock, f"{engine.pool.num_blocks} KV blocks on each of "
                                              f"{args.tensor_parallel_size} tensor-parallel ranks")
    finally:
        if sock is not None:
            sock.close()
    return 0


def serve_model(args) -> str:
    """The target of ``specdec serve [MODEL] [--model M]``: either form (not two different ones), else the
    default target."""
    from specdec.cli.checks import UsageError

    if args.model_arg and args.model and args.model_arg != args.model:
        raise UsageError("--model", f"the model is given twice: {args.model_arg!r} (MODEL) and {args.model!r}")
    return args.model_arg or args.model or DEFAULT_TARGET


def _serve(engine, args, sock) -> None:
    from specdec.serving.executor import Executor

    with Executor(engine) as executor:
        _run_server(executor, args, sock, f"{engine.pool.num_blocks} KV blocks")


def _serve_replicas(cfg, args, sock) -> None:
    """--data-parallel-size M: M engine processes (replica i on cuda:i, or all on the CPU with its cores shared)
    behind one server; with --tensor-parallel-size N each replica is a group of N ranks (replica i on GPUs
    i * N .. i * N + N - 1), whose rank 0 the server talks to."""
    from dataclasses import replace

    from specdec.cli.common import cpu_threads
    from specdec.cli.parallel import check_split_before_loading
    from specdec.serving.data_parallel import DataParallelExecutor
    from specdec.serving.replica_process import EngineRecipe, start_replicas

    size, tp, cuda = args.data_parallel_size, args.tensor_parallel_size, cfg.device.startswith("cuda")
    check_split_before_loading("--model", args.model, tp)  # (a model that does not split: a UsageError now)
    check_split_before_loading("--draft", args.draft, tp)
    threads = None if cuda else max(1, cpu_threads(args.threads) // (size * tp))
    draft = None if args.draft == "none" else args.draft
    recipes = [EngineRecipe(draft, args.model, replace(cfg, device=f"cuda:{i * tp}" if cuda else cfg.device), threads)
               for i in range(size)]
    print(f"starting {size} replicas ...", file=sys.stderr)
    replicas = start_replicas(recipes)  # (a replica that fails to start raises with its traceback)
    with DataParallelExecutor(replicas, replicas[0].info.block_size) as executor:
        blocks = " + ".join(str(r.info.num_blocks) for r in replicas)
        _run_server(executor, args, sock, f"{size} replicas on {', '.join(r.info.device for r in replicas)}, "
                                          f"{blocks} KV blocks")


def _run_server(executor, args, sock, what: str) -> None:
    import uvicorn

    from specdec.serving.executor import frozen_startup_heap
    from specdec.serving.server import DEFAULT_MAX_REQUEST_BYTES, build_app

    name = args.served_model_name or args.model
    app = build_app(executor, name, default_chat_max_tokens=args.default_max_tokens, api_key=args.api_key,
                    max_request_bytes=DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None
                    else args.max_request_bytes)
    drafting = "target-only" if args.draft == "none" else f"draft {args.draft}, tree {args.tree}"
    print(f"serving {name!r} ({drafting}, {what}) on http://{args.host}:{args.port}", file=sys.stderr)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    with frozen_startup_heap():
        uvicorn.Server(config).run(sockets=[sock])


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
    from specdec.benchmark.report import write_json
    from specdec.cli.bench import check_output_path, write_report
    from specdec.cli.checks import UsageError, build, check_dataset
    from specdec.serving.bench_client import BenchServeConfig, print_report, run_bench

    if not _importable("httpx"):
        raise UsageError("bench-serve", "needs httpx: pip install 'specdec[serve]'")
    dataset = args.dataset_path or args.dataset
    cfg = build(BenchServeConfig, url=args.url, dataset=dataset, num_prompts=args.num_prompts,
                request_rate=args.request_rate, concurrency=args.concurrency, max_tokens=args.max_new_tokens,
                temperature=args.temperature, endpoint=ENDPOINT_PATHS.get(args.endpoint, args.endpoint),
                ignore_eos=args.ignore_eos, seed=args.seed, label=args.label, api_key=args.api_key,
                request_timeout=args.request_timeout)  # (its ranges, each error naming its flag)
    if args.dataset_path and not args.dataset_path.endswith(".jsonl"):
        raise UsageError("--dataset-path", f"must be a .jsonl prompt file, got {args.dataset_path!r}")
    check_dataset("--dataset-path" if args.dataset_path else "--dataset-name", dataset, DATASET_NAMES)
    outputs = [("--json", args.json)] + ([("--result-dir", result_path(args))] if args.save_result else [])
    for flag, path in outputs:
        check_output_path(flag, path)
    cfg = dataclasses.replace(cfg, model=check_server("--base-url", args.url, args.model, api_key=args.api_key))
    report = run_bench(cfg)
    print_report(report)
    for flag, path in outputs:
        if path:
            write_report(flag, path, lambda to: write_json(report, to, allow_nan=True))  # (rate inf: Infinity)
            print(f"report written to {path}", file=sys.stderr)
    return 0 if report["failed"] == 0 else 1


def result_path(args) -> str:
    """Where ``--save-result`` writes: --result-dir / (--result-filename or a name with the label and time)."""
    import time
    from pathlib import Path

    name = args.result_filename or f"bench-serve-{args.label or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return str(Path(args.result_dir) / name)


def check_server(flag: str, url: str, model: str | None = None, timeout_s: float = 10.0,
                 api_key: str | None = None) -> str:
    """An OpenAI-compatible server answers ``GET url/v1/models`` (listing ``model`` when given; with ``api_key``
    sent as a bearer token): the model to ask for, ``model`` or else the first listed; UsageError naming ``flag``
    (--api-key when the server refuses the key, --model) otherwise."""
    import httpx

    from specdec.cli.checks import UsageError
    from specdec.serving.bench_client import auth_headers

    headers = auth_headers(api_key)
    try:
        reply = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout_s, headers=headers)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise UsageError(flag, f"nothing answers at {url!r} ({type(err).__name__}: {err}); start a server "
                               f"first (`specdec serve MODEL`) or give its address") from None
    if reply.status_code == 401:
        raise UsageError("--api-key", f"{url!r} wants an API key{' other than the one given' if api_key else ''}: "
                                      "give the server's with --api-key or $OPENAI_API_KEY")
    try:
        models = [m["id"] for m in reply.json()["data"]] if reply.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        models = None
    if not models:
        raise UsageError(flag, f"{url!r} is not an OpenAI-compatible server: GET /v1/models answered "
                               f"{reply.status_code} without a model list")
    if model is not None and model not in models:
        raise UsageError("--model", f"{model!r} is not served at {url!r}, which serves {models}")
    return model or models[0]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None

