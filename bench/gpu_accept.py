"""Device-side stochastic acceptance on the GPU: correctness against the CPU and inside a CUDA graph, and its cost.

    python -P bench/gpu_accept.py OUT_DIR

Checks (exit status 1 if one fails): the GPU gives the CPU's outcomes (>= 99% of rows identical: float rounding
may flip a coin that lands on a threshold), and a captured CUDA graph of ``accept_stochastic_padded``, replayed
with new logits and uniforms copied into its inputs, gives the eager result exactly. Timing: milliseconds per
call for the eager rule, the replayed graph, the host preparation (pad_trees + sampling_rows + draw_uniforms)
and, for comparison, the host rule ``verify_stochastic`` row by row, at SmolLM2's vocabulary (49152) for several
batch sizes and trees. Writes OUT_DIR/gpu_accept.json and prints a table. On a CPU it runs tiny sizes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from specdec.acceptance import shape_probs, verify_stochastic
from specdec.acceptance_stochastic import accept_stochastic_padded, draw_uniforms, pad_trees, sampling_rows
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree, template_from_spec
from specdec.uniform_stream import UniformStream

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
VOCAB = 49152 if CUDA else 512
BATCHES = (1, 8, 32, 64) if CUDA else (1, 4)
TREES = {"chain:4": "iid", "topk:2x3": "without_replacement", "topk:4x2": "deterministic",
         "chain:63": "iid"} if CUDA else {"chain:4": "iid", "topk:2x2": "without_replacement"}
PARAMS = SamplingParams(temperature=0.8, top_p=0.95)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def make_batch(spec: str, mode: str, b: int, vocab: int, seed: int):
    """B trees of one template with tokens the target likes, target logits (B, Q, V) and draft dists."""
    parents = list(template_from_spec(spec).template().parents)
    n, q = len(parents), 1 << len(parents).bit_length()  # Q: the power of two above n
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(b, q, vocab, generator=g)
    trees = []
    for row in range(b):
        tokens, used = [], {}
        for p in parents:  # siblings: distinct tokens, boosted at the parent so paths get deep
            t = int(torch.randint(0, vocab, (1,), generator=g)) if mode != "without_replacement" else \
                next(x for x in torch.randperm(vocab, generator=g)[:8].tolist() if x not in used.setdefault(p, set()))
            used.setdefault(p, set()).add(t)
            tokens.append(t)
            logits[row, p + 1, t] += 6.0
        if mode == "deterministic":
            trees.append(DraftTree.from_parents(tokens, parents, device=DEV))
        else:
            dists = torch.softmax(logits[row, :n + 1] + torch.randn(n + 1, vocab, generator=g), -1)
            trees.append(DraftTree.from_parents(tokens, parents, dists, [p + 1 for p in parents], mode, device=DEV))
    return trees, logits, q


def inputs(trees, logits, q, seed: int, device: str):
    streams = [UniformStream(seed + i) for i in range(len(trees))]
    u = draw_uniforms(streams, [t.to("cpu") for t in trees], q, "cpu")
    return logits.to(device), pad_trees([t.to(device) for t in trees], q, device), \
        sampling_rows([PARAMS] * len(trees), device), u.to(device)


def timed(fn, reps: int) -> float:
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps * 1e3


def check_cpu(results: dict) -> bool:
    trees, logits, q = make_batch("topk:2x2", "without_replacement", 48, 64, 1)
    cpu = accept_stochastic_padded(*inputs(trees, logits, q, 3, "cpu"))
    dev = accept_stochastic_padded(*inputs(trees, logits, q, 3, DEV)).cpu()
    same = (cpu == dev).all(1).float().mean().item()
    results["gpu_equals_cpu_rows"] = same
    print(f"GPU == CPU on {same:.1%} of rows (need >= 99%)")
    return same >= 0.99


def check_graph(results: dict) -> bool:
    if not CUDA:
        return True
    trees, logits, q = make_batch("topk:2x3", "without_replacement", 8, VOCAB, 2)
    lg, padded, sampling, u = inputs(trees, logits, q, 7, DEV)
    accept_stochastic_padded(lg, padded, sampling, u)  # warm-up
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = accept_stochastic_padded(lg, padded, sampling, u)
    ok = True
    for seed in (11, 12, 13):
        new_lg, _, _, new_u = inputs(trees, logits.roll(seed, dims=-1), q, seed, DEV)
        lg.copy_(new_lg)
        u.copy_(new_u)
        graph.replay()
        ok &= torch.equal(out, accept_stochastic_padded(new_lg, padded, sampling, new_u))
    results["graph_replay_equals_eager"] = bool(ok)
    print(f"graph replay == eager: {ok}")
    return bool(ok)


def bench_case(spec: str, mode: str, b: int) -> dict:
    """Milliseconds per call of the device rule (eager, graphed), its host preparation and the host rule."""
    trees, logits, q = make_batch(spec, mode, b, VOCAB, 5)
    args = inputs(trees, logits, q, 9, DEV)
    lg = logits.to(DEV)
    row = dict(tree=spec, mode=mode, batch=b, q=q, max_trials=args[1].max_trials)
    row["eager_ms"] = timed(lambda: accept_stochastic_padded(*args), 5)
    streams = [UniformStream(i) for i in range(b)]
    row["prep_ms"] = timed(lambda: (pad_trees(trees, q, DEV), sampling_rows([PARAMS] * b, DEV),
                                    draw_uniforms(streams, trees, q, DEV)), 5)
    if CUDA:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            accept_stochastic_padded(*args)
        row["graph_ms"] = timed(graph.replay, 20)

    def host_rule():
        for i, t in enumerate(trees):
            probs = shape_probs(lg[i, :t.num_nodes + 1], PARAMS.temperature, PARAMS.top_k, PARAMS.top_p)
            verify_stochastic(t, probs, streams[i])

    row["host_rule_ms"] = timed(host_rule, 2)
    return row


def bench(results: dict) -> None:
    rows = []
    for spec, mode in TREES.items():
        for b in BATCHES:
            rows.append(bench_case(spec, mode, b))
            print(json.dumps(rows[-1]), flush=True)
    results["timing"] = rows
    head = ("tree", "mode", "B", "Q", "trials", "eager", "graph", "prep", "host")
    print("\n{:10} {:20} {:>3} {:>3} {:>6} {:>8} {:>8} {:>8} {:>8}".format(*head))
    for r in rows:
        print(f"{r['tree']:10} {r['mode']:20} {r['batch']:3} {r['q']:3} {r['max_trials']:6} {r['eager_ms']:8.2f} "
              f"{r.get('graph_ms', float('nan')):8.3f} {r['prep_ms']:8.2f} {r['host_rule_ms']:8.2f}")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "vocab": VOCAB}
    ok = check_cpu(results) and check_graph(results)
    bench(results)
    (out / "gpu_accept.json").write_text(json.dumps(results, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
