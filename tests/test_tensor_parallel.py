"""Tensor parallelism on the CPU: gloo, 2 spawned ranks, tiny float32 Llama-family models (docs/parallel.md)."""

from __future__ import annotations

import pytest
import torch
from test_eagle import PROMPTS as EAGLE_PROMPTS
from test_eagle import setup  # noqa: F401 - the module's trained tiny EAGLE draft, a fixture
from tp_helpers import (
    engine_runs,
    epoch_choices,
    parts_placed,
    passes,
    pool_blocks,
    run_ranks,
    sampled_runs,
    sharded_logits_diff,
)

from specdec.config import ModelConfig
from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.loading.registry import load_model
from specdec.models.tensor_parallel import check_split, kv_heads_of, local_config, shard_state
from specdec.prompts import to_prompt_ids
from specdec.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 200, 17], [3] * 11 + [250, 4], [7]]


def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("kw, size", [(dict(num_heads=6, num_kv_heads=2), 4), (dict(num_kv_heads=4), 3),
                                      (dict(num_heads=8, num_kv_heads=2), 3), (dict(intermediate_size=130), 4)])
def test_split_refused_naming_the_numbers(kw, size):
    cfg = _cfg(**kw)
    with pytest.raises(FieldError) as err:
        check_split(cfg, size)
    assert err.value.field == "tensor_parallel_size"
    msg = str(err.value)
    assert f"num_heads ({cfg.num_heads})" in msg and f"num_kv_heads ({cfg.num_kv_heads})" in msg
    assert f"intermediate_size ({cfg.intermediate_size})" in msg and f"got {size}" in msg


def test_kv_heads_split_or_replicated():
    assert [kv_heads_of(_cfg(), r, 2) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [kv_heads_of(_cfg(num_heads=8, num_kv_heads=2), r, 4) for r in range(4)] == [range(0, 1)] * 2 + [
        range(1, 2)] * 2
    assert local_config(_cfg(num_heads=8, num_kv_heads=2), 4).num_kv_heads == 1


def test_shard_state_shapes_cover_the_whole():
    """The ranks' slices put back together are the whole tensors (vocabulary rows padded with zeros)."""
    cfg = _cfg(vocab_size=255)
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (255, 64), "lm_head.weight": (255, 64), "model.norm.weight": (64,),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.k_proj.weight": (32, 64),
              "model.layers.0.self_attn.k_proj.bias": (32,), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.gate_proj.weight": (128, 64), "model.layers.0.mlp.down_proj.weight": (64, 128)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    parts = [shard_state(cfg, state, r, 2) for r in range(2)]
    assert parts[0]["model.embed_tokens.weight"].shape == (128, 64)
    assert torch.equal(parts[1]["lm_head.weight"][-1], torch.zeros(64))
    for name, w in state.items():
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        joined = w if w.dim() == 1 and "proj" not in name else torch.cat([p[name] for p in parts], dim)
        assert torch.equal(joined[:w.shape[0]], w), name


def test_sharded_logits_equal_whole_model(tiny_factory):
    """2 ranks: KV heads split (Llama, 2 KV heads), a KV head replicated (1 KV head), q/k/v biases, tied
    embeddings and a vocabulary that does not divide by 2 (Qwen2, vocab 255)."""
    folders = [tiny_factory("tp_llama", seed=3), tiny_factory("tp_llama_mqa", seed=4, num_key_value_heads=1),
               tiny_factory("tp_qwen2_tied", "qwen2", seed=5, vocab_size=255, tie_word_embeddings=True)]
    diffs = run_ranks(sharded_logits_diff, 2, [load_model(f).model for f in folders], PROMPTS)
    for rank in diffs:
        assert all(d < 1e-5 for d in rank), diffs


GEN_PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (5, 23, 41, 12)]
RUNS = {"target_ngram": [(None, dict(block_size=4, num_blocks=128, max_num_tokens=16)),  # chunked prefill
                         (None, dict(block_size=4, num_blocks=20, policy="max_utilization")),  # preemption
                         ("ngram", dict(tree="chain:3", block_size=4, num_blocks=128, max_num_tokens=16))],
        # padded steps (CUDA's graphs, run eagerly over the same buffers) and pipelined, n-gram chains on the device
        "padded": [(None, dict(block_size=4, num_blocks=128, max_num_tokens=16, cuda_graphs=True, pipeline=True)),
                   ("ngram", dict(tree="chain:3", block_size=4, num_blocks=128, max_num_tokens=16, cuda_graphs=True,
                                  pipeline=True, ngram_device=True))],
        "draft": [("model", dict(tree="chain:4", block_size=4, num_blocks=128, max_num_tokens=16)),
                  ("model", dict(tree="topk:2x3", block_size=4, num_blocks=40, policy="max_utilization"))]}


