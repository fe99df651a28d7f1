"""Time the Triton kernels on a GPU: paged attention against torch SDPA, and the small KV kernels.

Usage: python bench/gpu_kernels.py OUT.json [--quick | --tune]

For each model shape, batch B in (1, 4, 16, 64), context (cached prefix) S in (512, 2048, 8192)
and N query tokens per row in (1, 16, 64) (N = 1 is decode, N > 1 a tree verify), it reports
median GPU times, replayed from CUDA graphs (triton.testing.do_bench_cudagraph, as the engine runs
its steps; eager timing here would mostly measure Python launch overhead), of
  triton        paged_attention_triton through permuted block tables (auto split-K)
  triton_eager  the same launched eagerly (includes host launch overhead)
  triton_1split the same with num_splits=1 (shows what split-K buys)
  sdpa          F.scaled_dot_product_attention on K/V already gathered into contiguous
                (B, Hkv, S+N, D) tensors: the dense lower bound without paging
  gather_sdpa   gathering K/V through the block tables, then SDPA (a torch paged path)
and the achieved bandwidth of the Triton kernel (K/V bytes read + q/out bytes, over time),
as a fraction of the measured device copy bandwidth (2 x bytes / time of a large copy).
It prints a table and writes every number to OUT.json. ``--tune`` instead sweeps the attention
tile configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) on a few decode and tree cases.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import torch.nn.functional as F
from specdec.kernels.block_table import stage_block_tables, stage_block_tables_reference
from specdec.kernels.kv_adopt import adopt_kv, adopt_kv_reference
from specdec.kernels.kv_store import store_kv_reference, store_kv_triton
from specdec.kernels.paged_attention import paged_attention_triton
from specdec.kernels.random_inputs import parents_random, random_paged_batch, tree_mask_from_parents
from specdec.kernels.rope_cache import fused_rope_cache_write, fused_rope_cache_write_reference
from triton.testing import do_bench, do_bench_cudagraph

MODELS = {"llama-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (Hq, Hkv, D)
BATCHES, CONTEXTS, QUERIES = (1, 4, 16, 64), (512, 2048, 8192), (1, 16, 64)
BLOCK = 16


def bench_ms(fn, graph: bool = True) -> float:
    """Median ms of ``fn``, replayed from a CUDA graph when ``graph`` (fn must not sync), else eager."""
    fn()  # compile / warm up outside any capture
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read and written."""
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), graph=False)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def _dense_inputs(batch, n, tree):
    """Contiguous K/V (B, Hkv, S+N, D) gathered through the block tables, and the SDPA mask."""
    m, page = batch.meta, BLOCK
    seq = m.max_seq_len
    rows = m.seq_lens.shape[0]

    def gather():
        k = batch.pool.k_cache[m.block_tables.long()].flatten(1, 2)[:, :seq]  # (B, S+N, Hkv, D)
        v = batch.pool.v_cache[m.block_tables.long()].flatten(1, 2)[:, :seq]
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

    assert page == batch.pool.k_cache.shape[1]
    mask = None
    if n > 1:
        bits = torch.tensor(tree_mask_from_parents(tree), device="cuda")  # (N,)
        region = ((bits[:, None] >> torch.arange(n, device="cuda")) & 1).bool()  # (N, N)
        mask = torch.ones(n, seq, dtype=torch.bool, device="cuda")
        mask[:, seq - n:] = region
    q = batch.q.view(rows, n, *batch.q.shape[1:]).transpose(1, 2)  # (B, Hq, N, D)
    return q, gather, mask


