"""topk_small (kernels/topk.py) against torch.topk over the draft vocabulary, on CUDA.

    python -P bench/gpu_topk.py OUT_DIR

Per (rows, k, implementation): milliseconds per call, eager (CUDA events around 200 calls, median of
5) and inside a captured CUDA graph of 20 calls (per call, median of 5 x 50 replays), and the kernels
one call launches (torch.profiler). topk_small runs at its default block and at 1024 / 4096 columns per
program. Every topk_small result is first checked equal to topk_reference (ties: lower index first).
Rows: 4 (the brief's case), 1 (static tree root), 40 (dynamic 10x5 level at batch 4), 512 (64 x 8).
Writes OUT_DIR/topk.json and prints one line per case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_fastpath import cuda_ms  # noqa: E402
from gpu_program_kernels import kernels  # noqa: E402
from specdec.kernels.topk import DEFAULT_BLOCK, topk_reference, topk_small

N = 24576
ROWS = (4, 1, 40, 512)
KS = (2, 4, 8, 10)


def graph_ms(fn, calls: int = 20, replays: int = 50) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_ms(graph.replay, replays) / calls


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    res = []
    for r in ROWS:
        x_cpu = (torch.randn(r, N, generator=g) * 4).to(torch.bfloat16)  # bf16: many ties
        x = x_cpu.cuda()
        for k in KS:
            want = topk_reference(x_cpu, k)
            impls = {"torch.topk": lambda x=x, k=k: torch.topk(x, k, dim=-1)}
            for block in sorted({DEFAULT_BLOCK, 1024, 4096}):
                got = topk_small(x, k, block=block)
                equal = torch.equal(got.indices.cpu(), want.indices) and torch.equal(got.values.cpu(), want.values)
                if not equal:
                    raise SystemExit(f"topk_small differs from topk_reference at rows={r} k={k} block={block}")
                impls[f"topk_small/{block}"] = lambda x=x, k=k, block=block: topk_small(x, k, block=block)
            for name, fn in impls.items():
                row = {"rows": r, "n": N, "k": k, "impl": name, "eager_ms": cuda_ms(fn), "graph_ms": graph_ms(fn),
                       "kernels": kernels(fn)["kernels"]}
                res.append(row)
                print(f"rows {r:4d} k {k:2d} {name:18s} eager {row['eager_ms'] * 1e3:7.1f} us  "
                      f"graph {row['graph_ms'] * 1e3:7.1f} us  {row['kernels']:3d} kernels", flush=True)
    (out / "topk.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": res}, indent=1))


if __name__ == "__main__":
    main()
