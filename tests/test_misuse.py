"""Hostile input and misuse of one engine (issue 28): tiny temperatures, non-finite sampling distributions,
several threads on one engine, prompts whose preparation raises, configurations too large for any machine,
and validation messages that name the real culprit."""

from __future__ import annotations

import pytest
import torch
from serving_helpers import BAD_CHAT, GOOD_CHAT

from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import GREEDY_TEMPERATURE_FLOOR, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = [5, 6, 7, 8, 9]


def _engine(draft, target, **cfg) -> SpecEngine:
    return SpecEngine(draft, target, SpecConfig(**{"tree": "chain:3", "num_blocks": 64, **cfg}))


# ---------------------------------------------------------------- 1. tiny temperatures


@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_temperatures_below_the_floor_decode_greedily_in_every_path(tiny_target, tiny_draft, draft):
    """1e-40 gave garbage (target-only, n-gram) or a failed request (draft model); below the floor it is greedy."""
    engine = _engine({"none": None, "ngram": "ngram", "model": tiny_draft}[draft], tiny_target)
    greedy = engine.generate([PROMPT], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    for t in (1e-40, 1e-30, GREEDY_TEMPERATURE_FLOOR / 2):
        out = engine.generate([PROMPT], SamplingParams(temperature=t, seed=3, max_new_tokens=16, ignore_eos=True))[0]
        assert out.error is None and out.token_ids == greedy.token_ids, t
    assert engine.all_blocks_free()


def test_sampling_params_store_tiny_temperatures_as_greedy():
    assert SamplingParams(temperature=1e-40).temperature == 0.0 and SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR).temperature == GREEDY_TEMPERATURE_FLOOR
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR).greedy


@pytest.fixture(scope="module")
def huge_logits(tiny_dirs):
    """The tiny target with logits around 1e36: finite, but divided by a temperature of 1e-5 they overflow."""
    model = load_model(tiny_dirs["llama"])
    with torch.no_grad():
        probe = model.model.compute_logits(torch.ones(1, model.config.hidden_size))
        model.model.lm_head.weight.mul_(1e36 / probe.abs().max())
    return model


@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_a_non_finite_sampling_distribution_fails_its_row_by_name(huge_logits, draft):
    """Target-only and n-gram sampled garbage from a NaN distribution with finish_reason "length"; the draft
    model failed with torch's "probability tensor contains inf"; now the row fails naming the cause and a
    greedy row of the same batch is unaffected."""
    engine = _engine({"none": None, "ngram": "ngram", "model": huge_logits}[draft], huge_logits)
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = engine.generate([PROMPT], greedy)[0]
    hot = SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR, seed=1, max_new_tokens=8, ignore_eos=True)
    bad, good = engine.generate([[11, 12, 13], PROMPT], [hot, greedy])
    assert bad.finish_reason == "error" and "sampling distribution" in str(bad.error)
    assert "not finite" in str(bad.error) and "temperature" in str(bad.error)
    assert good.error is None and good.token_ids == alone.token_ids
    assert engine.all_blocks_free()


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_non_finite_distribution_fails_its_rows_in_the_device_rule(huge_logits, draft):
    """Padded steps put 8 or more sampled rows through the device rule, which sampled token 0 from NaN."""
    from specdec.verifier import DEVICE_SAMPLED_MIN_ROWS

    engine = _engine(draft, huge_logits, cuda_graphs=True)
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = engine.generate([PROMPT], greedy)[0]
    hot = SamplingParams(temperature=GREEDY_TEMPERATURE_FLOOR, seed=1, max_new_tokens=6, ignore_eos=True)
    prompts = [[11 + i, 12, 13] for i in range(DEVICE_SAMPLED_MIN_ROWS)]
    *bad, good = engine.generate(prompts + [PROMPT], [hot] * len(prompts) + [greedy])
    for out in bad:
        assert out.finish_reason == "error" and "sampling distribution" in str(out.error) and not out.token_ids
    assert good.error is None and good.token_ids == alone.token_ids
    assert engine.all_blocks_free()


# ---------------------------------------------------------------- 2. several threads on one engine


@pytest.mark.parametrize("draft", ["none", "ngram", "model"])
def test_threads_generating_on_one_engine_get_their_solo_outputs(tiny_target, tiny_draft, draft):
    """Two threads calling generate at once appended every token twice (target-only, n-gram) or failed rows
    (draft model); now their steps are serialised and each gets what it gets alone."""
    import threading

    engine = _engine({"none": None, "ngram": "ngram", "model": tiny_draft}[draft], tiny_target)
    prompts = [[5 + i, 6, 7 + i, 8] for i in range(4)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(prompts, params)]
    got: dict[int, list] = {}

    def run(k: int) -> None:
        got[k] = [o.token_ids for o in engine.generate(prompts[k % 2:], params)]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == [0, 1, 2, 3]
    for k, outs in got.items():
        assert outs == alone[k % 2:], k
    assert engine.all_blocks_free()


