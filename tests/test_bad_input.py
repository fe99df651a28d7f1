"""Bad input gets a ValueError naming the field and its allowed range; other requests go on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.errors import ModelNotFoundError, UnsupportedModelError
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

GOOD = [[5, 6, 7], [8, 9], [30, 31, 32, 33, 34, 35]]
PARAMS = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    return SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:3", num_blocks=256, block_size=8))


@pytest.fixture(autouse=True)
def _drain(request):
    """If a test queued a request by mistake, run it out so the next test starts clean."""
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        while eng.scheduler.has_work:
            eng.step()


@pytest.fixture(scope="module")
def good_outputs(engine):
    outs = engine.generate(GOOD, PARAMS)
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in outs)
    return [o.token_ids for o in outs]


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs,field,shown", [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_p": -0.2}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", ">= -1"),
    ({"max_new_tokens": 0}, "max_new_tokens", ">= 1"),
    ({"max_new_tokens": -5}, "max_new_tokens", ">= 1"),
    ({"seed": -1}, "seed", ">= 0"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop_token_ids": [-3]}, "stop_token_ids", ">= 0"),
])
def test_sampling_params_rejected_at_construction(kwargs, field, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert field in msg and shown in msg, msg


def test_sampling_params_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=0, max_new_tokens=1, seed=0, stop=["x"])
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(stop="abc").stop == ("abc",)


# ---------------------------------------------------------------- prompts inside generate()

# (prompt, words the error message must contain)
BAD_PROMPTS = [
    ([], ["empty"]),
    ([5] * 512, ["512", "max length"]),  # the tiny models' max_position_embeddings is 512
    ([5, -1, 3], ["-1", "vocabulary", "[0, 256)"]),
    ([5, 256], ["256", "vocabulary", "[0, 256)"]),
    ([5, 10_000], ["10000", "vocabulary"]),
    ([5] * 505, ["max_new_tokens", "max length"]),  # prompt fits, prompt + 8 new + 3 drafted do not
    ("some text", ["tokenizer"]),  # the tiny models have no tokenizer
    (3.5, ["prompt must be"]),
    ([1.5, 2.0], ["prompt must be"]),
    ([{"role": "user"}], ["content"]),
]


def test_bad_prompts_in_generate_error_and_others_finish(engine, good_outputs):
    bad_prompts = [p for p, _ in BAD_PROMPTS]
    prompts = [GOOD[0], *bad_prompts[:5], GOOD[1], *bad_prompts[5:], GOOD[2]]
    outs = engine.generate(prompts, PARAMS)
    assert len(outs) == len(prompts)
    good = [outs[0], outs[6], outs[-1]]
    bad = outs[1:6] + outs[7:-1]
    assert [o.token_ids for o in good] == good_outputs
    for o in good:
        assert o.error is None and o.finish_reason in ("stop", "length")
    for o, (prompt, words) in zip(bad, BAD_PROMPTS, strict=True):
        assert o.finish_reason == "error", prompt
        assert isinstance(o.error, ValueError), (prompt, o.error)
        assert o.token_ids == [] and o.finished
        for w in words:
            assert w in str(o.error), (prompt, str(o.error), w)
    assert len({o.request_id for o in outs}) == len(outs)
    assert engine.all_blocks_free()


def test_bad_params_entry_in_generate(engine, good_outputs):
    """A per-request params list: a request too large for the KV pool errors, its neighbours run."""
    huge = SamplingParams(max_new_tokens=500)  # fits the model (2 + 500 <= 512), needs 63 of 16 blocks
    small = SamplingParams(max_new_tokens=8)
    eng = SpecEngine(None, engine.target, SpecConfig(num_blocks=16, block_size=8))
    outs = eng.generate(GOOD, [small, huge, small])
    assert outs[1].finish_reason == "error"
    assert isinstance(outs[1].error, ValueError)
    assert "KV blocks" in str(outs[1].error) and "16" in str(outs[1].error)
    assert outs[0].finish_reason in ("stop", "length") and outs[2].finish_reason in ("stop", "length")
    ref = SpecEngine(None, engine.target, SpecConfig(num_blocks=64, block_size=8)).generate(
        [GOOD[0], GOOD[2]], small)
    assert [outs[0].token_ids, outs[2].token_ids] == [r.token_ids for r in ref]
    assert eng.all_blocks_free()
    with pytest.raises(ValueError, match="params has 2 entries for 3 prompts"):
        eng.generate(GOOD, [small, small])


@pytest.mark.parametrize("prompt,words", BAD_PROMPTS)
def test_add_request_raises_directly(engine, prompt, words):
    with pytest.raises(ValueError) as info:
        engine.add_request(prompt, PARAMS)
    for w in words:
        assert w in str(info.value)
    assert not engine.scheduler.has_work  # nothing was queued
    assert engine.all_blocks_free()


def test_add_request_rejects_wrong_params_type(engine):
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([5, 6], {"temperature": 0.5})
    assert not engine.scheduler.has_work


def test_add_request_refuses_a_live_request_id(engine):
    first = engine.add_request(GOOD[0], PARAMS, request_id="mine")
    with pytest.raises(ValueError, match="'mine' is already in use"):
        engine.add_request(GOOD[1], PARAMS, request_id="mine")
    assert engine.scheduler.waiting == [first]  # the second was not queued
    while engine.scheduler.has_work:
        engine.step()
    assert first.finished and engine.all_blocks_free()
    again = engine.add_request(GOOD[1], PARAMS, request_id="mine")  # free again once the first has finished
    while engine.scheduler.has_work:
        engine.step()
    assert again.finished and engine.all_blocks_free()


def test_engine_still_works_after_bad_input(engine, good_outputs):
    for p, _ in BAD_PROMPTS:
        with pytest.raises(ValueError):
            engine.add_request(p, PARAMS)
    outs = engine.generate(GOOD, PARAMS)
    assert [o.token_ids for o in outs] == good_outputs
    assert engine.all_blocks_free()


# ---------------------------------------------------------------- SpecConfig and models

@pytest.mark.parametrize("kwargs,words", [
    ({"tree": "foo:3"}, ["tree spec", "foo:3", "chain:K"]),
    ({"tree": "chain:0"}, ["[1, 63]", "0"]),
    ({"tree": "chain:64"}, ["[1, 63]", "64"]),
    ({"tree": "topk:0x3"}, ["width", ">= 1"]),
    ({"tree": "dynamic:0"}, ["budget", "[1, 63]"]),
    ({"policy": "x"}, ["policy", "guaranteed_no_evict", "max_utilization"]),
    ({"block_size": 0}, ["block_size", ">= 1"]),
    ({"max_batch_size": 0}, ["max_batch_size", ">= 1"]),
    ({"max_num_tokens": 0}, ["max_num_tokens", ">= 1"]),
    ({"dtype": "float8"}, ["dtype", "float32"]),
    ({"attention_backend": "cuda"}, ["attention_backend", "torch"]),
    ({"num_blocks": 0}, ["num_blocks", ">= 1"]),
    ({"num_blocks": -4}, ["num_blocks", ">= 1"]),
    ({"kv_memory_bytes": 0}, ["kv_memory_bytes", ">= 1"]),
])
def test_bad_spec_config(kwargs, words):
    with pytest.raises(ValueError) as info:
        SpecConfig(**kwargs)
    for w in words:
        assert w in str(info.value), (str(info.value), w)


def test_ngram_drafter_needs_a_chain(tiny_target):
    with pytest.raises(ValueError, match="chain"):
        SpecEngine("ngram", tiny_target, SpecConfig(tree="topk:2x2", num_blocks=8))


def test_draft_with_other_vocab_is_refused(tiny_target, tiny_factory):
    other = load_model(tiny_factory("vocab300", vocab_size=300))
    with pytest.raises(ValueError, match="vocab_size"):
        SpecEngine(other, tiny_target, SpecConfig(num_blocks=8))


def test_unknown_model_path(tmp_path, tiny_target):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        load_model(missing)
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        SpecEngine(None, str(missing), SpecConfig(num_blocks=8))
    with pytest.raises(ModelNotFoundError, match="no_such_model"):
        SpecEngine(str(missing), tiny_target, SpecConfig(num_blocks=8))
    not_a_model = tmp_path / "weights.bin"
    not_a_model.write_bytes(b"\0" * 16)
    with pytest.raises(UnsupportedModelError, match="weights.bin"):
        load_model(not_a_model)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(empty_dir)


@pytest.mark.slow
def test_text_prompts_with_a_tokenizer(smollm2):
    eng = SpecEngine(None, smollm2, SpecConfig(num_blocks=24, block_size=16))
    too_long = [5] * smollm2.config.max_position_embeddings
    prompts = ["", "Hello", too_long, [{"role": "user", "content": "Hi"}], [{"role": 1, "content": "x"}]]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "length", "error"]
    assert "empty" in str(outs[0].error)
    assert str(smollm2.config.max_position_embeddings) in str(outs[2].error)
    assert "role" in str(outs[4].error)
    assert all(len(outs[i].token_ids) == 2 for i in (1, 3))
    assert eng.all_blocks_free()


# ---------------------------------------------------------------- hostile checkpoint folders

def broken_copy(src: Path, dst: Path, config=None, config_text: str | None = None, state=None) -> Path:
    """A copy of checkpoint folder ``src`` at ``dst``; ``config(dict)`` / ``state(dict)`` edit config.json and
    model.safetensors in place, ``config_text`` replaces config.json."""
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    if config_text is not None:
        cfg_path.write_text(config_text)
    if config is not None:
        cfg = json.loads(cfg_path.read_text())
        config(cfg)
        cfg_path.write_text(json.dumps(cfg))
    if state is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        state(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _no_head_dim(cfg, **sizes):
    cfg.pop("head_dim", None)
    cfg.update(sizes)


@pytest.mark.parametrize("edit,words", [
    (dict(config_text="{not json"), ["config.json", "not valid JSON"]),
    (dict(config_text=""), ["config.json", "not valid JSON"]),
    (dict(config_text="[1, 2]"), ["config.json", "JSON object", "list"]),
    (dict(config=lambda c: c.update(num_attention_heads=0)), ["config.json", "num_attention_heads", ">= 1", "got 0"]),
    (dict(config=lambda c: c.update(num_attention_heads=-4)), ["config.json", "num_attention_heads", "got -4"]),
    (dict(config=lambda c: _no_head_dim(c, num_attention_heads=3, num_key_value_heads=3)),
     ["config.json", "hidden_size (64)", "num_attention_heads (3)"]),
    (dict(config=lambda c: c.update(num_key_value_heads=3)),
     ["config.json", "num_attention_heads (4)", "num_key_value_heads (3)"]),
    (dict(config=lambda c: c.update(num_key_value_heads=0)), ["config.json", "num_key_value_heads", "got 0"]),
    (dict(config=lambda c: c.update(vocab_size=0)), ["config.json", "vocab_size", "got 0"]),
    (dict(config=lambda c: c.update(hidden_size="64")), ["config.json", "hidden_size", "integer", "'64'"]),
    (dict(config=lambda c: c.update(vocab_size=256.0)), ["config.json", "vocab_size", "integer", "256.0"]),
    (dict(config=lambda c: c.update(rms_norm_eps="x")), ["config.json", "rms_norm_eps", "number > 0", "'x'"]),
    (dict(config=lambda c: c.update(rope_theta=-1.0)), ["config.json", "rope_theta", "number > 0", "-1.0"]),
    (dict(config=lambda c: c.update(rope_scaling={"type": "foo", "factor": 2.0})),
     ["config.json", "rope_scaling", "'foo'", "linear, llama3"]),
    (dict(config=lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0})),
     ["config.json", "rope_parameters", "low_freq_factor"]),
    (dict(config=lambda c: c.update(rope_scaling="x")), ["config.json", "rope_scaling", "object or null"]),
    (dict(config=lambda c: c.update(architectures="LlamaForCausalLM")), ["config.json", "architectures", "list"]),
    (dict(state=lambda s: s.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32))),
     ["model.layers.0.self_attn.q_proj.weight", "(64, 32)", "expected (64, 64)"]),
    (dict(state=lambda s: s.__setitem__("model.norm.weight", torch.zeros(65))), ["model.norm.weight", "(65,)"]),
    (dict(state=lambda s: s.pop("model.layers.1.mlp.up_proj.weight")), ["missing", "model.layers.1.mlp.up_proj"]),
    (dict(state=lambda s: s.__setitem__("model.layers.0.foo.weight", torch.zeros(3))),
     ["unexpected", "model.layers.0.foo.weight"]),
    (dict(state=lambda s: s.update({k: v.to(torch.int8) for k, v in s.items()})), ["floating point", "int8"]),
], ids=["not-json", "empty", "json-list", "heads-0", "heads-negative", "heads-not-dividing-hidden",
        "kv-heads-not-dividing", "kv-heads-0", "vocab-0", "size-as-string", "size-as-float", "eps-as-string",
        "theta-negative", "rope-unknown-type", "rope-llama3-incomplete", "rope-not-an-object", "architectures-a-string",
        "wrong-shape", "wrong-shape-norm", "missing-weight", "unexpected-weight", "int8-weights"])
def test_broken_checkpoint_folder_names_the_file(tiny_llama_dir, tmp_path, edit, words):
    """Each problem is an UnsupportedModelError naming the folder (or its config.json) and what is wrong."""
    broken = broken_copy(tiny_llama_dir, tmp_path / "broken", **edit)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(broken)
    msg = str(info.value)
    assert str(broken) in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, (msg, w)


def test_broken_checkpoint_through_the_engine(tiny_llama_dir, tmp_path):
    broken = broken_copy(tiny_llama_dir, tmp_path / "broken", config=lambda c: c.update(num_attention_heads=0))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads must be an integer >= 1, got 0"):
        SpecEngine(None, str(broken), SpecConfig(num_blocks=8))


def test_config_without_architectures_loads_by_model_type(tiny_llama_dir, tmp_path):
    folder = broken_copy(tiny_llama_dir, tmp_path / "noarch", config=lambda c: c.pop("architectures"))
    assert load_model(folder).config.architecture == "LlamaForCausalLM"
    other = broken_copy(tiny_llama_dir, tmp_path / "gpt2", config=lambda c: c.pop("architectures"))
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        load_model(other)


@pytest.mark.parametrize("index,words", [
    ("{bad", ["model.safetensors.index.json", "not valid JSON"]),
    ("[]", ["model.safetensors.index.json", "JSON object"]),
    ("{}", ["model.safetensors.index.json", "weight_map"]),
])
def test_broken_shard_index_names_the_file(tiny_llama_dir, tmp_path, index, words):
    broken = broken_copy(tiny_llama_dir, tmp_path / "broken")
    (broken / "model.safetensors.index.json").write_text(index)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(broken)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("spoil,words", [
    (lambda d: (d / "tokenizer.json").write_text("{corrupt"), ["tokenizer.json", "not valid JSON"]),
    (lambda d: (d / "tokenizer.json").write_text(""), ["tokenizer.json", "not valid JSON"]),
    (lambda d: (d / "tokenizer_config.json").write_text("[]"), ["tokenizer_config.json", "JSON object"]),
    (lambda d: (d / "tokenizer.json").write_text("{}"), ["cannot load the tokenizer"]),
    (lambda d: (d / "tokenizer.json").unlink(), ["cannot load the tokenizer"]),
], ids=["corrupt", "empty", "config-a-list", "wrong-structure", "tokenizer-json-missing"])
def test_broken_tokenizer_names_the_file(tiny_llama_dir, tmp_path, spoil, words):
    from serving_helpers import byte_tokenizer

    folder = broken_copy(tiny_llama_dir, tmp_path / "tok")
    byte_tokenizer().save_pretrained(str(folder))
    assert load_model(folder).tokenizer is not None
    spoil(folder)
    with pytest.raises(UnsupportedModelError) as info:
        load_model(folder)
    msg = str(info.value)
    assert str(folder) in msg and "\n" not in msg, msg
    assert all(w in msg for w in words), msg
