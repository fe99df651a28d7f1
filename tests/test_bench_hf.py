"""transformers baselines of ``specdec bench`` on the tiny target (static cache without compile: the
compiled path differs only in transformers' ``CompileConfig``, and compiling costs minutes on a CPU)."""

from __future__ import annotations

import pytest
import torch

from specdec.benchmark.hf import HFBaselines, generated_lengths, left_pad
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 99, 42, 8], [7, 7, 120, 33, 61, 90, 12], [3, 4]]


def test_left_pad_and_lengths():
    ids, mask = left_pad([[1, 2], [3]], 3, 0, "cpu")
    assert ids.tolist() == [[0, 1, 2], [0, 0, 3]] and mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="width"):
        left_pad([[1, 2, 3]], 2, 0, "cpu")
    assert generated_lengths(torch.tensor([[4, 9, 5], [4, 4, 4]]), {9}) == [2, 3]


@pytest.mark.parametrize("part", ["hf", "hf_static"])
def test_hf_configs_match_engine_greedy(tiny_target, part):
    """Batched (left-padded) transformers greedy output has the engine's lengths; EOS counts."""
    params = SamplingParams(max_new_tokens=6)
    hf = HFBaselines(tiny_target, "ngram", 3, params, compile_static=False)
    runs = hf.run(part, PROMPTS, 2)
    outs = SpecEngine(None, tiny_target, SpecConfig(prefix_cache=False)).generate(PROMPTS, params)
    assert [r["output_tokens"] for r in runs] == [len(o.token_ids) for o in outs]
    assert all(r["time_s"] > 0 for r in runs)
    assert hf.run("hf_assisted", PROMPTS, 2) == [None] * 3
    assert [r["output_tokens"] for r in hf.run("hf_assisted", PROMPTS[:1], 1)] == [len(outs[0].token_ids)]
    with pytest.raises(ValueError, match="part"):
        hf.run("vllm", PROMPTS, 1)