def test_generating_from_inside_an_engine_step_is_refused(tiny_target):
    """A nested call on the thread running a step raises RuntimeError; the outer call's requests are freed."""
    engine = _engine(None, tiny_target)
    schedule, nested = engine.scheduler.schedule, []

    def scheduling():
        if not nested:
            nested.append(1)
            engine.generate([PROMPT], SamplingParams(max_new_tokens=2))
        return schedule()

    engine.scheduler.schedule = scheduling
    with pytest.raises(RuntimeError, match="inside one of its own steps"):
        engine.generate([PROMPT], SamplingParams(max_new_tokens=4))
    engine.scheduler.schedule = schedule
    assert engine.all_blocks_free()
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=4))[0].error is None


# ---------------------------------------------------------------- 3, 6. preparing one prompt raises

@pytest.mark.parametrize("bad, cause", [
    (BAD_CHAT, "roles must alternate"),
    ("lone \ud800 surrogate", "lone surrogate"),
    ([{"role": "user", "content": "x\udfffy"}], "messages[0].content is not valid Unicode"),
])
def test_a_prompt_whose_preparation_raises_fails_alone(strict_target, bad, cause):
    """A raising chat template (jinja2 TemplateError) or a lone surrogate (the tokenizer's TypeError) escaped
    generate and lost the good prompts' outputs; now only the bad prompt fails, naming the cause."""
    engine = _engine(None, strict_target)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = engine.generate([GOOD_CHAT, "fine text"], params)
    outs = engine.generate([GOOD_CHAT, bad, "fine text"], params)
    assert outs[1].finish_reason == "error" and cause in str(outs[1].error)
    assert isinstance(outs[1].error, ValueError)
    assert [o.token_ids for o in (outs[0], outs[2])] == [o.token_ids for o in alone]
    assert engine.all_blocks_free()


def test_chat_content_as_text_parts_is_its_text_and_other_parts_fail_alone(strict_target):
    """OpenAI's content parts through ``generate``: text parts give the reply to their texts joined with newlines;
    an image part fails that prompt alone, naming the part."""
    engine = _engine(None, strict_target)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    joined = [{"role": "user", "content": "hello\nthere"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    want = engine.generate([joined], params)[0].token_ids
    outs = engine.generate([parts, image, "fine text"], params)
    assert outs[0].token_ids == want and want
    assert outs[1].finish_reason == "error" and "messages[0].content[0] must be a text part" in str(outs[1].error)
    assert outs[2].error is None and engine.all_blocks_free()


# ---------------------------------------------------------------- 6, 7. bounds and messages


@pytest.mark.parametrize("kwargs, field, shown", [
    ({"max_batch_size": 10**9}, "max_batch_size", "<= 4096"),
    ({"max_num_tokens": 10**12}, "max_num_tokens", "<= 1048576"),
    ({"num_blocks": 10**12}, "num_blocks", "<= 16777216"),
    ({"block_size": 10**6}, "block_size", "<= 1024"),
    ({"ngram_max_n": 10**6}, "ngram_max_n", "<= 64"),
    ({"kv_memory_bytes": 1 << 62}, "kv_memory_bytes", "the device's memory"),
])
def test_configs_no_machine_can_hold_are_refused_at_construction(kwargs, field, shown):
    """max_batch_size=10**9 passed validation and then failed allocating memory."""
    from specdec.errors import FieldError

    with pytest.raises(FieldError) as info:
        SpecConfig(**kwargs)
    assert info.value.field == field and shown in str(info.value)


def test_a_prompt_leaving_no_room_names_its_length(tiny_target, tiny_draft):
    """'max_new_tokens ... allowed: <= -3' became a PromptError naming the prompt's length and the limit."""
    from specdec.prompts import PromptError

    engine = _engine(tiny_draft, tiny_target)  # max length 512, chain:3 looks 3 tokens ahead
    out = engine.generate([[5] * 511], SamplingParams(max_new_tokens=8))[0]
    assert isinstance(out.error, PromptError)
    assert "511 tokens" in str(out.error) and "<= 508 tokens" in str(out.error) and "<= -" not in str(out.error)
    assert engine.generate([[5] * 508], SamplingParams(max_new_tokens=1))[0].error is None
