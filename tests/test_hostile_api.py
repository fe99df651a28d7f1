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