def attention_row(model, b, s, n) -> dict:
    hq, hkv, d = MODELS[model]
    tree = parents_random(n, torch.Generator().manual_seed(n))
    trees = [tree] * b if n > 1 else None
    batch = random_paged_batch([s] * b, [n] * b, hq, hkv, d, BLOCK, tree_parents=trees, dtype=torch.bfloat16,
                               device="cuda", pool_on_device_rng=True)
    m = batch.meta
    args = (batch.q, batch.pool.k_cache, batch.pool.v_cache, m.block_tables, m.query_start_loc,
            m.prefix_lens, m.seq_lens, m.tree_mask, d ** -0.5)
    hints = dict(max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
    q, gather, mask = _dense_inputs(batch, n, tree)
    k, v = gather()
    row = {"model": model, "batch": b, "context": s, "queries": n}
    row["triton_ms"] = bench_ms(lambda: paged_attention_triton(*args, **hints))
    row["triton_eager_ms"] = bench_ms(lambda: paged_attention_triton(*args, **hints), graph=False)
    row["triton_1split_ms"] = bench_ms(lambda: paged_attention_triton(*args, **hints, num_splits=1))
    row["sdpa_ms"] = bench_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    row["gather_sdpa_ms"] = bench_ms(
        lambda: F.scaled_dot_product_attention(q, *gather(), attn_mask=mask, enable_gqa=True))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    got = paged_attention_triton(*args, **hints).view(b, n, hq, d)
    row["max_rel_err"] = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    kv_bytes = 2 * b * (s + n) * hkv * d * 2
    row["bytes"] = kv_bytes + 2 * batch.q.numel() * 2
    row["triton_GBps"] = row["bytes"] / (row["triton_ms"] * 1e-3) / 1e9
    return row


TUNE_CASES = [("llama-8b", 64, 8192, 1), ("llama-8b", 4, 8192, 1), ("smollm2-135m", 64, 2048, 1),
              ("llama-8b", 16, 8192, 64), ("llama-8b", 64, 2048, 16), ("smollm2-135m", 64, 8192, 64),
              ("llama-8b", 1, 8192, 64)]


def tune_rows() -> list[dict]:
    """Graph-replay time of every tile configuration on TUNE_CASES (failed compiles are skipped)."""
    rows = []
    for model, b, s, n in TUNE_CASES:
        hq, hkv, d = MODELS[model]
        trees = [parents_random(n, torch.Generator().manual_seed(n))] * b if n > 1 else None
        batch = random_paged_batch([s] * b, [n] * b, hq, hkv, d, BLOCK, tree_parents=trees,
                                   dtype=torch.bfloat16, device="cuda", pool_on_device_rng=True)
        m = batch.meta
        args = (batch.q, batch.pool.k_cache, batch.pool.v_cache, m.block_tables, m.query_start_loc,
                m.prefix_lens, m.seq_lens, m.tree_mask, d ** -0.5)
        hints = dict(max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
        block_ms = (16,) if n == 1 else (64, 128, 256)
        for cfg in itertools.product(block_ms, (32, 64, 128), (2, 4, 8), (2, 3, 4)):
            if n > 1 and (cfg[1] == 128 or cfg[2] == 2 or cfg[3] == 4):
                continue
            try:
                ms = bench_ms(lambda: paged_attention_triton(*args, **hints, tile_config=cfg))  # noqa: B023
            except Exception as exc:  # noqa: BLE001 - out of resources etc.: report and go on
                print(f"{model} B={b} S={s} N={n} {cfg}: {type(exc).__name__}")
                continue
            rows.append({"model": model, "batch": b, "context": s, "queries": n, "tile": cfg, "ms": ms})
        best = sorted((r for r in rows if r["batch"] == b and r["context"] == s and r["queries"] == n
                       and r["model"] == model), key=lambda r: r["ms"])[:4]
        best_str = ", ".join(f"{r['tile']} {r['ms']:.4f}" for r in best)
        print(f"{model} B={b} S={s} N={n}: {best_str}", flush=True)
        del batch
        torch.cuda.empty_cache()
    return rows


def small_kernel_rows() -> list[dict]:
    """store_kv, fused rope + cache write, KV adoption and block-table staging vs their references."""
    t, hq, hkv, d = 4096, 32, 8, 128
    batch = random_paged_batch([0], [t], hkv, hkv, d, BLOCK, dtype=torch.bfloat16, device="cuda",
                               pool_on_device_rng=True)
    pool, slots = batch.pool, batch.meta.slot_mapping
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    pos, cos = torch.arange(t, device="cuda"), torch.randn(t, d // 2, device="cuda")
    rows, segs, width = 64, 64, 1024  # 8 accepted tokens per row, 32 layers x K/V of 8 x 128
    storage = torch.randn(rows * 8, segs * width * BLOCK, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(segs, device="cuda") * width * BLOCK
    widths = torch.full((segs,), width, device="cuda")
    base = torch.arange(rows, device="cuda")[:, None] * 8 * BLOCK + 4 * BLOCK
    dst = (base + torch.arange(8, device="cuda")).flatten()
    src = (base + 2 * torch.arange(8, device="cuda")).flatten()
    host = torch.randint(0, 10_000, (1024, 512), dtype=torch.int32).pin_memory()
    row_ids = torch.randperm(1024)[:64].cuda()
    staged = torch.empty(64, 512, dtype=torch.int32, device="cuda")
    cases = {
        "store_kv T=4096": (lambda f: f(k, k, pool.k_cache, pool.v_cache, slots),
                            store_kv_triton, store_kv_reference, 4 * t * hkv * d * 2),
        "rope_cache T=4096": (lambda f: f(qkv, pos, cos, cos, pool.k_cache, pool.v_cache, slots, hq, hkv, d),
                              fused_rope_cache_write, fused_rope_cache_write_reference, 2 * qkv.numel() * 2),
        "adopt_kv 512 pairs x 64 seg": (
            lambda f: f(storage, offsets, widths, BLOCK, src, dst, max_token_elems=width),
            adopt_kv, adopt_kv_reference, 2 * 512 * segs * width * 2),
        "stage_block_tables 64x512": (lambda f: f(host, row_ids, staged), stage_block_tables,
                                      stage_block_tables_reference, 2 * 64 * 512 * 4),
    }
    out = []
    for name, (call, fast, ref, nbytes) in cases.items():
        fast_ms = bench_ms(lambda: call(fast))  # noqa: B023
        ref_ms = bench_ms(lambda: call(ref), graph=False)  # noqa: B023  (references sync on the host)
        out.append({"kernel": name, "triton_ms": fast_ms, "torch_ms": ref_ms,
                    "triton_GBps": nbytes / (fast_ms * 1e-3) / 1e9})
    return out


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not torch.cuda.is_available():
        raise SystemExit("usage: python bench/gpu_kernels.py OUT.json [--quick]  (needs CUDA)")
    quick = "--quick" in argv
    if "--tune" in argv:
        _dump({"tune": tune_rows()}, argv[1])
        return
    copy_bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_GBps": copy_bw / 1e9, "attention": [],
               "small_kernels": []}
    print(f"{results['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'model':>13} {'B':>3} {'S':>5} {'N':>3} | {'triton':>8} {'eager':>8} {'1split':>8} {'sdpa':>8} "
          f"{'gat+sdpa':>8} ms | {'GB/s':>6} {'%copy':>6} | {'relerr':>7}")
    for model in MODELS:
        for b in BATCHES[:2] if quick else BATCHES:
            for s in CONTEXTS[:2] if quick else CONTEXTS:
                for n in QUERIES:
                    row = attention_row(model, b, s, n)
                    row["frac_of_copy"] = row["triton_GBps"] * 1e9 / copy_bw
                    results["attention"].append(row)
                    print(f"{model:>13} {b:>3} {s:>5} {n:>3} | {row['triton_ms']:8.4f} "
                          f"{row['triton_eager_ms']:8.4f} "
                          f"{row['triton_1split_ms']:8.4f} {row['sdpa_ms']:8.4f} {row['gather_sdpa_ms']:8.4f}"
                          f"    | {row['triton_GBps']:6.0f} {100 * row['frac_of_copy']:5.1f}% | "
                          f"{row['max_rel_err']:.1e}", flush=True)
                    torch.cuda.empty_cache()
                    _dump(results, argv[1])  # partial results survive a time limit
    for row in small_kernel_rows():
        results["small_kernels"].append(row)
        print(f"{row['kernel']:>30}: triton {row['triton_ms']:.4f} ms ({row['triton_GBps']:.0f} GB/s), "
              f"torch {row['torch_ms']:.4f} ms")
    _dump(results, argv[1])


def _dump(results: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv)
