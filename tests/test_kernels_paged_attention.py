"""paged_attention_triton against the torch reference: decode, tree verify, chunked prefill, windows."""

import pytest
import torch
from kernel_inputs import (
    parents_chain,
    parents_random,
    parents_topk,
    random_paged_batch,
)
from specdec.kernels.paged_attention import (
    paged_attention_reference,
    paged_attention_triton,
)

HEAD_DIM = 16


def _args(batch):
    m = batch.meta
    return (batch.q, batch.pool.k_cache, batch.pool.v_cache, m.block_tables, m.query_start_loc,
            m.prefix_lens, m.seq_lens, m.tree_mask)


def _check(batch, *, window=None, num_splits=None, tol=1e-4, **hints):
    """Run both on the same inputs, the kernel into a NaN-poisoned output; compare by max rel error."""
    scale = batch.q.shape[-1] ** -0.5
    ref = paged_attention_reference(*_args(batch), scale, window).float()
    out = torch.full_like(batch.q, float("nan"))
    storage_before = batch.pool.storage.clone()
    got = paged_attention_triton(*_args(batch), scale, window, num_splits=num_splits, out=out, **hints)
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "unwritten output elements"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"max rel err {err:.3e}"
    assert torch.equal(batch.pool.storage, storage_before), "attention wrote into the KV pool"


GROUPS = [(2, 1), (6, 3), (8, 8)]  # (Hq, GQA ratio): Hkv = Hq / ratio


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hq,ratio", GROUPS)
def test_decode(block_size, num_splits, hq, ratio):
    contexts = [1, block_size - 1, block_size, block_size + 1, 19, 41]
    batch = random_paged_batch([c - 1 for c in contexts], [1] * len(contexts), hq, hq // ratio, HEAD_DIM,
                               block_size, seed=block_size * 10 + num_splits + hq)
    _check(batch, num_splits=num_splits)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("hq,ratio", GROUPS)
def test_tree_verify_mixed_shapes(num_splits, hq, ratio):
    gen = torch.Generator().manual_seed(hq)
    trees = [parents_chain(5), parents_topk(2, 3), parents_random(64, gen), parents_chain(1)]
    batch = random_paged_batch([9, 0, 13, 4], [len(t) for t in trees], hq, hq // ratio, HEAD_DIM, 4,
                               tree_parents=trees, seed=hq + num_splits)
    _check(batch, num_splits=num_splits)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("n", [1, 2, 3, 16, 31, 63, 64])
def test_tree_verify_sizes(n):
    gen = torch.Generator().manual_seed(n)
    trees = [parents_random(n, gen), parents_chain(n)]
    batch = random_paged_batch([n % 7, 8], [n, n], 6, 2, HEAD_DIM, 8, tree_parents=trees, seed=n)
    _check(batch)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hq,ratio", GROUPS)
def test_chunked_prefill(num_splits, hq, ratio):
    # rows: fresh prompt, chunk after a prefix, a single token, a row with nothing new, a long chunk
    batch = random_paged_batch([0, 5, 12, 7, 3], [9, 4, 1, 0, 70], hq, hq // ratio, HEAD_DIM, 4,
                               seed=hq + num_splits)
    _check(batch, num_splits=num_splits)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("window", [1, 3, 10])
def test_sliding_window_causal(window):
    batch = random_paged_batch([0, 20, 6], [12, 3, 1], 6, 2, HEAD_DIM, 4, seed=window)
    _check(batch, window=window, num_splits=2)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("window,big", [(2, False), (6, False), (5, True)])
def test_sliding_window_tree(window, big):
    gen = torch.Generator().manual_seed(window)
    if big:  # 64 positions: the last query's mask has bit 63 (the sign bit) set
        trees = [parents_chain(64), parents_random(64, gen)]
    else:
        trees = [parents_topk(2, 2), parents_random(9, gen)]
    batch = random_paged_batch([17, 3], [len(t) for t in trees], 4, 2, HEAD_DIM, 4, tree_parents=trees,
                               seed=window)
    _check(batch, window=window)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("tree", [False, True])
