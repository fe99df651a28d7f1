"""pytest-benchmark entries for every kernel: Triton on CUDA (skipped without it), torch reference on CPU.

Run: pytest bench/bench_kernels.py --benchmark-only   (or --benchmark-json=out.json)
GPU shapes are Llama-8B-like attention (Hq 32, Hkv 8, D 128, bf16, block 16); CPU entries use
small shapes so the torch references finish quickly.
"""

import pytest
import torch
from specdec.kernels.gumbel_choice import choose_tokens_reference, choose_tokens_triton
from specdec.kernels.kv_adopt import adopt_kv, adopt_kv_reference
from specdec.kernels.kv_store import store_kv_reference, store_kv_triton
from specdec.kernels.logit_processors import processed_logits_reference, processed_logits_triton
from specdec.kernels.nucleus import filtered_probs
from specdec.kernels.paged_attention import paged_attention_reference, paged_attention_triton
from specdec.kernels.rope_cache import fused_rope_cache_write, fused_rope_cache_write_reference
from specdec.kernels.topk import topk_small

from specdec.row_sampling import sampling_rows
from specdec.sampling_params import SamplingParams
from tests.kernel_inputs import dynamic_program_output, parents_topk, random_paged_batch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="Triton kernels are benchmarked on CUDA only")
IMPLS = [pytest.param("triton", marks=needs_cuda), "torch"]


def _setup(impl):
    """(device, dtype, scale factor for sizes, synchronize) for an implementation."""
    if impl == "triton":
        return "cuda", torch.bfloat16, 1, torch.cuda.synchronize
    return "cpu", torch.float32, 0, (lambda: None)


def _run(benchmark, fn, sync):
    fn()  # warm-up / compile
    sync()
    benchmark(lambda: (fn(), sync()))


def _attention_case(impl, kind):
    device, dtype, big, sync = _setup(impl)
    hq, hkv, d = (32, 8, 128) if big else (4, 2, 16)
    rows = 32 if big else 2
    ctx = 2048 if big else 64
    if kind == "decode":
        pre, reg, trees = [ctx - 1] * rows, [1] * rows, None
    elif kind == "tree64":
        pre, reg = [ctx] * rows, [64] * rows
        trees = [parents_topk(2, 6)[:64]] * rows
    else:  # one prefill chunk after a cached prefix
        pre, reg, trees = [ctx], [512 if big else 16], None
    batch = random_paged_batch(pre, reg, hq, hkv, d, 16, tree_parents=trees, dtype=dtype, device=device,
                               pool_on_device_rng=big == 1)
    m = batch.meta
    args = (batch.q, batch.pool.k_cache, batch.pool.v_cache, m.block_tables, m.query_start_loc,
            m.prefix_lens, m.seq_lens, m.tree_mask, d ** -0.5)
    fn = paged_attention_triton if impl == "triton" else paged_attention_reference
    return (lambda: fn(*args, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)), sync


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["decode", "tree64", "prefill"])
def test_paged_attention(benchmark, impl, kind):
    fn, sync = _attention_case(impl, kind)
    _run(benchmark, fn, sync)


