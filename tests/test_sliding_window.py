"""Sliding-window models keep only their window in memory, and stay exact.

Tiny Mistral-style checkpoints (every layer windowed, window 16 or 64, block size 4 or 8, weights
drawn with a large scale so greedy choices are never near-ties) run far past their window:
logits and greedy tokens equal transformers' full-sequence forward, speculative greedy output
equals target-only output, a long request holds a window-bounded number of blocks at every step,
and every block returns to the allocator after prefix caching, preemption and mixed engines.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: the Triton backend runs in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from specdec.kvcache.sliding_window import RELEASED  # noqa: E402

from specdec.engine import SpecConfig, SpecEngine  # noqa: E402
from specdec.loading.registry import load_model, truncate_layers  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

W = 16  # window of the main test model
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             initializer_range=0.5, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def mistral(tiny_factory):
    """``mistral(window, layers=2, seed=5)``: a loaded tiny Mistral with that window in every layer."""
    def make(window: int = W, layers: int = 2, seed: int = 5):
        return load_model(tiny_factory(f"mistral_w{window}_l{layers}_s{seed}", "mistral", seed=seed,
                                       sliding_window=window, num_hidden_layers=layers, **SMALL))
    return make


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


class StepRecorder:
    """Wraps ``scheduler.schedule``: after each schedule (the step's peak) records blocks in use,
    whether a block-table row holds released entries, and preemptions."""

    def __init__(self, eng: SpecEngine) -> None:
        self.eng, self.used, self.preempted, self.released_seen = eng, [], 0, False
        self._schedule = eng.scheduler.schedule
        eng.scheduler.schedule = self

    def __call__(self):
        batch = self._schedule()
        alloc = self.eng.allocator
        self.used.append(alloc.num_blocks - alloc.num_free)
        self.preempted += len(batch.preempted)
        self.released_seen |= any(RELEASED in r.blocks for r in self.eng.scheduler.running)
        return batch


def _generate(eng, prompts, params):
    outs = eng.generate(prompts, params)
    assert eng.all_blocks_free()
    return [o.token_ids for o in outs]


# ---------------------------------------------------------------- exactness against transformers


@pytest.mark.parametrize("window,block_size,total", [(16, 4, 256), (64, 8, 256)])
def test_logits_and_greedy_match_transformers_full_forward(tiny_factory, mistral, window, block_size, total):
    """Target-only decoding to 16x (window 16) and 4x (window 64) the window, two requests in one
    batch, one of them with a prompt longer than the window prefilled in chunks: every decode
    step's logits equal transformers' full forward over the final sequence, and so do the tokens."""
    from transformers import AutoModelForCausalLM

    target = mistral(window)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_factory(f"mistral_w{window}_l2_s5")), dtype=torch.float32)
    prompts = _prompts([5, 2 * window + 7], seed=window)
    params = [SamplingParams(max_new_tokens=total - len(p), ignore_eos=True) for p in prompts]
    eng = SpecEngine(None, target, SpecConfig(num_blocks=200, block_size=block_size, max_num_tokens=24,
                                              prefix_cache=False))
    rec = StepRecorder(eng)
    seen: dict[tuple[str, int], torch.Tensor] = {}
    forward = eng.runner.forward  # run() and the verifier both go through forward()

    def capture(model_idx, model, rows, *args):
        out = forward(model_idx, model, rows, *args)
        for r, lg in zip(rows, out.logits):
            if r.want_logits == "all":  # a verify row: its first query is the pending token at L - 1
                seen[(r.req.request_id, r.positions[0])] = lg[0]
        return out

    eng.runner.forward = capture
    outs = eng.generate(prompts, params)
    assert eng.all_blocks_free() and rec.released_seen
    assert max(rec.used) <= 2 * eng.scheduler.window.peak(24, 24)  # two window-bounded requests
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        full = prompt + out.token_ids
        assert len(full) == total
        with torch.inference_mode():
            ref = hf(torch.tensor([full])).logits[0].float()  # (total, V)
        pos = list(range(len(prompt) - 1, total - 1))
        ours = torch.stack([seen[(out.request_id, p)] for p in pos])  # (n, V)
        diff, scale = (ours - ref[pos]).abs().max().item(), ref.abs().max().item()
        assert diff < 1e-4 * max(1.0, scale), f"request {i}: logits differ by {diff:.3g} (largest {scale:.3g})"
        assert ref[pos].argmax(-1).tolist() == full[len(prompt):]
        top2 = ref[pos].topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min().item() > 1e-3  # no greedy choice was a near-tie


# ---------------------------------------------------------------- speculation stays lossless

LENGTHS = [6, 40, 21, 13, 9, 30, 17, 25]


@pytest.fixture(scope="module")
def spec_case(mistral):
    """(target, prompts, params, target-only tokens without block release) at 4x the window."""
    target = mistral()
    prompts = _prompts(LENGTHS, seed=1)
    params = SamplingParams(max_new_tokens=4 * W, ignore_eos=True)
    cfg = SpecConfig(num_blocks=400, block_size=4, prefix_cache=False, window_reuse=False)
    return target, prompts, params, _generate(SpecEngine(None, target, cfg), prompts, params)


@pytest.mark.parametrize("batch,graphs", [(1, False), (8, False), (8, True)])
@pytest.mark.parametrize("tree", ["chain:4", "topk:2x3", "dynamic:16"])
def test_spec_greedy_equals_target_only_torch(spec_case, tree, batch, graphs):
    """Draft = the target's first layer (accepts often, not always); chunked prefill of prompts
    longer than the window; blocks are released while the batch runs; eager and padded (graph) steps."""
    target, prompts, params, ref = spec_case
    n = 3 if batch == 1 else len(prompts)  # one at a time costs a forward per request: three suffice
    eng = SpecEngine(truncate_layers(target, 1), target, SpecConfig(
        tree=tree, num_blocks=400, block_size=4, max_batch_size=batch, max_num_tokens=24, cuda_graphs=graphs))
    rec = StepRecorder(eng)
    assert _generate(eng, prompts[:n], params) == ref[:n]
    assert rec.released_seen
    assert 0 < eng.stats.accepted < eng.stats.drafted


@pytest.mark.parametrize("tree", ["dynamic:32", "topk:2x4"])
def test_tree_wider_than_the_window(spec_case, tree):
    """A tree's slots reach further past the pending token than the window (32 or 30 slots for
    W = 16) while its depth does not: windows count depth, and release keeps what depth needs."""
    target, prompts, params, ref = spec_case
    eng = SpecEngine(truncate_layers(target, 1), target, SpecConfig(tree=tree, num_blocks=400, block_size=4))
    assert eng.drafter.max_nodes >= W
    rec = StepRecorder(eng)
    assert _generate(eng, prompts, params) == ref
    assert rec.released_seen


@pytest.mark.parametrize("tree,batch", [("chain:4", 1), ("topk:2x3", 1), ("dynamic:16", 1), ("dynamic:16", 8)])
def test_spec_greedy_equals_target_only_triton(mistral, tree, batch):
    """The Triton kernels (interpreted) on a 1-layer model that drafts for itself, sequences of 4x
    the window (prompts longer than the window; at batch 1 prefilled in chunks of 32): outputs
    equal target-only decoding, and the draft, reading its window through the released table,
    proposes the target's own tokens (a static tree's every level, a dynamic tree's first level,
    is accepted)."""
    target = mistral(layers=1, seed=6)
    prompts = _prompts([56, 58, 60, 57, 61, 59, 62, 63][:batch], seed=2)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = _generate(SpecEngine(None, target, SpecConfig(num_blocks=200, block_size=4, window_reuse=False)),
                    prompts, params)
    eng = SpecEngine(target, target, SpecConfig(tree=tree, num_blocks=200, block_size=4,
                                                attention_backend="triton", max_num_tokens=32 * batch))
    rec = StepRecorder(eng)
    assert _generate(eng, prompts, params) == ref
    assert rec.released_seen
    st = eng.stats  # misses only in each request's last forward (cut by max_new_tokens)
    levels = 1 if tree.startswith("dynamic") else len(st.depth_steps)
    assert all(s - a <= batch for s, a in zip(st.depth_steps[:levels], st.depth_accepted[:levels]))


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("tree", [None, "chain:4", "dynamic:16"])
def test_long_request_holds_only_its_window(mistral, tree):
    """A request generating 16x its window holds at most ceil((W + lookahead) / block_size) + 2
    blocks at every step (read from the allocator after each schedule, the step's peak)."""
    target = mistral()
    draft = None if tree is None else truncate_layers(target, 1)
    bs = 4
    eng = SpecEngine(draft, target, SpecConfig(tree=tree or "chain:1", num_blocks=64, block_size=bs,
                                               prefix_cache=False))
    lookahead = eng.drafter.max_nodes
    rec = StepRecorder(eng)
    out = eng.generate([_prompts([7])[0]], SamplingParams(max_new_tokens=16 * W, ignore_eos=True))[0]
    assert len(out.token_ids) == 16 * W and eng.all_blocks_free()
    bound = -(-(W + lookahead) // bs) + 2
    assert max(rec.used) <= bound, f"peak {max(rec.used)} blocks > {bound}"
    assert len(rec.used) > 16 * W // (lookahead + 1)  # one record per step, and many steps ran
    assert rec.released_seen


def test_pool_serves_more_long_requests_with_reuse(mistral):
    """GUARANTEED_NO_EVICT admits requests by their window-bounded peak: a pool that holds two
    full-length requests holds many more windowed ones (admission only, no forward)."""
    target = mistral()
    prompts = _prompts([7] * 16)
    params = SamplingParams(max_new_tokens=16 * W, ignore_eos=True)
    admitted = {}
    for reuse in (False, True):
        eng = SpecEngine(truncate_layers(target, 1), target, SpecConfig(
            tree="chain:4", num_blocks=140, block_size=4, prefix_cache=False, window_reuse=reuse))
        for p in prompts:
            eng.add_request(p, params)
        eng.scheduler.schedule()
        admitted[reuse] = len(eng.scheduler.running)
    full = -(-(7 + 16 * W + 4 + 1) // 4)
    assert admitted[False] == 140 // full == 2
    assert admitted[True] >= 5 * admitted[False]


def test_request_longer_than_the_pool_runs_with_reuse(mistral):
    """Validation counts the window-bounded need: 16 blocks serve a 263-token request (reuse on)."""
    target = mistral()
    prompt, params = _prompts([7])[0], SamplingParams(max_new_tokens=16 * W, ignore_eos=True)
    off = SpecEngine(None, target, SpecConfig(num_blocks=16, block_size=4, window_reuse=False))
    with pytest.raises(ValueError, match="KV blocks"):
        off.add_request(prompt, params)
    on = SpecEngine(None, target, SpecConfig(num_blocks=16, block_size=4))
    big = SpecEngine(None, target, SpecConfig(num_blocks=100, block_size=4, window_reuse=False))
    assert _generate(on, [prompt], params) == _generate(big, [prompt], params)


# ---------------------------------------------------------------- no leaks: cache, preemption, mixed


def test_prefix_cache_and_forced_preemption(mistral):
    """Prompts sharing a 40-token prefix (longer than the window), chunked prefill, a pool small
    enough that MAX_UTILIZATION preempts: outputs equal the plain run, cached blocks a request
    dropped stay with the cache, and after the drain every block is free."""
    target = mistral()
    shared = _prompts([40], seed=3)[0]
    prompts = [shared + t for t in _prompts([3, 9, 5, 12, 7, 4], seed=4)]
    params = SamplingParams(max_new_tokens=3 * W, ignore_eos=True)
    ref = _generate(SpecEngine(None, target, SpecConfig(num_blocks=400, block_size=4, prefix_cache=False,
                                                        window_reuse=False)), prompts, params)
    eng = SpecEngine(truncate_layers(target, 1), target, SpecConfig(
        tree="topk:2x3", num_blocks=40, block_size=4, policy="max_utilization", max_num_tokens=12))
    rec = StepRecorder(eng)
    assert _generate(eng, prompts, params) == ref
    assert rec.preempted > 0 and rec.released_seen
    assert eng.scheduler.prefix_cache.stats.hit_tokens > 0


def test_mixed_windowed_and_full_models(tiny_factory, mistral):
    """A windowed target with a full-attention draft (or the reverse) keeps every block (no
    release: the full model reads them all); a draft with another window releases by the larger
    one. Each equals target-only output and ends with all blocks free."""
    windowed = mistral()
    full = load_model(tiny_factory("llama_small", "llama", seed=7, num_hidden_layers=1, **SMALL))
    other = mistral(window=24, layers=1, seed=8)
    prompts, params = _prompts([30, 9, 21], seed=5), SamplingParams(max_new_tokens=3 * W, ignore_eos=True)
    for target, draft, reuse in ((windowed, full, False), (full, other, False), (windowed, other, True)):
        ref = _generate(SpecEngine(None, target, SpecConfig(num_blocks=300, block_size=4)), prompts, params)
        eng = SpecEngine(draft, target, SpecConfig(tree="chain:3", num_blocks=300, block_size=4))
        assert (eng.scheduler.window is not None) == reuse
        rec = StepRecorder(eng)
        assert _generate(eng, prompts, params) == ref
        assert rec.released_seen == reuse
        if reuse:
            assert eng.scheduler.window.windows == (W, 24)
