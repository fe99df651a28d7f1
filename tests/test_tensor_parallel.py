"""Tensor parallelism on the CPU: gloo, 2 spawned ranks, tiny float32 Llama-family models (docs/parallel.md)."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import run_ranks, sharded_logits_diff

from specdec.config import ModelConfig
from specdec.errors import FieldError
from specdec.loading.registry import load_model
from specdec.models.tensor_parallel import check_split, kv_heads_of, local_config, shard_state

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