@pytest.mark.parametrize("impl", IMPLS)
def test_store_kv(benchmark, impl):
    device, dtype, big, sync = _setup(impl)
    t, hkv, d = (2048, 8, 128) if big else (64, 2, 16)
    batch = random_paged_batch([0], [t], hkv, hkv, d, 16, dtype=dtype, device=device,
                               pool_on_device_rng=big == 1)
    k = torch.randn(t, hkv, d, device=device, dtype=dtype)
    fn = store_kv_triton if impl == "triton" else store_kv_reference
    pool, slots = batch.pool, batch.meta.slot_mapping
    _run(benchmark, lambda: fn(k, k, pool.k_cache, pool.v_cache, slots), sync)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_rope_cache_write(benchmark, impl):
    device, dtype, big, sync = _setup(impl)
    t, hq, hkv, d = (2048, 32, 8, 128) if big else (64, 4, 2, 16)
    batch = random_paged_batch([0], [t], hkv, hkv, d, 16, dtype=dtype, device=device,
                               pool_on_device_rng=big == 1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=device, dtype=dtype)
    pos = torch.arange(t, device=device)
    cos = torch.randn(t, d // 2, device=device)
    fn = fused_rope_cache_write if impl == "triton" else fused_rope_cache_write_reference
    pool, slots = batch.pool, batch.meta.slot_mapping
    _run(benchmark, lambda: fn(qkv, pos, cos, cos, pool.k_cache, pool.v_cache, slots, hq, hkv, d), sync)


@pytest.mark.parametrize("impl", IMPLS)
def test_adopt_kv(benchmark, impl):
    """Batch 64, 8 accepted tokens each, 64 segments (32 layers x K/V) of 1024 elements per token."""
    device, dtype, big, sync = _setup(impl)
    rows, segs, width, page = (64, 64, 1024, 16) if big else (4, 8, 32, 4)
    block_elems = segs * width * page
    storage = torch.randn(rows * 8, block_elems, device=device, dtype=dtype)
    offsets = torch.arange(segs, device=device) * width * page
    widths = torch.full((segs,), width, device=device)
    base = torch.arange(rows, device=device)[:, None] * 8 * page + 4 * page  # rows own disjoint blocks
    dst = (base + torch.arange(8, device=device)).flatten()
    src = (base + torch.arange(8, device=device) * 2).flatten()
    fn = adopt_kv if impl == "triton" else adopt_kv_reference
    _run(benchmark, lambda: fn(storage, offsets, widths, page, src, dst, max_token_elems=width), sync)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k", [2, 8])
def test_topk_draft_vocabulary(benchmark, impl, k):
    """4 rows of a 24,576-token draft vocabulary (CPU: 2,048 columns, torch.topk)."""
    device, dtype, big, sync = _setup(impl)
    x = torch.randn(4, 24576 if big else 2048, device=device, dtype=dtype)
    fn = topk_small if impl == "triton" else (lambda x, k: torch.topk(x, k, dim=-1))
    _run(benchmark, lambda: fn(x, k), sync)


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("batch,tokens", [(16, 32), (64, 16)])
@pytest.mark.parametrize("spread", [1.0, 2.0, 4.0])
def test_nucleus_filter(benchmark, impl, batch, tokens, spread):
    """The sampled rule's top-p filter (T 0.7, top-p 0.9) over (B, Q, 49,152) logits: the sort-free kernel against
    the sort-based reference, both given the float32 copy of bf16 logits as ``_filtered`` is. spread: the logits'
    standard deviation; the top-p set holds about 21,000 tokens at 1, 3,000 at 2 and tens at 4."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(batch, tokens, 49152, generator=g, device="cuda") * spread).to(torch.bfloat16).float()
    sampling = sampling_rows([SamplingParams(temperature=0.7, top_p=0.9)] * batch, "cuda")
    t = sampling.temperature.float().view(-1, 1, 1)  # (B, 1, 1)
    probs = torch.softmax(x / t, dim=-1)  # (B, Q, V)
    _run(benchmark, lambda: filtered_probs(x, t, probs, sampling, use_triton=impl == "triton"),
         torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("batch,tokens", [(16, 32), (64, 16)])
@pytest.mark.parametrize("with_kept", [False, True])
def test_gumbel_choice(benchmark, impl, batch, tokens, with_kept):
    """The sampled rule's choice over (B * Q, 49,152) bf16 logits, every row sampled at T 0.7 (keyed Gumbel noise
    in float64): the one-launch kernel against the torch reference; with_kept: a kept set of ~5% of the tokens."""
    rows, v = batch * tokens, 49152
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, v, generator=g, device="cuda") * 2).to(torch.bfloat16)
    t = torch.full((rows,), 0.7, dtype=torch.float64, device="cuda")
    key0, key1 = torch.randint(0, 2**32, (2, rows), generator=g, device="cuda")
    position = torch.arange(rows, device="cuda") + 100
    kept = torch.rand(rows, v, generator=g, device="cuda") < 0.05 if with_kept else None
    fn = choose_tokens_triton if impl == "triton" else choose_tokens_reference
    _run(benchmark, lambda: fn(x, t, key0, key1, position, kept), torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("path", ["filtered", "rule", "probs"])
@pytest.mark.parametrize("batch,tokens", [(16, 32), (64, 16), (64, 1), (16, 1), (1, 1)])
def test_sampled_choices(benchmark, path, batch, tokens):
    """The sampled rule's token choices at every verify token of (B, Q, 49,152) bf16 logits, T 0.7 top-p 0.9
    (normal logits, 16 tokens of each row 10 higher: a few likely tokens over a long tail, as a model's):
    ``filtered`` (``choose_filtered_triton``: the kept set only where the unfiltered choice falls outside it, the
    rule's path), ``rule`` (every row's kept set as thresholds, ``nucleus_rule``, applied inside the choice) and
    ``probs`` (the float32 copy, softmax, filtered rows written, kept = probs > 0, then the choice): the same
    tokens."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton
    from specdec.kernels.nucleus import nucleus_rule

    from specdec.row_sampling import shape_probs_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, tokens, 49152, generator=g, device="cuda") * 2
    likely = torch.randint(0, 49152, (batch, tokens, 16), generator=g, device="cuda")
    x = x.scatter_add(-1, likely, torch.full(likely.shape, 10.0, device="cuda")).to(torch.bfloat16)
    sampling = sampling_rows([SamplingParams(temperature=0.7, top_p=0.9)] * batch, "cuda")
    rows = batch * tokens
    t = sampling.temperature.double().repeat_interleave(tokens)
    key0, key1 = torch.randint(0, 2**32, (2, rows), generator=g, device="cuda")
    position = torch.arange(rows, device="cuda") + 100

    def rule():
        kept = nucleus_rule(x, sampling.temperature.float(), sampling)
        return choose_tokens_triton(x.view(rows, -1), t, key0, key1, position, rule=kept)

    def probs():
        kept = (shape_probs_rows(x, sampling, use_triton=True) > 0).view(rows, -1)
        return choose_tokens_triton(x.view(rows, -1), t, key0, key1, position, kept)

    def filtered():
        return choose_filtered_triton(x, t, key0, key1, position, sampling, sampling.temperature.float())

    want = probs()
    assert torch.equal(rule(), want) and torch.equal(filtered(), want)
    _run(benchmark, {"filtered": filtered, "rule": rule, "probs": probs}[path], torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("choice", ["filtered", "unfiltered"])
@pytest.mark.parametrize("splits", ["auto", "one"])
@pytest.mark.parametrize("rows", [1, 32, 64, 256, 512])
def test_split_choice(benchmark, choice, splits, rows):
    """The Gumbel-max choice over (R, 49,152) bf16 logits (``test_sampled_choices``' logits), T 0.7, its pass over
    every token (float64 noise) split over programs per row (``auto``: ``gumbel_splits``, the default
    SPLIT_BLOCK and SPLIT_WARPS) or one program per row (``one``: splits=1, the single-kernel path):
    ``filtered`` (``choose_filtered_triton`` at top-p 0.9, the rule's path) and ``unfiltered``
    (``choose_tokens_triton`` without kept set). Split and one-program give the same tokens."""
    from specdec.kernels.gumbel_choice import choose_filtered_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 1, 49152, generator=g, device="cuda") * 2  # (R, 1, V): batch R, one verify token
    likely = torch.randint(0, 49152, (rows, 1, 16), generator=g, device="cuda")
    x = x.scatter_add(-1, likely, torch.full(likely.shape, 10.0, device="cuda")).to(torch.bfloat16)
    sampling = sampling_rows([SamplingParams(temperature=0.7, top_p=0.9)] * rows, "cuda")
    t = sampling.temperature.double()
    key0, key1 = torch.randint(0, 2**32, (2, rows), generator=g, device="cuda")
    position = torch.arange(rows, device="cuda") + 100

    def run(n):
        if choice == "filtered":
            return choose_filtered_triton(x, t, key0, key1, position, sampling, sampling.temperature.float(),
                                          splits=n)
        return choose_tokens_triton(x.view(rows, -1), t, key0, key1, position, splits=n)

    assert torch.equal(run(None), run(1))
    _run(benchmark, lambda: run(None if splits == "auto" else 1), torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("rough", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_rough_walk(benchmark, rough, rows):
    """One program per row walking (R, 49,152) bf16 logits (``test_split_choice``'s) for the Gumbel-max at T 0.7, in
    blocks of 1,024: every block scored exactly (``rough`` False) against blocks scored exactly only where the
    rough noise's bound says a column could win (True; ``gumbel_split.gumbel_max_block``). Ten launches a round (a
    launch from Python costs about what the kernel does); the same partials either way."""
    from specdec.kernels.gumbel_split import NO_INDEX, _gumbel_max_partials_kernel

    v = 49152
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, v, generator=g, device="cuda") * 2
    likely = torch.randint(0, v, (rows, 16), generator=g, device="cuda")
    x = x.scatter_add(-1, likely, torch.full(likely.shape, 10.0, device="cuda")).to(torch.bfloat16)
    t = torch.full((rows,), 0.7, dtype=torch.float64, device="cuda")
    key0, key1 = torch.randint(0, 2**32, (2, rows), generator=g, device="cuda")
    position = torch.arange(rows, device="cuda") + 100
    outs = {}
    for flag in (False, True):
        outs[flag] = (torch.empty(rows, 1, dtype=torch.float64, device="cuda"),
                      torch.empty(rows, 1, dtype=torch.int32, device="cuda"),
                      torch.empty(rows, 1, dtype=torch.float32, device="cuda"))

    def run(flag):
        for _ in range(10):
            _gumbel_max_partials_kernel[(rows, 1)](x, t, key0, key1, position, *outs[flag], v, v, x.stride(0),
                                                   t.stride(0), key0.stride(0), key1.stride(0), position.stride(0),
                                                   BLOCK=1024, NO_INDEX=NO_INDEX, ROUGH=flag, num_warps=4)

    run(False)
    run(True)
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
    _run(benchmark, lambda: run(rough), torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "triton_per_node", "reference"])
