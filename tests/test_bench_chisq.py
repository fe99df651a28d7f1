"""bench/gpu_chisq.py (the GPU runner's losslessness round) end to end on the CPU: the tiny 8-token target of
``test_sampling_power`` with a correlated draft model (the target with noise on its head, saved as a folder) passes
the chi-square tests of the first token and of the first two tokens at every setting, and the negative control (one
noise for every position) fails the joint test; the test's own pieces against hand-made counts."""

from __future__ import annotations

import json

import pytest
import torch

from bench.gpu_chisq import chisquare, joint_test, main, next_logits, one_noise_everywhere

pytestmark = pytest.mark.usefixtures("single_thread")


def test_chisquare_pools_small_cells_and_fails_impossible_tokens():
    probs = torch.tensor([0.5, 0.3, 0.1996, 0.0004, 0.0])
    stat, p, dof = chisquare(torch.tensor([500, 300, 200, 0, 0]), probs)
    assert dof == 3 and p > 0.9 and stat < 0.5  # 4 cells: three of expected >= 5, the fourth pooled (0.4)
    assert chisquare(torch.tensor([400, 400, 200, 0, 0]), probs)[1] < 1e-10
    assert chisquare(torch.tensor([500, 300, 199, 0, 1]), probs)[1] == 0.0  # a token of probability 0 was drawn


def test_joint_test_passes_exact_draws_of_a_long_tailed_distribution(tiny_factory):
    """Exact draws of (t1, t2) from a flat distribution over 512 tokens (most first tokens expected below 5 times
    in 3,000 samples, many never drawn) pass; the same first tokens with second tokens of the wrong condition fail.
    (Cells chosen from the drawn first tokens failed the first: the undrawn ones' mass sat in a cell observed
    empty by construction.)"""
    from specdec.acceptance import shape_probs
    from specdec.loading.registry import load_model

    target = load_model(tiny_factory("v512_flat", seed=7, num_hidden_layers=1, vocab_size=512,
                                     max_position_embeddings=32, eos_token_id=None, bos_token_id=None))
    model, prompt, n, dev = target.model, [3, 9, 27, 81], 3000, torch.device("cpu")
    p1 = shape_probs(next_logits(model, [prompt], dev)[0], 1.0, 0, 1.0).double()
    g = torch.Generator().manual_seed(11)
    t1 = torch.multinomial(p1, n, replacement=True, generator=g)
    firsts = torch.unique(t1)
    p2 = shape_probs(next_logits(model, [prompt + [int(t)] for t in firsts], dev), 1.0, 0, 1.0).double()
    assert (p1 * n < 5).sum() > 256 and len(firsts) < 512  # long-tailed: most tokens rare, some never drawn
    row = torch.searchsorted(firsts, t1)
    t2 = torch.stack([torch.multinomial(p2[r], 1, generator=g)[0] for r in row.tolist()])
    good = joint_test(model, prompt, torch.stack([t1, t2], 1), 1.0, 1.0, dev)
    assert good["p_first"] > 1e-3 and good["p_joint"] > 1e-3, good
    wrong = torch.stack([torch.multinomial(p2[(r + 1) % len(firsts)], 1, generator=g)[0] for r in row.tolist()])
    bad = joint_test(model, prompt, torch.stack([t1, wrong], 1), 1.0, 1.0, dev)
    assert bad["p_first"] > 1e-3 and bad["p_joint"] < 1e-3, bad


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
    assert main([str(tmp_path / "control"), str(target), str(prompts), "--samples", "3000", "--draft", str(draft),
                 "--batch", "256", "--device", "cpu", "--control-only"]) == 0  # the control alone: it fails
    res = json.loads((tmp_path / "control" / "chisq.json").read_text())
    assert [r["label"] for r in res] == ["negative control"] and res[0]["p_joint"] < 1e-3


def test_negative_control_is_undone():
    import specdec.sampled_rule
    import specdec.verifier

    names = ((specdec.sampled_rule, "choose_tokens"), (specdec.sampled_rule, "choose_filtered_triton"),
             (specdec.verifier, "choose_tokens"))
    before = [getattr(mod, name) for mod, name in names]
    with one_noise_everywhere():
        assert all(getattr(mod, name) is not f for (mod, name), f in zip(names, before))  # every path of the rule
    assert [getattr(mod, name) for mod, name in names] == before


def test_negative_control_reaches_the_filtered_triton_choice():
    """The control changes the Triton filtered choice (the device rule's path for top-p rows), which a patch of
    ``choose_tokens`` alone missed: the second token of a request follows the first's noise."""
    import specdec.sampled_rule as rule_mod
    from specdec.row_sampling import sampling_rows
    from specdec.sampling_params import SamplingParams

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 50, generator=g).to(dev)
    t = torch.full((64,), 1.0, device=dev)
    key0 = torch.full((64,), 7, dtype=torch.int64, device=dev)
    key1 = torch.full((64,), 9, dtype=torch.int64, device=dev)
    position = torch.arange(64, dtype=torch.int64, device=dev)
    sampling = sampling_rows([SamplingParams(temperature=1.0, top_p=0.9)] * 64, dev)

    def choices():
        return rule_mod.choose_filtered_triton(x, t, key0, key1, position, sampling, t)

    right = choices()
    with one_noise_everywhere():
        wrong = choices()
    assert not torch.equal(right, wrong)
    with one_noise_everywhere():  # every row now draws with position 0's noise: the same as row 0 at position 0
        at_zero = rule_mod.choose_filtered_triton(x, t, key0, key1, torch.zeros_like(position), sampling, t)
    assert torch.equal(wrong, at_zero)
