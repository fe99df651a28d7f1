"""Type-strict validation: each confusing error of issue #13 now names the field and the allowed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.acceptance import shape_probs
from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = [17, 4, 99, 23, 5]


@pytest.fixture(scope="module")
def engine(tiny_target):
    return SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=4))


@pytest.mark.parametrize("kwargs,field,words", [
    ({"temperature": float("inf")}, "temperature", ["3.4e38"]),
    ({"temperature": 3.5e38}, "temperature", ["3.4e38", "float32"]),  # (finite in float64, infinite in float32)
    ({"temperature": "0.5"}, "temperature", ["number"]),
    ({"temperature": True}, "temperature", ["number"]),
    ({"temperature": 10**400}, "temperature", ["3.4e38"]),  # OverflowError: int too large to convert to float
    ({"repetition_penalty": 10**400}, "repetition_penalty", ["1e+30"]),
    ({"presence_penalty": -10**400}, "presence_penalty", ["[-2, 2]"]),
    ({"top_p": float("nan")}, "top_p", ["(0, 1]"]),
    ({"top_k": 2.5}, "top_k", ["int"]),
    ({"seed": 2**70}, "seed", ["2**64"]),
    ({"seed": 1.0}, "seed", ["int"]),
    ({"max_new_tokens": "8"}, "max_new_tokens", ["int"]),
    ({"stop": 123}, "stop", ["string"]),
    ({"stop": [1, 2]}, "stop", ["string"]),
    ({"stop_token_ids": 5}, "stop_token_ids", ["list"]),
    ({"stop_token_ids": [1.5]}, "stop_token_ids", ["ints"]),
    ({"stop_token_ids": "12"}, "stop_token_ids", ["list"]),
    ({"ignore_eos": 1}, "ignore_eos", ["bool"]),
])
def test_sampling_params_type_errors_name_the_field(kwargs, field, words):
    assert_field_error(SamplingParams, kwargs, field, words)


def assert_field_error(cls, kwargs: dict, field: str, words: list[str]) -> None:
    """``cls(**kwargs)`` raises a FieldError for ``field`` whose message has ``cls.field`` and ``words``."""
    with pytest.raises(FieldError) as info:
        cls(**kwargs)
    assert info.value.field == field
    msg = str(info.value)
    assert f"{cls.__name__}.{field}" in msg and all(w in msg for w in words), msg


def test_sampling_params_normalises_integral_types():
    p = SamplingParams(top_k=np.int64(5), seed=np.uint64(2**63), stop_token_ids=[np.int32(7)], max_new_tokens=3,
                       temperature=np.float32(0.5))
    assert (p.top_k, p.seed, p.stop_token_ids) == (5, 2**63, (7,))
    assert type(p.top_k) is int and type(p.seed) is int and type(p.stop_token_ids[0]) is int
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("kwargs,message", [
    ({"best_of": 2}, "SamplingParams has no field 'best_of' (vLLM's): there is no best-of or beam search"),
    ({"logits_processors": [print]}, "SamplingParams has no field 'logits_processors' (vLLM's): no logits "
                                     "processors besides the penalties"),
    ({"temprature": 0.5}, "SamplingParams has no field 'temprature' (did you mean temperature?)"),
    ({"max_token": 3}, "SamplingParams has no field 'max_token' (did you mean max_tokens or max_new_tokens?)"),
    ({"xyz": 1}, "SamplingParams has no field 'xyz' (fields: allowed_token_ids, bad_words, fit_max_new_tokens,"),
])
def test_sampling_params_unknown_fields_say_what_to_use(kwargs, message):
    """Was Python's "__init__() got an unexpected keyword argument": a vLLM field specdec lacks now says what to do
    instead, a misspelt one the field it meant."""
    with pytest.raises(TypeError) as info:
        SamplingParams(max_tokens=4, **kwargs)
    assert str(info.value).startswith(message), info.value


def test_top_k_keeps_the_largest_logits_at_any_temperature():
    """Huge temperatures flatten the scaled logits to ties; the kept set still follows the logits."""
    logits = torch.tensor([0.0, 1.0, 5.0, -2.0, 4.0, 3.0, 2.5, 6.0])
    for temp in (1.0, 1e30, 3e38):
        kept = (shape_probs(logits, temp, top_k=3) > 0).nonzero().flatten().tolist()
        assert kept == [2, 4, 7], temp
    with pytest.raises(ValueError, match="finite"):
        shape_probs(logits, float("inf"), top_k=3)


def test_the_largest_temperature_samples_through_a_draft_model(tiny_target, tiny_draft):
    """A temperature up to float32's largest samples (the draft's distribution too, uniform to rounding): no row
    fails, where a larger one, infinite in float32, is refused before it reaches the engine."""
    eng = SpecEngine(tiny_draft, tiny_target, SpecConfig(num_blocks=64, block_size=4, tree="chain:3"))
    outs = eng.generate([PROMPT, PROMPT], SamplingParams(temperature=3.4e38, seed=7, max_new_tokens=6,
                                                         ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.parametrize("kwargs,field,words", [
    ({"num_blocks": "10"}, "num_blocks", ["int"]),
    ({"num_blocks": 10.0}, "num_blocks", ["int"]),
    ({"block_size": 3.5}, "block_size", ["int", ">= 1"]),
    ({"block_size": True}, "block_size", ["int"]),
    ({"kv_memory_bytes": 1e9}, "kv_memory_bytes", ["int"]),
    ({"max_batch_size": "8"}, "max_batch_size", ["int"]),
    ({"max_num_tokens": 0.5}, "max_num_tokens", ["int"]),
    ({"prefix_cache": "yes"}, "prefix_cache", ["bool"]),
    ({"tree": 4}, "tree", ["str", "chain:K"]),
    ({"policy": None}, "policy", ["guaranteed_no_evict"]),
    ({"dtype": ["float32"]}, "dtype", ["float32"]),
    ({"device": "gpu"}, "device", ["cpu"]),
    ({"device": 3.5}, "device", ["torch device"]),
    ({"ngram_max_n": 0}, "ngram_max_n", [">= 1"]),
    ({"fused_verify": 1}, "fused_verify", ["True or False"]),
])
def test_spec_config_type_errors_name_the_field(kwargs, field, words):
    assert_field_error(SpecConfig, kwargs, field, words)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given without a GPU")
def test_cuda_device_without_a_gpu():
    with pytest.raises(FieldError, match=r"SpecConfig.device is a CUDA device, but this torch .* sees no CUDA device"):
        SpecConfig(device="cuda")


def test_a_dict_is_not_a_spec_config(tiny_target):
    with pytest.raises(TypeError, match=r"config must be a SpecConfig \(e.g. SpecConfig\(\*\*options\)\)"):
        SpecEngine(None, tiny_target, {"num_blocks": 16})


def test_load_model_refuses_an_empty_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("", "  "):
        with pytest.raises(ModelNotFoundError, match="model name is empty"):
            load_model(name)
    with pytest.raises(TypeError, match="model must be a name or a path"):
        load_model(None)


def test_truncated_safetensors_names_the_file(tiny_llama_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    data = (tiny_llama_dir / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(UnsupportedModelError) as info:
        load_model(broken)
    assert str(broken / "model.safetensors") in str(info.value) and "truncated" in str(info.value)


@pytest.mark.parametrize("form", ["list", "tuple", "numpy_ints", "numpy_array", "numpy_uint", "tensor",
                                  "tensor_int32"])
def test_prompt_forms_give_the_same_output(engine, form):
    expect = engine.generate([PROMPT], PARAMS)[0].token_ids
    prompt = {"list": PROMPT, "tuple": tuple(PROMPT), "numpy_ints": [np.int64(t) for t in PROMPT],
              "numpy_array": np.array(PROMPT), "numpy_uint": np.array(PROMPT, dtype=np.uint16),
              "tensor": torch.tensor(PROMPT), "tensor_int32": torch.tensor(PROMPT, dtype=torch.int32)}[form]
    single = engine.generate(prompt, PARAMS)  # one prompt given directly
    batch = engine.generate([prompt, prompt], PARAMS)
    assert [o.token_ids for o in single + batch] == [expect] * 3
    assert single[0].prompt_token_ids == PROMPT and type(single[0].prompt_token_ids[0]) is int
    assert engine.all_blocks_free()


@pytest.mark.parametrize("prompt,words", [
    (torch.tensor([1.0, 2.0]), ["prompt must be", "dtype torch.float32"]),
    (torch.tensor([[1, 2], [3, 4]])[0:1], ["prompt must be", "shape (1, 2)"]),
    (torch.tensor([True, False]), ["prompt must be", "torch.bool"]),
    (np.array([0.5, 1.5]), ["prompt must be", "float64"]),
    ([np.float32(1.0), 2], ["prompt must be", "float32"]),
])
def test_bad_prompt_forms_are_named(engine, prompt, words):
    out = engine.generate([prompt], PARAMS)[0]
    assert out.finish_reason == "error"
    assert all(w in str(out.error) for w in words), str(out.error)
    assert not engine.scheduler.has_work


def test_batch_of_prompts_as_2d_tensor(engine):
    expect = engine.generate([PROMPT, PROMPT[::-1]], PARAMS)
    outs = engine.generate(torch.tensor([PROMPT, PROMPT[::-1]]), PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expect]


def test_stop_string_without_a_tokenizer_is_an_error(engine):
    outs = engine.generate([PROMPT, PROMPT], [SamplingParams(max_new_tokens=4, stop=["x"]), PARAMS])
    assert outs[0].finish_reason == "error"
    assert isinstance(outs[0].error, FieldError) and outs[0].error.field == "stop"
    assert "tokenizer" in str(outs[0].error)
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 6
    with pytest.raises(FieldError, match="SamplingParams.stop needs a model with a tokenizer"):
        engine.add_request(PROMPT, SamplingParams(stop="x"))
    assert not engine.scheduler.has_work