@pytest.mark.parametrize("batch,nodes", [(1, 16), (16, 8), (64, 4), (64, 8)])
def test_children_scores(benchmark, impl, batch, nodes):
    """A sampled draft level's children scores over the shipped draft's 24,576-token vocabulary (bf16 logits of
    ``nodes`` nodes per batch row, every row sampled at T 0.7): the kernel, whose keyed float64 noise is computed
    once per batch row for all its nodes; the same kernel made to compute it for every node (each node its own
    batch row, as the kernel did before); the torch reference."""
    from specdec.kernels.gumbel_noise import children_scores_reference, children_scores_triton

    v = 24576
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(batch, nodes, v, generator=g, device="cuda") * 3).to(torch.bfloat16)
    inv_t = torch.full((batch,), 1 / 0.7, dtype=torch.float64, device="cuda")
    key0, key1 = torch.randint(0, 2**32, (2, batch), generator=g, device="cuda")
    position = torch.arange(batch, device="cuda") + 100
    tokens = torch.randperm(49152, generator=g, device="cuda")[:v]
    fn = children_scores_triton if impl.startswith("triton") else children_scores_reference
    if impl == "triton_per_node":
        logits = logits.reshape(batch * nodes, 1, v)
        inv_t, key0, key1, position = (x.repeat_interleave(nodes) for x in (inv_t, key0, key1, position))
    _run(benchmark, lambda: fn(logits, inv_t, key0, key1, position, tokens), torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("batch,queries,budget", [(1, 32, 31), (16, 32, 31), (64, 16, 15)])
def test_tree_writer(benchmark, impl, batch, queries, budget):
    """A fused EAGLE step's tree writer as the step replays it (a CUDA graph per bucket and budget): the best
    ``budget`` of 50 dynamic-tree nodes per row (the shipped draft's 10 x 5 program) written into the verify
    bucket, one kernel (``kernels/tree_write.py``) against the torch ops."""
    from specdec.step_inputs import StepInputs
    from specdec.tree_writer import TreeWriter

    dev = torch.device("cuda")
    out = dynamic_program_output(torch.Generator().manual_seed(0), batch, 50, 5).to(dev)
    views = StepInputs(batch, queries, 8, dev).views(batch, queries)
    writer = TreeWriter(5, dev, capture=True, use_triton=impl == "triton")
    _run(benchmark, lambda: writer(views, batch, queries, out, budget), torch.cuda.synchronize)


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("batch,tokens", [(16, 32), (64, 8)])
@pytest.mark.parametrize("parts", ["penalties", "all"])
def test_logit_processors(benchmark, impl, batch, tokens, parts):
    """A step's processors over (B, Q, 49,152) bf16 verify logits (``ContextPenalty.apply``): the one-pass kernel
    against the torch reference. penalties: a repetition penalty and presence/frequency penalties (each verify
    token's path of up to Q tokens joined to its row's context); all: a bias, held-back and banned tokens too."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, q, v = batch, tokens, 49152
    logits = torch.randn(b, q, v, generator=g, device="cuda").to(torch.bfloat16)
    path = torch.randint(0, v, (b, q, q), generator=g, device="cuda")
    path[torch.rand(b, q, q, generator=g, device="cuda") < 0.5] = -1
    kw = dict(present=torch.rand(b, v, generator=g, device="cuda") < 0.01,
              penalty=torch.full((b,), 1.2, device="cuda"),
              counts=torch.randint(0, 3, (b, v), generator=g, device="cuda").float(),
              presence=torch.full((b,), 0.5, device="cuda"), frequency=torch.full((b,), 0.25, device="cuda"))
    if parts == "all":
        kw.update(bias=torch.randn(b, v, generator=g, device="cuda"),
                  held=torch.rand(b, v, generator=g, device="cuda") < 0.001, early=torch.ones(b, q, dtype=torch.bool,
                                                                                            device="cuda"),
                  banned=torch.randint(0, v, (b, q, 4), generator=g, device="cuda"))
    fn = processed_logits_triton if impl == "triton" else processed_logits_reference
    _run(benchmark, lambda: fn(logits, path, **kw), torch.cuda.synchronize)
