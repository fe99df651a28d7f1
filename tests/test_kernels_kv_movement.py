"""KV store, KV adoption and block-table staging kernels against their torch references."""

import pytest
import torch
from kernel_inputs import make_pool
from specdec.kernels.kv_adopt import adopt_kv, adopt_kv_reference
from specdec.kernels.kv_store import store_kv_reference, store_kv_triton


def _store_case(t, hkv, d, page, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = t // page + 3
    pool = make_pool(num_blocks, page, hkv, d, dtype, device, gen)
    wide = torch.randn(t, hkv + 3, d, generator=gen).to(device=device, dtype=dtype)
    k, v = wide[:, :hkv], wide[:, 3:]  # non-contiguous token stride
    slots = torch.randperm(num_blocks * page, generator=gen)[:t]
    slots[:: 3] = -1  # padding tokens
    return pool, k, v, slots.to(device)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("t,hkv,d,page", [(1, 1, 16, 4), (9, 2, 16, 8), (12, 3, 24, 4)])
def test_store_kv(t, hkv, d, page):
    pool, k, v, slots = _store_case(t, hkv, d, page, "cpu", torch.float32, seed=t)
    expect = make_pool(pool.storage.shape[0], page, hkv, d, torch.float32, "cpu", torch.Generator())
    expect.storage.copy_(pool.storage)
    store_kv_reference(k, v, expect.k_cache, expect.v_cache, slots)
    store_kv_triton(k, v, pool.k_cache, pool.v_cache, slots)
    assert torch.equal(pool.storage, expect.storage)  # written slots right, everything else untouched


def _pool_segments(page, layout, junk=5):
    """Storage with segments of the given per-token widths (and junk between): offsets, widths."""
    offsets, at = [], junk
    for width in layout:
        offsets.append(at)
        at += page * width + junk
    return torch.tensor(offsets), torch.tensor(layout), at


def _accepted_moves(tables, page, lens, n_nodes, gen):
    """Per row: accepted path of tree nodes moved to L..L+m-1 (root at L-1, node i at L+i),
    as physical (src, dst) pairs in increasing logical destination."""
    src, dst = [], []
    for row, (length, n) in enumerate(zip(lens, n_nodes, strict=True)):
        m = int(torch.randint(1, n + 1, (1,), generator=gen))
        path = sorted(torch.randperm(n, generator=gen)[:m].tolist())

        def phys(pos, row=row):
            return int(tables[row, pos // page]) * page + pos % page

        for k, node in enumerate(path):
            src.append(phys(length + node))
            dst.append(phys(length + k))
    return torch.tensor(src), torch.tensor(dst)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("rows", [1, 3, 14])
def test_adopt_kv_accepted_paths(rows):
    gen = torch.Generator().manual_seed(rows)
    page = 4
    # target: 2 layers x {K, V} with Hkv*D = 32; draft: 1 layer x {K, V} with Hkv*D = 8
    seg_offsets, seg_elems, block_elems = _pool_segments(page, [32, 32, 32, 32, 8, 8])
    lens = torch.randint(1, 20, (rows,), generator=gen).tolist()
    n_nodes = torch.randint(1, 12, (rows,), generator=gen).tolist()
    max_blocks = max(-(-(length + n) // page) for length, n in zip(lens, n_nodes, strict=True))
    num_blocks = rows * max_blocks + 2
    tables = torch.randperm(num_blocks, generator=gen)[: rows * max_blocks].view(rows, max_blocks)
    src, dst = _accepted_moves(tables, page, lens, n_nodes, gen)
    storage = torch.randn(num_blocks, block_elems, generator=gen)
    expect = storage.clone()
    adopt_kv_reference(expect, seg_offsets, seg_elems, page, src, dst)
    adopt_kv(storage, seg_offsets, seg_elems, page, src, dst)
    assert torch.equal(storage, expect)


@pytest.mark.triton_interpreter
def test_adopt_kv_overlapping_chain_and_padding():
    """Pair 3 writes the slot pair 1 reads: the result must be the snapshot (in-order) one."""
    seg_offsets, seg_elems, block_elems = _pool_segments(8, [16, 16])
    storage = torch.randn(3, block_elems)
    src = torch.tensor([10, 11, 12, 13, -1])  # logical == physical here: one row, blocks 1, 2
    dst = torch.tensor([8, 9, 10, 11, 12])  # last pair is padding (src < 0)
    expect = storage.clone()
    for s, d in zip(src.tolist()[:4], dst.tolist()[:4], strict=True):  # sequential in-order copy
        for off, n in zip(seg_offsets.tolist(), seg_elems.tolist(), strict=True):
            expect[d // 8, off + (d % 8) * n: off + (d % 8 + 1) * n] = \
                storage[s // 8, off + (s % 8) * n: off + (s % 8 + 1) * n]
    ref = storage.clone()
    adopt_kv_reference(ref, seg_offsets, seg_elems, 8, src, dst)
    adopt_kv(storage, seg_offsets, seg_elems, 8, src, dst)
    assert torch.equal(ref, expect) and torch.equal(storage, expect)


@pytest.mark.triton_interpreter
def test_bad_arguments_name_the_field():
    storage = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="dst_slots"):
        adopt_kv(storage, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 4,
                 torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_size"):
        adopt_kv(storage, torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 0,
                 torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
def test_gpu_store_adopt():
    pool, k, v, slots = _store_case(300, 8, 128, 16, "cuda", torch.bfloat16, seed=1)
    expect = pool.storage.clone()
    exp_k = expect.as_strided(pool.k_cache.shape, pool.k_cache.stride(), pool.k_cache.storage_offset())
    exp_v = expect.as_strided(pool.v_cache.shape, pool.v_cache.stride(), pool.v_cache.storage_offset())
    store_kv_reference(k, v, exp_k, exp_v, slots)
    store_kv_triton(k, v, pool.k_cache, pool.v_cache, slots)
    assert torch.equal(pool.storage, expect)

    gen = torch.Generator().manual_seed(2)
    seg_offsets, seg_elems, block_elems = _pool_segments(16, [1024] * 60 + [512] * 4)
    tables = torch.randperm(64 * 8, generator=gen).view(64, 8)
    src, dst = _accepted_moves(tables, 16, [40] * 64, [60] * 64, gen)
    storage = torch.randn(64 * 8, block_elems, device="cuda").bfloat16()
    ref = storage.clone()
    adopt_kv_reference(ref, seg_offsets.cuda(), seg_elems.cuda(), 16, src.cuda(), dst.cuda())
    adopt_kv(storage, seg_offsets.cuda(), seg_elems.cuda(), 16, src.cuda(), dst.cuda())
    assert torch.equal(storage, ref)

