"""Hostile input to the Python API: values that are no prompt batch, sampling values past what float32 holds,
sample counts no machine can serve. Each is refused (or decoded as the value it means) by name, nothing is
queued, and the engine goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.engine import SpecConfig, SpecEngine
from specdec.prompts import PromptError
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = [5, 6, 7]
PARAMS = SamplingParams(max_new_tokens=4)


@pytest.fixture(scope="module")
def engine(letter_target):
    """A target-only engine over the tiny target with a tokenizer (text and chat prompts are prompts here)."""
    return SpecEngine(None, letter_target, SpecConfig(num_blocks=64, block_size=8))


@pytest.mark.parametrize("prompts, words", [
    ({"role": "user", "content": "ab"}, ["one chat message", "list of messages"]),  # ran "role" and "content"
    (b"abc", ["bytes", "decode"]),  # ran one error prompt per byte
    (bytearray(b"abc"), ["bytearray", "decode"]),
    (np.array(5), ["0-d", "1-D"]),  # TypeError: iteration over a 0-d array
    (torch.tensor(5), ["0-d", "1-D"]),
    (torch.zeros(1, 2, 3, dtype=torch.long), ["shape (1, 2, 3)", "2-D"]),
    (np.array([1.5, 2.5]), ["float64", "integer"]),  # one error output per element
])
def test_a_value_that_is_no_prompt_batch_is_refused_whole(engine, prompts, words):
    for call in (engine.generate, lambda p, s: list(engine.stream(p, s))):
        with pytest.raises(PromptError) as info:
            call(prompts, PARAMS)
        assert all(w in str(info.value) for w in words), str(info.value)
        assert not engine.scheduler.has_work and engine.all_blocks_free()
    assert engine.generate(PROMPT, PARAMS)[0].finish_reason == "length"


@pytest.mark.parametrize("draft", [None, "ngram", "model"])
def test_a_top_p_below_float32_range_keeps_the_most_probable_token(engine, tiny_draft, draft):
    """top_p 1e-300 is 0 in float32: every token was dropped and the request failed with 'not finite at
    temperature 1.0'. Any top_p below the largest probability keeps just the argmax, as greedy does."""
    eng = engine if draft is None else SpecEngine(tiny_draft if draft == "model" else draft, engine.target,
                                                  SpecConfig(tree="chain:3", num_blocks=64, block_size=8))
    greedy = eng.generate(PROMPT, PARAMS)[0]
    for top_p in (1e-300, 1e-46, 1e-10):
        out = eng.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=1.0, top_p=top_p, seed=1))[0]
        assert (out.finish_reason, out.token_ids) == ("length", greedy.token_ids), (top_p, out.error)
    assert eng.all_blocks_free()


def test_repetition_penalties_float32_cannot_hold_are_refused_by_name(engine):
    """1e-39 divided the logits into infinity: a sampled request failed blaming its temperature."""
    for rp in (1e-39, 1e-300, 1e39, 1e300):
        with pytest.raises(ValueError, match=r"repetition_penalty must be .* in \[1e-30, 1e\+30\]"):
            SamplingParams(repetition_penalty=rp)
    for rp in (1e-30, 1e30):  # the bounds run
        out = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=1.0, repetition_penalty=rp,
                                                     ignore_eos=True))[0]
        assert out.finish_reason == "length", (rp, out.error)


def test_a_sample_count_no_engine_serves_is_refused_at_once():
    """n = 10**9 built 10**9 requests (the server took 6 GB and never answered)."""
    with pytest.raises(ValueError, match=r"SamplingParams.n must be an int >= 1 and <= 128"):
        SamplingParams(n=10**9)
    assert SamplingParams(n=128).n == 128


def test_stop_and_stop_token_ids_of_none_mean_none():
    """vLLM's defaults (``stop=None``, ``stop_token_ids=None``) were refused as 'must be a non-empty string'."""
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert (params.stop, params.stop_token_ids) == ((), ())
    assert params == SamplingParams()


def test_stop_strings_are_bounded_in_number_and_length(engine):
    """Every step checks every stop string against the output on the engine's thread: 200,000 of them (a 2 MB
    request body) made each token of a stream take 0.35 s, for every other request too."""
    for stop in ([f"#{i}" for i in range(200_000)], ["x" * 4097], ["y" * 2048, "z" * 2049]):
        with pytest.raises(ValueError, match=r"SamplingParams.stop .*at most 128 strings of at most 4096 ") as info:
            SamplingParams(stop=stop)
        assert len(str(info.value)) < 500  # the value shown is cut
    most = SamplingParams(max_new_tokens=4, stop=[f"#{i:02}" + "w" * 28 for i in range(128)])  # 4096 characters
    assert engine.generate(PROMPT, most)[0].finish_reason == "length"


def test_stop_token_ids_are_capped_and_looked_up_as_a_set(engine):
    """A million stop_token_ids made every committed token scan them all on the engine's thread (every request's
    steps waited): more than MAX_STOP_TOKEN_IDS are refused by name; up to it they work, a listed token stops the
    request there and others do not."""
    from specdec.sampling_params import MAX_STOP_TOKEN_IDS

    with pytest.raises(ValueError, match=rf"stop_token_ids must be .*at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    free = engine.generate(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    vocab = engine.target.config.vocab_size
    unused = [t for t in range(vocab) if t not in free][:MAX_STOP_TOKEN_IDS - 1]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, stop_token_ids=unused + [free[2]])
    assert params.stop_id_set == frozenset(params.stop_token_ids) and params == SamplingParams(
        max_new_tokens=6, ignore_eos=True, stop_token_ids=unused + [free[2]])
    out = engine.generate(PROMPT, params)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", free[:free.index(free[2]) + 1])
    assert engine.all_blocks_free()