@pytest.mark.parametrize("which", sorted(RUNS))
def test_tp2_greedy_equals_tp1(tiny_target, tiny_draft, which):
    """Greedy tokens of 2 ranks equal one process's, target-only (chunked prefill, preemption), n-gram (drafting
    from the first pass's text, so tokens are accepted; prefix-cache hits), both again with padded, pipelined steps,
    and a draft model (chain, tree)."""
    runs, want = RUNS[which], []
    for draft, options in runs:
        eng = SpecEngine(tiny_draft if draft == "model" else draft, tiny_target, SpecConfig(**options))
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        want.append([[o.token_ids for o in eng.generate(GEN_PROMPTS, params)] for _ in range(passes(draft))])
    ranks = run_ranks(engine_runs, 2, (tiny_target.model, tiny_draft.model), runs, GEN_PROMPTS, 16)
    for rank, got in enumerate(ranks):
        for (tokens, free, preempted, accepted), expect, (draft, options) in zip(got, want, runs):
            assert tokens == expect, (rank, draft, options)
            assert free, (rank, draft, options)
            assert preempted or options.get("policy") != "max_utilization", "the pool was meant to preempt"
            # (host n-gram only: device chains come from the row's own text, which this random target rarely repeats)
            assert accepted or draft is None or options.get("ngram_device"), "n-gram tokens were meant to be accepted"


SAMPLED_RUNS = [("model", dict(tree="topk:2x2", block_size=4, num_blocks=128, max_num_tokens=16))]


@pytest.mark.parametrize("penalized", [False, True], ids=["plain", "penalized"])
def test_tp2_sampled_equals_tp1(tiny_target, tiny_draft, penalized):
    """Seeded sampled rows (T=0.7 top-p 0.9, T=1.0) batched with a greedy row: 2 ranks give one process's tokens
    with a draft model (a static tree's deterministic children; chunked prefill); an unseeded row gets the same seed
    on both ranks (torch's global RNG seeded from rank 0); penalized: a repetition penalty on the first sampled row
    and presence and frequency penalties on the greedy one (the rule over the gathered logits on every rank).
    (n-gram drafts sampled: test_tensor_parallel_cli.py.)"""
    first, greedy = (dict(repetition_penalty=1.3), dict(presence_penalty=0.8, frequency_penalty=0.4)) if penalized \
        else ({}, {})
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11, **first),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=12),
              SamplingParams(max_new_tokens=12, ignore_eos=True, **greedy),
              SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7)]  # unseeded: ranks agree only
    want = []
    for draft, options in SAMPLED_RUNS:
        eng = SpecEngine(tiny_draft if draft == "model" else draft, tiny_target, SpecConfig(**options))
        want.append([o.token_ids for o in eng.generate(GEN_PROMPTS, params)])
    ranks = run_ranks(sampled_runs, 2, (tiny_target.model, tiny_draft.model), SAMPLED_RUNS, GEN_PROMPTS, params)
    for (got0, free0), (got1, free1), expect, run in zip(*ranks, want, SAMPLED_RUNS):
        assert got0[:3] == expect[:3] and got0 == got1, run
        assert free0 and free1, run


EAGLE_RUNS = [("model", dict(tree="topk:2x3", block_size=4, num_blocks=128, max_num_tokens=16)),  # chunked prefill
              ("model", dict(tree="dynamic:8", block_size=4, num_blocks=60, policy="max_utilization")),  # preemption
              # the device program (padded steps), its verify fused and pipelined
              ("model", dict(tree="dynamic:8", block_size=4, num_blocks=128, cuda_graphs=True, pipeline=True))]


