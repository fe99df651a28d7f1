"""bench/gpu_chisq.py (the GPU runner's losslessness round) end to end on the CPU: the tiny 8-token target of
``test_sampling_power`` with a correlated draft model (the target with noise on its head, saved as a folder) passes
the chi-square tests of the first token and of the first two tokens at every setting, and the negative control (one
noise for every position) fails the joint test; the test's own pieces against hand-made counts."""

from __future__ import annotations

import json

import pytest
import torch

from bench.gpu_chisq import chisquare, main, one_noise_everywhere

pytestmark = pytest.mark.usefixtures("single_thread")


def test_chisquare_pools_small_cells_and_fails_impossible_tokens():
    probs = torch.tensor([0.5, 0.3, 0.1996, 0.0004, 0.0])
    stat, p, dof = chisquare(torch.tensor([500, 300, 200, 0, 0]), probs)
    assert dof == 3 and p > 0.9 and stat < 0.5  # 4 cells: three of expected >= 5, the fourth pooled (0.4)
    assert chisquare(torch.tensor([400, 400, 200, 0, 0]), probs)[1] < 1e-10
    assert chisquare(torch.tensor([500, 300, 199, 0, 1]), probs)[1] == 0.0  # a token of probability 0 was drawn


def test_gpu_chisq_on_the_tiny_pair(tiny_factory, tmp_path):
    from specdec.loading.registry import load_model

    kw = dict(vocab_size=8, max_position_embeddings=64, eos_token_id=None, bos_token_id=None, initializer_range=0.2)
    target = tiny_factory("v8_power_target", seed=100, num_hidden_layers=2, **kw)
    draft = tiny_factory("v8_chisq_draft", seed=100, num_hidden_layers=2, **kw)  # the same weights, then noise
    model = load_model(draft)
    from safetensors.torch import load_file, save_file

    state = load_file(str(draft / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    w = state["lm_head.weight"]
    state["lm_head.weight"] = w + 0.3 * w.std() * torch.randn(w.shape, generator=g)
    save_file(state, str(draft / "model.safetensors"))
    assert not torch.equal(load_model(draft).model.lm_head.weight, model.model.lm_head.weight)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"mtbench": [[1, 5, 2, 7, 3, 6, 4]]}))
    out = tmp_path / "out"
    assert main([str(out), str(target), str(prompts), "--samples", "3000", "--draft", str(draft), "--batch", "256",
                 "--device", "cpu"]) == 0
    res = json.loads((out / "chisq.json").read_text())
    assert [r["label"] for r in res] == ["T=0.7 top-p 0.9", "T=1.0 top-p 0.9", "T=1.0 top-p 1.0", "negative control"]
    for r in res[:3]:
        assert r["passes"] and r["accepted"] > 0 and r["distinct_first"] >= 2 and r["dof_joint"] >= 4, r
    assert res[3]["p_joint"] < 1e-3 and res[3]["p_first"] > 1e-3  # the control: marginals right, pairs correlated


def test_negative_control_is_undone():
    import specdec.sampled_rule
    import specdec.verifier

    before = (specdec.sampled_rule.choose_tokens, specdec.verifier.choose_tokens)
    with one_noise_everywhere():
        assert specdec.sampled_rule.choose_tokens is not before[0]
    assert (specdec.sampled_rule.choose_tokens, specdec.verifier.choose_tokens) == before
