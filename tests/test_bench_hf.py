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


def test_baselines_with_an_eagle_draft(tiny_target):
    """With an EAGLE-style draft (the default draft's kind) the transformers baselines were a crash building the
    assistant (``size mismatch for lm_head.weight``); now hf and hf_static run and hf_assisted is skipped, saying
    why."""
    from specdec.loading.registry import LoadedModel
    from specdec.models.eagle import EagleShape, default_aux_layers, eagle_from_target

    shape = EagleShape(default_aux_layers(tiny_target.config.num_layers), 100)
    vocab = torch.arange(100)  # a reduced draft vocabulary: its lm_head has fewer rows than the target's
    model = eagle_from_target(tiny_target.model, shape, vocab, seed=2).eval().requires_grad_(False)
    draft = LoadedModel("eagle", model, None, model.config)
    params = SamplingParams(max_new_tokens=6)
    hf = HFBaselines(tiny_target, draft, 3, params, compile_static=False)
    want = [len(o.token_ids) for o in SpecEngine(None, tiny_target, SpecConfig()).generate(PROMPTS, params)]
    for part in ("hf", "hf_static"):
        assert [r["output_tokens"] for r in hf.run(part, PROMPTS, 2)] == want
    assert "EAGLE-style draft 'eagle'" in hf.assist_skipped
    assert hf.run("hf_assisted", PROMPTS[:1], 1) == [None]
    assert HFBaselines(tiny_target, "ngram", 3, params).assist_skipped is None
    from specdec.benchmark.data import BenchPrompt
    from specdec.cli.bench import run_batch_size

    engines = (SpecEngine(draft, tiny_target, SpecConfig()), SpecEngine(None, tiny_target, SpecConfig()))
    prompts = [BenchPrompt(id=str(i), category="c", prompt="x") for i in range(len(PROMPTS))]
    records = run_batch_size(engines, hf, prompts, PROMPTS, params, 1, tiny_target, "float32")  # bench's own call
    assert [r["hf"]["output_tokens"] for r in records] == [r["hf_static"]["output_tokens"] for r in records] == want
    assert all(r["hf_assisted"] is None for r in records)