def test_tp2_eagle_draft_equals_tp1(setup):  # noqa: F811 - test_eagle's trained tiny EAGLE draft
    """An EAGLE draft (kept whole on every rank, reading the sharded target's features; trained, so paths of several
    nodes are accepted): greedy tokens of 2 ranks equal one process's with a static and a dynamic tree (chunked prefill;
    preemption; the device program with padded, pipelined steps), every block free after; seeded sampled rows batched
    with greedy ones give the same tokens on both ranks and one process's."""
    root, _, _ = setup
    target = load_model(root / "target")
    draft = load_model(root / "full", target=target)
    prompts = [to_prompt_ids(p, target.tokenizer) for p in EAGLE_PROMPTS[:4]]  # (the ranks' models have no tokenizer)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = [[o.token_ids for o in SpecEngine(draft, target, SpecConfig(**options)).generate(prompts, params)]
            for _, options in EAGLE_RUNS]
    ranks = run_ranks(engine_runs, 2, (target.model, draft.model), EAGLE_RUNS, prompts, 16)
    for rank, got in enumerate(ranks):
        for (tokens, free, preempted, accepted), expect, (_, options) in zip(got, want, EAGLE_RUNS):
            assert tokens == [expect], (rank, options)
            assert free and accepted > 0, (rank, options)
            assert preempted or options.get("policy") != "max_utilization", "the pool was meant to preempt"
    sampled = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.7, top_p=0.9, seed=11),
               SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=12),
               SamplingParams(max_new_tokens=12, ignore_eos=True), SamplingParams(max_new_tokens=12, ignore_eos=True)]
    one = SpecEngine(draft, target, SpecConfig(**EAGLE_RUNS[0][1])).generate(prompts, sampled)
    [[(got0, free0)], [(got1, free1)]] = run_ranks(sampled_runs, 2, (target.model, draft.model), EAGLE_RUNS[:1],
                                                   prompts, sampled)
    assert got0 == got1 == [o.token_ids for o in one] and free0 and free1


def test_tp_ranks_agree_on_the_kv_pool(tiny_target):
    """Ranks that measure different KV budgets (on CUDA each its own GPU's free memory) size their pools from the
    least of them, so every rank has the same blocks and schedules the same batches."""
    got = run_ranks(pool_blocks, 2, tiny_target.model, [3 << 20, 2 << 20])
    assert got[0] == got[1] and got[0][0] == got[0][1], got


def test_tp_ranks_hold_rank0s_budgets():
    """Ranks whose step timings disagree (rank 0 measures budget 7 the fastest, rank 1 budget 3) hold, step for
    step, the budgets rank 0 chose once each ended epoch is agreed (``EpochBudget.agree``); left to themselves
    they part."""
    agreed = run_ranks(epoch_choices, 2, True)
    assert agreed[0] == agreed[1] and agreed[0][-40:].count(7) > 30, agreed
    apart = run_ranks(epoch_choices, 2, False)
    assert apart[0] == agreed[0] and apart[1][-40:].count(3) > 30, apart


def test_tp_ranks_move_only_their_part(tiny_target):
    """Under tensor parallelism models load on the CPU and each rank moves only its part to its device (meta here,
    for a GPU): the whole model stays where it was, so a target larger than one GPU never sits whole on one."""
    for part, whole in run_ranks(parts_placed, 2, tiny_target.model):
        assert part == {"meta"} and whole == {"cpu"}, (part, whole)


def test_tp_config_checked(tiny_target):
    with pytest.raises(FieldError, match="tensor_parallel_size must be an int >= 1"):
        SpecConfig(tensor_parallel_size=0)
    with pytest.raises(FieldError, match="needs a torch.distributed process group"):
        SpecEngine(None, tiny_target, SpecConfig(tensor_parallel_size=2))
    with pytest.raises(FieldError, match="adaptive=True"):
        SpecEngine(None, tiny_target, SpecConfig(tensor_parallel_size=2, adaptive=True))