def test_queries_are_the_region_tail(tree, window):
    """Rows whose earlier region positions are cached (a tree grown level by level): the queries'
    outputs equal the matching rows of the all-region-queried result."""
    gen = torch.Generator().manual_seed(11)
    trees = [parents_topk(2, 3), parents_random(20, gen), parents_chain(6)] if tree else None
    prefix, region, q_lens = [9, 3, 0], [15, 20, 6], [8, 5, 1]
    full = random_paged_batch(prefix, region, 6, 2, HEAD_DIM, 4, tree_parents=trees, seed=5)
    part = random_paged_batch(prefix, region, 6, 2, HEAD_DIM, 4, tree_parents=trees, seed=5,
                              query_lens=q_lens)
    assert torch.equal(full.pool.storage, part.pool.storage)
    tail = torch.cat([torch.arange(e - n, e) for e, n in zip(torch.tensor(region).cumsum(0).tolist(), q_lens,
                                                               strict=True)])
    part.q = full.q[tail].clone()
    scale = HEAD_DIM ** -0.5
    expect = paged_attention_reference(*_args(full), scale, window)[tail]
    got = paged_attention_triton(*_args(part), scale, window, num_splits=2)
    assert ((got - expect).abs().max() / expect.abs().max()).item() < 1e-4
    if not (tree and window):  # the reference itself does not define windowed partial tree regions
        _check(part, window=window)


@pytest.mark.triton_interpreter
def test_oversized_launch_hints_are_harmless():
    """A CUDA graph captured for larger max_query_len / max_seq_len replays correctly on smaller batches."""
    batch = random_paged_batch([3, 11], [2, 5], 6, 2, HEAD_DIM, 4, seed=7)
    _check(batch, max_query_len=16, max_seq_len=16, num_splits=2)


@pytest.mark.triton_interpreter
def test_head_dim_not_power_of_two():
    batch = random_paged_batch([6, 2], [3, 4], 4, 2, 24, 4, seed=3)
    _check(batch)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("field,bad,match", [
    ("block_tables", lambda t: t.long().float(), "block_tables"),
    ("q", lambda t: t[:, :, 0], "q must have shape"),
    ("k_cache", lambda t: t.double(), "k_cache"),
    ("seq_lens", lambda t: t.float(), "seq_lens"),
    ("query_start_loc", lambda t: t[:-1], "query_start_loc"),
    ("tree_mask", lambda t: torch.ones(3, dtype=torch.int32), "tree_mask"),
])
def test_bad_arguments_name_the_field(field, bad, match):
    batch = random_paged_batch([3, 4], [1, 2], 4, 2, HEAD_DIM, 4, seed=0)
    names = ["q", "k_cache", "v_cache", "block_tables", "query_start_loc", "prefix_lens", "seq_lens",
             "tree_mask"]
    args = list(_args(batch))
    i = names.index(field)
    args[i] = bad(args[i])
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(*args, 0.25)


@pytest.mark.triton_interpreter
def test_bad_options_raise():
    batch = random_paged_batch([3], [65], 2, 1, HEAD_DIM, 4)
    mask = torch.ones(65, dtype=torch.int64)  # 65 tree tokens cannot be bitmasks
    with pytest.raises(ValueError, match="at most 64"):
        paged_attention_triton(*_args(batch)[:-1], mask, 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_triton(*_args(batch), 0.25, 0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_triton(*_args(batch), 0.25, num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (16, 16, 128)])
@pytest.mark.parametrize("kind", ["decode", "tree", "prefill"])
def test_gpu_bf16(hq, hkv, d, kind):
    gen = torch.Generator().manual_seed(hq + d)
    if kind == "decode":
        pre, new, trees = [1, 15, 16, 17, 511, 4095, 8191, 300], [1] * 8, None
    elif kind == "tree":
        trees = [parents_topk(2, 5)[:64], parents_random(64, gen), parents_chain(16), parents_random(7, gen)]
        pre, new = [4000, 17, 1000, 0], [len(t) for t in trees]
    else:
        pre, new, trees = [0, 1000, 37], [2048, 300, 1], None
    batch = random_paged_batch(pre, new, hq, hkv, d, 16, tree_parents=trees, dtype=torch.bfloat16,
                               device="cuda", seed=d)
    _check(batch, tol=1e-2)
    _check(batch, tol=1e-2, window=256)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "tree", "prefill"])
def test_gpu_fp32(kind):
    """fp32 on the GPU (the engine's exactness runs): IEEE dots, tight tolerance."""
    gen = torch.Generator().manual_seed(1)
    trees = [parents_random(64, gen), parents_chain(5)] if kind == "tree" else None
    pre, new = {"decode": ([1, 700, 33], [1, 1, 1]), "tree": ([900, 3], [64, 5]),
                "prefill": ([0, 300], [700, 40])}[kind]
    batch = random_paged_batch(pre, new, 9, 3, 64, 16, tree_parents=trees, device="cuda", seed=2)
    _check(batch, tol=1e-4)
    _check(batch, tol=1e-4, window=100)

