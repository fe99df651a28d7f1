"""vLLM's request options beside sampling: ``include_stop_str_in_output`` keeps the stop string that ended an output
(streamed the same), ``truncate_prompt_tokens`` keeps a prompt's last k tokens (-1: as many as leave room for
output), ``skip_special_tokens=False`` spells special tokens out in the text; all through the Python API and the
server's fields, and bad values name the field."""

from __future__ import annotations

import pytest
from test_repetition_penalty import PROMPTS

from specdec.engine import SpecConfig, SpecEngine
from specdec.errors import FieldError
from specdec.sampling_params import SamplingParams
from specdec.serving.protocol import BadRequest, parse_completion

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engine(letter_target):
    return SpecEngine("ngram", letter_target, SpecConfig(tree="chain:3", num_blocks=128, block_size=4))


def test_the_stop_string_is_kept_when_asked(engine):
    """The first stop string found ends the output either way; with ``include_stop_str_in_output`` the text runs
    to its end (the one that begins first, the first given among those that begin there), streamed or not."""
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0].text
    stop, other = free[4:6], free[4:7]
    base = dict(max_tokens=20, ignore_eos=True, stop=[stop, other])
    cut = engine.generate([PROMPTS[0]], SamplingParams(**base))[0]
    kept = engine.generate([PROMPTS[0]], SamplingParams(**base, include_stop_str_in_output=True))[0]
    at = free.find(stop)
    assert (cut.text, cut.finish_reason) == (free[:at], "stop")
    assert (kept.text, kept.finish_reason) == (free[:at + len(stop)], "stop")
    assert kept.token_ids == cut.token_ids
    streamed = "".join(o.new_text for o in engine.stream([PROMPTS[0]], SamplingParams(
        **base, include_stop_str_in_output=True)))
    assert streamed == kept.text


def test_prompts_are_truncated_to_their_last_tokens(engine, letter_target):
    """``truncate_prompt_tokens=k`` runs the prompt's last k tokens (greedy output equal to sending them alone);
    -1 keeps what leaves room for one output token, so a prompt over the context runs instead of being refused."""
    long = PROMPTS[2] * 3
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = engine.generate([long[-5:]], params)[0]
    cut = engine.generate([long], SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == long[-5:] and cut.token_ids == alone.token_ids
    ctx = letter_target.model.config.max_position_embeddings
    over = (PROMPTS[2] * (ctx // len(PROMPTS[2]) + 1))[:ctx + 3]
    roomy = SpecEngine("ngram", letter_target, SpecConfig(tree="chain:3", num_blocks=ctx // 4 + 8, block_size=4))
    with pytest.raises(ValueError, match="max length"):
        roomy.add_request(over, params)
    fit = roomy.generate([over], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert fit.error is None and len(fit.token_ids) == 1
    assert fit.prompt_token_ids == over[-len(fit.prompt_token_ids):] and len(fit.prompt_token_ids) > ctx - 8
    assert engine.all_blocks_free() and roomy.all_blocks_free()


def test_special_tokens_are_spelled_out_when_asked(letter_target):
    """With "b" (token 1) a special token of the tokenizer, an output that holds it reads without it by default and
    with it under ``skip_special_tokens=False``, streamed or not; a stop string made of it ends only the latter."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from specdec.loading.registry import LoadedModel

    inner = letter_target.tokenizer.backend_tokenizer
    inner = type(inner).from_str(inner.to_str())  # (a copy: the session's letter tokenizer stays as it is)
    inner.add_special_tokens([AddedToken("b", special=True)])
    target = LoadedModel("tiny-letters-special", letter_target.model, PreTrainedTokenizerFast(tokenizer_object=inner),
                         letter_target.config)
    eng = SpecEngine(None, target, SpecConfig(num_blocks=64, block_size=4))
    base = dict(max_tokens=8, ignore_eos=True, logit_bias={1: 30.0, 2: 29.0})  # "b" and "c", in turns
    ids = eng.generate([PROMPTS[0]], SamplingParams(**base))[0].token_ids
    assert 1 in ids and set(ids) - {1}
    plain = "".join(target.tokenizer.decode([t]) for t in ids if t != 1)
    spelled = "".join("b" if t == 1 else target.tokenizer.decode([t]) for t in ids)
    assert eng.generate([PROMPTS[0]], SamplingParams(**base))[0].text == plain
    raw = SamplingParams(**base, skip_special_tokens=False)
    assert eng.generate([PROMPTS[0]], raw)[0].text == spelled
    assert "".join(o.new_text for o in eng.stream([PROMPTS[0]], raw)) == spelled
    stop_b = dict(base, stop=["b"])
    assert eng.generate([PROMPTS[0]], SamplingParams(**stop_b))[0].finish_reason == "length"
    assert eng.generate([PROMPTS[0]], SamplingParams(**stop_b, skip_special_tokens=False))[0].finish_reason == "stop"


@pytest.mark.parametrize("fields,name", [(dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
                                         (dict(skip_special_tokens="no"), "skip_special_tokens"),
                                         (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                                         (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
                                         (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens")])
def test_bad_values_name_the_field(fields, name):
    with pytest.raises(FieldError, match=name):
        SamplingParams(**fields)
    with pytest.raises(BadRequest) as err:
        parse_completion({"prompt": "hi", **fields}, "m")
    assert err.value.field == name


def test_the_server_takes_the_fields():
    parsed = parse_completion({"prompt": "hi", "include_stop_str_in_output": True, "truncate_prompt_tokens": 7,
                               "skip_special_tokens": False}, "m")
    assert parsed.params.include_stop_str_in_output and parsed.params.truncate_prompt_tokens == 7
    assert not parsed.params.skip_special_tokens
