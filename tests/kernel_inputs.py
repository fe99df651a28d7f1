"""Random paged-KV batches and draft-tree masks for the kernel tests and benchmarks.

Pools mimic the engine's shared storage: a block holds other segments before and after the
K and V segments, so the cache views' block stride is larger than the view, and block
tables map logical blocks to a random permutation of physical blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.base import AttnMetadata

JUNK_BEFORE = 24  # elements of other segments before K in every block (keeps 16-element alignment)
JUNK_AFTER = 40


@dataclass
class PagedPool:
    """One storage and the K/V views of one layer inside it."""

    storage: torch.Tensor  # (num_blocks, block_elems)
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D), block stride = block_elems
    v_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)


@dataclass
class PagedBatch:
    """A packed batch whose new tokens' K/V are already in the pool (as paged_attention expects)."""

    q: torch.Tensor  # (T, Hq, D)
    pool: PagedPool
    meta: AttnMetadata


def make_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype, device: torch.device | str, gen: torch.Generator | None) -> PagedPool:
    """A pool filled with random values (the junk segments too); ``gen`` None draws on the device
    (fast for benchmark-sized pools, not reproducible across devices)."""
    seg = block_size * num_kv_heads * head_dim
    block_elems = JUNK_BEFORE + 2 * seg + JUNK_AFTER
    if gen is None:
        storage = torch.randn(num_blocks, block_elems, device=device, dtype=dtype)
    else:
        storage = torch.randn(num_blocks, block_elems, generator=gen).to(device=device, dtype=dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    strides = (block_elems, num_kv_heads * head_dim, head_dim, 1)
    k_cache = storage.as_strided(shape, strides, storage.storage_offset() + JUNK_BEFORE)
    v_cache = storage.as_strided(shape, strides, storage.storage_offset() + JUNK_BEFORE + seg)
    return PagedPool(storage, k_cache, v_cache)


def parents_chain(n: int) -> list[int]:
    """Token 0 is the root (the pending token); token i's parent is i-1."""
    return [-1] + list(range(n - 1))


def parents_topk(width: int, depth: int) -> list[int]:
    """Root plus a full ``width``-ary tree of ``depth`` levels, breadth first (1 + w + ... + w^depth)."""
    parents, level = [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(width):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def parents_random(n: int, gen: torch.Generator) -> list[int]:
    """Random topologically ordered forest: token i's parent is uniform in [-1, i)."""
    return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]


def dynamic_program_output(g: torch.Generator, r: int, m: int, levels: int) -> torch.Tensor:
    """(R, 3, N) random outputs of a dynamic tree program (``kernels/tree_write.py``'s input): node tokens, parents
    (-1: the root, else an earlier node, so that no tree is more than ``levels`` levels deep), and score ranks (a
    permutation per row)."""
    out = torch.empty(r, 3, m, dtype=torch.int64)
    for i in range(r):
        depth, parents = [], []
        for j in range(m):
            options = [k for k in range(j) if depth[k] + 1 < levels]
            p = -1 if not options or torch.rand(1, generator=g) < 0.2 else options[
                int(torch.randint(len(options), (1,), generator=g))]
            parents.append(p)
            depth.append(0 if p < 0 else depth[p] + 1)
        out[i, 0] = torch.randint(0, 30000, (m,), generator=g)
        out[i, 1] = torch.tensor(parents)
        out[i, 2] = torch.randperm(m, generator=g)
    return out


def tree_mask_from_parents(parents: list[int]) -> list[int]:
    """int64 ancestor bitmasks: bit j of mask[i] set iff j is i or an ancestor of i (two's complement)."""
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((1 << i) | (masks[p] if p >= 0 else 0))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def random_paged_batch(
    prefix_lens: list[int],
    region_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    query_lens: list[int] | None = None,  # queries = last query_lens[b] region positions; None = all
    tree_parents: list[list[int]] | None = None,  # per row, one parent per region position; None = causal
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    pool_on_device_rng: bool = False,
) -> PagedBatch:
    """Random q and pool, permuted non-contiguous block tables, and the matching metadata
    (the contract of ``specdec.attention.base``: prefix, then a region whose tail is queried)."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(region_lens) if query_lens is None else query_lens
    seq_lens = [p + n for p, n in zip(prefix_lens, region_lens, strict=True)]
    nrows = len(seq_lens)
    max_blocks = max(1, max(-(-s // block_size) for s in seq_lens))
    num_blocks = nrows * max_blocks + spare_blocks
    pool = make_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                     None if pool_on_device_rng else gen)
    tables = torch.randperm(num_blocks, generator=gen)[: nrows * max_blocks].view(nrows, max_blocks)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = [int(tables[b, pos // block_size]) * block_size + pos % block_size
             for b in range(nrows) for pos in range(seq_lens[b] - query_lens[b], seq_lens[b])]
    tree_mask = None
    if tree_parents is not None:
        bits = [m for parents, n in zip(tree_parents, query_lens, strict=True)
                for m in tree_mask_from_parents(parents)[len(parents) - n:]]
        tree_mask = torch.tensor(bits, dtype=torch.int64, device=device)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    meta = AttnMetadata(
        query_start_loc=i32(qsl), prefix_lens=i32(prefix_lens), seq_lens=i32(seq_lens),
        block_tables=tables.to(device=device, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
        tree_mask=tree_mask, max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens, default=0),
        host_query_start_loc=qsl, host_seq_lens=seq_lens, host_prefix_lens=list(prefix_lens),
    )
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return PagedBatch(q, pool, meta)
