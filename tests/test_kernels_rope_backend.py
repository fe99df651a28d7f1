"""Fused RoPE + cache write, the Triton attention backend and select_backend."""

import os

import pytest
import torch
from kernel_inputs import (
    make_pool,
    parents_random,
    parents_topk,
    random_paged_batch,
)
from specdec.kernels.backend import TritonAttentionBackend, select_backend
from specdec.kernels.rope_cache import (
    fused_rope_cache_write,
    fused_rope_cache_write_reference,
)

from specdec.attention.torch_backend import TorchAttentionBackend


def _rope_tables(max_pos, d, device):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # (D/2,)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq  # (max_pos, D/2)
    return freqs.cos().to(device), freqs.sin().to(device)


def _rope_case(t, hq, hkv, d, page, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    wide = torch.randn(t, width + 8, generator=gen).to(device=device, dtype=dtype)
    qkv = wide[:, :width]  # row stride > width
    positions = torch.randint(0, 100, (t,), generator=gen).to(device)
    num_blocks = t // page + 2
    slots = torch.randperm(num_blocks * page, generator=gen)[:t]
    slots[1::4] = -1  # padding tokens
    cos, sin = _rope_tables(128, d, device)
    return qkv, positions, cos, sin, slots.to(device), make_pool(num_blocks, page, hkv, d, dtype, device, gen)


def _rotate_half_hf(x, cos, sin):  # Hugging Face Llama convention, written out independently
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("t,hq,hkv,d,page", [(1, 2, 2, 16, 4), (7, 6, 2, 16, 8), (10, 8, 1, 24, 4)])
def test_fused_rope_cache_write(t, hq, hkv, d, page):
    qkv, pos, cos, sin, slots, pool = _rope_case(t, hq, hkv, d, page, "cpu", torch.float32, seed=t)
    expect = make_pool(pool.storage.shape[0], page, hkv, d, torch.float32, "cpu", torch.Generator())
    expect.storage.copy_(pool.storage)
    ref = fused_rope_cache_write_reference(qkv, pos, cos, sin, expect.k_cache, expect.v_cache, slots,
                                           hq, hkv, d)
    out = tuple(torch.full((t, h, d), float("nan")) for h in (hq, hkv, hkv))
    got = fused_rope_cache_write(qkv, pos, cos, sin, pool.k_cache, pool.v_cache, slots, hq, hkv, d, out=out)
    for name, g, r in zip("qkv", got, ref, strict=True):
        assert not g.isnan().any(), f"{name}: unwritten elements"
        err = ((g - r).abs().max() / r.abs().max()).item()
        assert err < 1e-4, f"{name}: max rel err {err:.3e}"
    torch.testing.assert_close(pool.storage, expect.storage, rtol=1e-5, atol=1e-6)
    q_hf = _rotate_half_hf(qkv[:, : hq * d].view(t, hq, d), cos[pos], sin[pos])
    torch.testing.assert_close(got[0], q_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.triton_interpreter
def test_rope_bad_arguments():
    qkv, pos, cos, sin, slots, pool = _rope_case(3, 2, 1, 16, 4, "cpu", torch.float32, seed=0)
    with pytest.raises(ValueError, match="qkv"):
        fused_rope_cache_write(qkv[:, :-1], pos, cos, sin, pool.k_cache, pool.v_cache, slots, 2, 1, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_rope_cache_write(qkv, pos, cos, sin, pool.k_cache, pool.v_cache, slots.int(), 2, 1, 16)
    with pytest.raises(ValueError, match="head_dim must be even"):
        fused_rope_cache_write(qkv, pos, cos, sin, pool.k_cache, pool.v_cache, slots, 2, 1, 15)


def _backend_run(backend, batch, window):
    """Fresh new-token K/V through ``backend.forward``; returns (output, pool storage after)."""
    gen = torch.Generator().manual_seed(1)
    t, hkv, d = batch.q.shape[0], batch.pool.k_cache.shape[2], batch.q.shape[2]
    k = torch.randn(t, hkv, d, generator=gen).to(batch.q)
    v = torch.randn(t, hkv, d, generator=gen).to(batch.q)
    storage = batch.pool.storage.clone()
    kc = storage.as_strided(batch.pool.k_cache.shape, batch.pool.k_cache.stride(),
                            batch.pool.k_cache.storage_offset())
    vc = storage.as_strided(batch.pool.v_cache.shape, batch.pool.v_cache.stride(),
                            batch.pool.v_cache.storage_offset())
    return backend.forward(batch.q, k, v, kc, vc, batch.meta, d ** -0.5, window), storage


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("tree,window", [(False, None), (True, None), (False, 5)])
def test_triton_backend_matches_torch_backend(tree, window):
    gen = torch.Generator().manual_seed(0)
    trees = [parents_topk(2, 2), parents_random(5, gen), [-1]] if tree else None
    new = [7, 5, 1] if tree else [6, 1, 9]
    batch = random_paged_batch([5, 0, 12], new, 6, 2, 16, 4, tree_parents=trees, seed=3)
    got, got_storage = _backend_run(TritonAttentionBackend(), batch, window)
    ref, ref_storage = _backend_run(TorchAttentionBackend(), batch, window)
    assert torch.equal(got_storage, ref_storage)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_select_backend(monkeypatch):
    assert isinstance(select_backend(torch.device("cpu")), TorchAttentionBackend)
    assert isinstance(select_backend("cpu", "torch"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="'auto', 'torch', 'triton'"):
        select_backend("cpu", "flash")
    import specdec.kernels.paged_attention  # noqa: F401 - imported now: under the env below it would be interpreted

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu", "triton").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("cpu", "triton")
    if torch.cuda.is_available():
        assert select_backend(torch.device("cuda")).name == "triton"
        assert select_backend("cuda", "torch").name == "torch"


@pytest.mark.gpu
def test_gpu_rope_and_backend_bf16():
    qkv, pos, cos, sin, slots, pool = _rope_case(500, 32, 8, 128, 16, "cuda", torch.bfloat16, seed=0)
    ref_storage = pool.storage.clone()
    kc = ref_storage.as_strided(pool.k_cache.shape, pool.k_cache.stride(), pool.k_cache.storage_offset())
    vc = ref_storage.as_strided(pool.v_cache.shape, pool.v_cache.stride(), pool.v_cache.storage_offset())
    ref = fused_rope_cache_write_reference(qkv, pos, cos, sin, kc, vc, slots, 32, 8, 128)
    got = fused_rope_cache_write(qkv, pos, cos, sin, pool.k_cache, pool.v_cache, slots, 32, 8, 128)
    for g, r in zip(got, ref, strict=True):
        assert ((g.float() - r.float()).abs().max() / r.float().abs().max()).item() < 1e-2
    assert ((pool.storage.float() - ref_storage.float()).abs().max()).item() < 2e-2

    trees = [parents_topk(2, 6)[:64], [-1], parents_topk(4, 2)]
    batch = random_paged_batch([300, 2000, 17], [len(t) for t in trees], 32, 8, 128, 16, tree_parents=trees,
                               dtype=torch.bfloat16, device="cuda")
    got, got_storage = _backend_run(select_backend(torch.device("cuda")), batch, None)
    ref, ref_storage = _backend_run(TorchAttentionBackend(), batch, None)
    assert torch.equal(got_storage, ref_storage)
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernels launch on CUDA, or on the CPU under TRITON_INTERPRET=1")
def test_rope_cache_write_refuses_strided_positions():
    """An expanded (stride-0) positions view would make the kernel read past its one element."""
    from specdec.kernels.rope_cache import fused_rope_cache_write

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the argument checks run before any launch
    qkv = torch.zeros(3, (2 + 2 * 1) * 8, device=dev)
    cos = sin = torch.zeros(16, 4, device=dev)
    cache = torch.zeros(4, 4, 1, 8, device=dev)
    pos = torch.tensor([5], device=dev).expand(3)
    with pytest.raises(ValueError, match="positions"):
        fused_rope_cache_write(qkv, pos, cos, sin, cache, cache.clone(), torch.full((3,), -1, device=dev), 2, 1, 8)
