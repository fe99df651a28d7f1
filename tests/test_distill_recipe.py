"""The eagle training recipe of ``specdec distill``: the loss at a sampling temperature, replies regenerated greedily
and sampled, prompt-only files, exact resume across runs cut by time, the record and the measurement of a draft, and
warm starts from a trained draft (``--init-from``).

The tiny 4-layer target and fake ShareGPT of ``test_eagle`` (character-level tokenizer, ``<|im_end|>`` is the EOS).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_distill import _save_tiny_target
from test_eagle import TRAIN_ARGS
from test_eagle_regen import ENGINE, make_regen

from specdec.cli import main
from specdec.engine import SpecEngine
from specdec.loading.registry import load_model
from specdec.models.eagle import EagleShape, eagle_from_target
from specdec.sampling_params import SamplingParams
from specdec.training.configs import LR, WARM_LR, EagleTrainConfig
from specdec.training.eagle_data import load_token_file
from specdec.training.eagle_distill import draft_vocabulary
from specdec.training.eagle_measure import better_everywhere
from specdec.training.eagle_regen import RegenConfig, assistant_runs, eos_ids, prompt_token_file, regenerate_token_file
from specdec.training.eagle_train import evaluate, split_docs
from specdec.training.eagle_unroll import LossMix, TeacherOut, unrolled_loss

pytestmark = pytest.mark.usefixtures("single_thread")

NEW = 10
REGEN = RegenConfig(max_new_tokens=NEW, temperatures=(0.0, 0.9), max_turns=2, chunk=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    return root, *make_regen(root, 24, 160, REGEN)


def _args(**change) -> list[str]:
    args = [*TRAIN_ARGS]
    for flag, value in change.items():
        args[args.index(flag) + 1] = value
    return args


def _teacher_and_draft(target, seed: int = 0):
    """A random teacher (features and log-probabilities over a 16-token draft vocabulary) and a fresh draft."""
    g = torch.Generator().manual_seed(seed)
    shape = EagleShape((0, 2, 3), 16)
    draft = eagle_from_target(target.model, shape, torch.arange(16) * 3, dtype=torch.float32, seed=seed)
    b, s, h = 2, 9, target.config.hidden_size
    logp = torch.log_softmax(3 * torch.randn(b * s, 16, generator=g), -1)  # (B*S, N)
    teacher = TeacherOut(torch.randn(b * s, 3 * h, generator=g), logp)
    ids = torch.randint(0, 60, (b, s), generator=g)
    valid = torch.rand(b, s, generator=g) < 0.7
    return draft, teacher, ids, valid


def test_loss_mix_is_the_weighted_sum_of_the_two_kls(setup):
    _, target, _, _ = setup
    draft, teacher, ids, valid = _teacher_and_draft(target)
    plain = unrolled_loss(draft, teacher, ids, valid, 3, 0.8)
    both = unrolled_loss(draft, teacher, ids, valid, 3, 0.8, LossMix(0.5, 1.0), measure=True)
    half = unrolled_loss(draft, teacher, ids, valid, 3, 0.8, LossMix(0.5, 0.25))
    weights = torch.tensor([0.8**k for k in range(3)]) / sum(0.8**k for k in range(3))
    kl, kl_t = torch.stack(plain.kl), torch.stack(both.kl_t)
    torch.testing.assert_close(plain.loss, (weights * kl).sum(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(both.loss, (weights * kl_t).sum(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(half.loss, 0.75 * plain.loss + 0.25 * both.loss, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(kl, kl_t)  # a sharper temperature weighs the distributions differently
    # step 0 by hand, at the scored positions: KL of softmax(logits / 0.5) and the overlap sum min(p_T, q_T)
    from specdec.models.llama import ForwardContext
    from specdec.training.eagle_unroll import UnrolledBackend, UnrolledBatch, shift_right

    rows = valid.reshape(-1)
    ctx = ForwardContext(UnrolledBackend(), UnrolledBatch(2, 9), [(None, None)])
    g = shift_right(draft.fuse(teacher.aux), 2, 9)
    logits = draft.compute_logits(draft(ids.reshape(-1), torch.arange(9).repeat(2), ctx, g))[rows]
    p_t, q_t = torch.softmax(teacher.logp[rows] / 0.5, -1), torch.softmax(logits / 0.5, -1)
    torch.testing.assert_close(both.kl_t[0], (p_t * (p_t.log() - q_t.log())).sum(-1).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(both.overlap_t[0], torch.minimum(p_t, q_t).sum(-1).mean(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sampled_weight"):
        LossMix(0.7, 1.5)


def test_replies_are_regenerated_greedily_and_sampled(setup):
    _, target, _, regen = setup
    temps = regen.meta["temperatures"]
    assert temps[:4] == [0.0, 0.9, 0.0, 0.9] and regen.meta["source_docs"][0] == regen.meta["source_docs"][1]
    assert regen.meta["regenerated"]["docs_per_temperature"] == {"0.0": regen.num_docs // 2, "0.9": regen.num_docs // 2}
    greedy_prompts, greedy_replies, differ = [], [], 0
    for i in range(0, regen.num_docs, 2):
        (g_ids, g_mask), (s_ids, s_mask) = regen.doc(i), regen.doc(i + 1)
        a, b = assistant_runs(g_mask)[0]
        assert s_ids[:a].tolist() == g_ids[:a].tolist()  # the same prompt
        greedy_prompts.append(g_ids[:a].tolist())
        greedy_replies.append(g_ids[a:b].tolist())
        differ += s_ids[a:assistant_runs(s_mask)[0][1]].tolist() != g_ids[a:b].tolist()
    outs = SpecEngine(None, target, ENGINE).generate(greedy_prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == greedy_replies
    assert differ >= len(greedy_prompts) // 2  # sampled replies are not the greedy ones


def test_prompt_only_file_regenerates_the_same_conversations(setup):
    root, target, text, regen = setup
    eos = eos_ids(target.tokenizer, target.config)
    prompts = prompt_token_file(text, root / "prompts.npz", eos, 2)
    assert prompts.num_docs == text.num_docs and len(prompts.tokens) < 0.8 * len(text.tokens)
    assert prompts.meta["prompts_only"]
    again = regenerate_token_file(target, prompts, root / "again.npz", REGEN, ENGINE)
    assert np.array_equal(again.tokens, regen.tokens) and np.array_equal(again.assistant, regen.assistant)
    assert "prompts_only" not in again.meta and again.meta["turns"] == regen.meta["turns"]
    assert max(regen.meta["turns"]) == 2
    out = root / "refused"
    assert main(["distill", "--target", str(root / "target"), "--tokens", str(root / "prompts.npz"),
                 *_args(**{"--steps": "2"}), "--out", str(out)]) == 2  # a prompt-only file is not training data


def _ckpt(folder):
    return torch.load(folder / "ckpt.pt", weights_only=False)


def test_runs_cut_by_time_resume_exactly_and_the_record_says_how(setup):
    root, _, _, _ = setup
    base = ["distill", "--target", str(root / "target"), "--tokens", str(root / "regen.npz"),
            *_args(**{"--steps": "8", "--unroll": "5", "--ckpt-every": "100"}), "--sampled-weight", "0.5",
            "--loss-temperature", "0.6", "--target-name", "tiny-target"]
    assert main([*base, "--out", str(root / "whole")]) == 0
    cut, runs = root / "cut", 0
    while not (cut / "model.safetensors").exists():
        assert main([*base, "--out", str(cut), "--resume", "--run-seconds", "1e-9"]) == 0  # one step a run
        runs += 1
        assert _ckpt(cut)["state"]["step"] == runs
    assert runs == 8
    whole, parts = _ckpt(root / "whole"), _ckpt(cut)
    assert parts["state"]["losses"] == whole["state"]["losses"]
    for name, w in whole["trained"].items():
        assert torch.equal(parts["trained"][name], w), name
    for name, w in whole["optimizer"]["state"].items():
        assert torch.equal(parts["optimizer"]["state"][name]["exp_avg_sq"], w["exp_avg_sq"])
    meta = json.loads((cut / "specdec_draft.json").read_text())
    rec = meta["training"]
    assert meta["target"] == "tiny-target" and rec["options"]["sampled_weight"] == 0.5
    assert "run_seconds" not in rec["options"] and "temperature 0.6" in rec["loss"]
    assert len(rec["val"][-1]["overlap_t"]) == 5 and all(0 < x <= 1 for x in rec["val"][-1]["overlap_t"])
    assert rec["data"]["replies"] == sum(load_token_file(root / "regen.npz").meta["turns"])
    assert not any(isinstance(v, list) for v in rec["data"].values())  # per-conversation lists left out
    args = [*base, "--out", str(cut), "--resume"]
    args[args.index("--sampled-weight") + 1] = "0.25"
    assert main(args) == 2  # another loss is another run


def test_cli_regenerates_and_measures(setup, warm, tmp_path):
    root, target, _, _ = setup
    init, _ = warm  # (the draft compared against: a fixture's, whatever tests ran before on this worker)
    eos = eos_ids(target.tokenizer, target.config)
    prompt_token_file(root / "text.npz", tmp_path / "p.npz", eos, 1)
    tiny = ["--target", str(root / "target"), "--device", "cpu"]
    assert main(["distill", "--kind", "eagle", *tiny, "--regenerate", str(tmp_path / "p.npz"), "--write-tokens",
                 str(tmp_path / "r.npz"), "--regen-temperatures", "0,0.7", "--regen-new-tokens", "6",
                 "--regen-batch", "8"]) == 0
    r = load_token_file(tmp_path / "r.npz")
    assert r.meta["temperatures"][:2] == [0.0, 0.7] and max(r.meta["turns"]) == 1
    assert main(["distill", "--target", str(root / "target"), "--tokens", str(tmp_path / "r.npz"),
                 *_args(**{"--steps": "3", "--val-docs": "2"}), "--out", str(tmp_path / "d")]) == 0
    prompts = tmp_path / "sets.json"
    prompts.write_text(json.dumps({"a": [[1, 30, 31, 32, 2]] * 2, "b": [[1, 33, 34, 2, 1, 40]]}))
    assert main(["distill", "--kind", "eagle", *tiny, "--measure", str(prompts), "--out", str(tmp_path / "d"),
                 "--compare", str(init), "--tree", "chain:2,dynamic:6", "--measure-new-tokens", "8",
                 "--json", str(tmp_path / "m.json")]) == 0
    report = json.loads((tmp_path / "m.json").read_text())
    assert len(report["draft"]) == len(report["compare"]) == 2 * 2 * 2  # trees x sets x temperatures
    assert all(r["mean_accepted_length"] >= 1 for r in report["draft"] + report["compare"])
    assert report["better_everywhere"] == better_everywhere(report["draft"], report["compare"])
    measured = json.loads((tmp_path / "d" / "specdec_draft.json").read_text())["training"]["measured"]
    assert measured[-1]["results"] == report["draft"]
    assert main(["distill", "--kind", "eagle", *tiny, "--regen-seconds", "5", "--out", "x", "--tokens", "y"]) == 2
    assert main(["distill", "--kind", "eagle", *tiny, "--measure", str(prompts), "--split", "train"]) == 2


@pytest.fixture(scope="module")
def warm(setup):
    """A draft trained 3 steps on the ShareGPT replies (30-token vocabulary, stored in float32), then warm starts
    from it on the regenerated replies: 4 steps in one run, and in two runs cut after step 2."""
    root, _, _, _ = setup
    init = root / "init"
    args = _args(**{"--steps": "3", "--draft-vocab": "30"})
    assert main(["distill", "--target", str(root / "target"), "--tokens", str(root / "text.npz"), *args,
                 "--save-dtype", "float32", "--out", str(init)]) == 0
    base = _warm_args(root, init)
    assert main([*base, "--out", str(root / "warm")]) == 0
    assert main([*base, "--out", str(root / "warm_cut"), "--stop-after", "2"]) == 0
    assert main([*base, "--out", str(root / "warm_cut"), "--resume"]) == 0
    return init, base


def _warm_args(root, init) -> list[str]:
    args = _args(**{"--steps": "4"})
    del args[args.index("--draft-vocab"):args.index("--draft-vocab") + 2]
    return ["distill", "--target", str(root / "target"), "--tokens", str(root / "regen.npz"), *args,
            "--init-from", str(init)]


def test_warm_start_begins_from_the_drafts_weights_and_vocabulary(setup, warm):
    root, target, _, regen = setup
    init, _ = warm
    draft = load_model(init, target=target).model
    cfg = EagleTrainConfig(out="unused", tokens="unused", unroll=3, max_len=96, batch_tokens=384, val_docs=4)
    num_train, num_val = split_docs(regen, cfg.val_docs)
    direct = evaluate(cfg, target.model, draft, regen, list(range(num_train, num_train + num_val)))
    assert _ckpt(root / "warm")["state"]["val"] == [{"step": 0, **direct}]  # the draft itself: its weights loaded
    kept = _ckpt(root / "warm")["trained"]["vocab_ids"]
    assert torch.equal(kept, draft.vocab_ids) and len(kept) == 30
    fresh, _ = draft_vocabulary(regen, num_train, target.config.vocab_size, 30)  # what a fresh draft would pick
    assert kept.tolist() != fresh.tolist()


def test_warm_start_resumes_exactly_and_the_record_names_the_draft(setup, warm):
    root, _, _, _ = setup
    init, _ = warm
    whole, parts = _ckpt(root / "warm"), _ckpt(root / "warm_cut")
    assert parts["state"]["losses"] == whole["state"]["losses"] and parts["state"]["val"] == whole["state"]["val"]
    for name, w in whole["trained"].items():
        assert torch.equal(parts["trained"][name], w), name
    meta = json.loads((root / "warm_cut" / "specdec_draft.json").read_text())
    rec, started = meta["training"], json.loads((init / "specdec_draft.json").read_text())
    assert meta["draft_vocab"] == 30 and meta["aux_layers"] == started["aux_layers"]
    assert rec["init_from"]["name"] == str(init) and rec["options"]["init_from"] == str(init)
    assert rec["init_from"]["training"]["steps"] == 3 and rec["init_from"]["draft_vocab"] == 30
    assert rec["init_from"]["training"]["val"] == started["training"]["val"][-1]
    assert 0 < rec["draft_vocab"]["coverage_of_kept_vocab"] <= 1 and rec["options"]["lr"] == 3e-3
    assert [v["step"] for v in rec["val"]] == [0, 4]


def test_warm_start_refuses_another_vocabulary_layers_or_target(setup, warm, capsys):
    root, _, _, _ = setup
    init, base = warm
    out = ["--out", str(root / "refused")]
    assert main([*base, *out, "--draft-vocab", "40"]) == 2
    assert "--draft-vocab 40 conflicts" in (err := capsys.readouterr().err) and "draft_vocab is 30" in err
    assert main([*base, *out, "--aux-layers", "0,1,3"]) == 2
    assert "--aux-layers 0,1,3 conflicts" in (err := capsys.readouterr().err) and "aux_layers is 0,2,3" in err
    _save_tiny_target(root / "other", seed=5)
    other = [*base, *out]
    other[other.index("--target") + 1] = str(root / "other")
    assert main(other) == 2
    err = capsys.readouterr().err
    assert f"trained for target {str((root / 'target').resolve())!r}, not {str((root / 'other').resolve())!r}" in err
    weights = root / "other" / "model.safetensors"
    save_file({k: 1.5 * v for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    assert main([*other, "--target-name", str((root / "target").resolve())]) == 2  # the name alone is not enough
    assert "other model.embed_tokens.weight values" in capsys.readouterr().err
    assert EagleTrainConfig(out="o", tokens="t").lr == LR and EagleTrainConfig(out="o", tokens="t", init_from="d").lr \
        == WARM_LR < LR


def test_better_everywhere_needs_every_pair():
    new = [{"set": "a", "temperature": 0.0, "tree": "t", "mean_accepted_length": 3.0},
           {"set": "a", "temperature": 0.7, "tree": "t", "mean_accepted_length": 2.5}]
    old = [{**new[0], "mean_accepted_length": 2.9}, {**new[1], "mean_accepted_length": 2.5}]
    assert not better_everywhere(new, old)  # equal is not better
    old[1]["mean_accepted_length"] = 2.4
    assert better_everywhere(new, old) and not better_everywhere(new, [])


def test_help_shows_no_missing_default(capsys):
    with pytest.raises(SystemExit):
        main(["distill", "--help"])
    text = capsys.readouterr().out
    assert "MISSING" not in text and "object at 0x" not in text and "--run-seconds" in text


@pytest.mark.parametrize("resume_at", [None, 30])
def test_time_budget_plans_from_steps_past_the_slow_first_ones(resume_at):
    """A 600 s budget whose first 20 steps take 2 s and the rest 0.5 s (a run's first steps set up kernels and memory):
    the planned steps fill the budget to within 2% (planning from the first steps alone would fill ~57% of it); a
    run resumed at step 30 (its own first steps slow again) plans on and still fills it; once a quarter of the budget
    is spent the plan stays put."""
    from specdec.training.eagle_train import PROBE_STEPS, EagleState, StepPlanner, plan_steps

    cfg = EagleTrainConfig(out="x", tokens="y", steps=100_000, time_budget=600.0)
    state, elapsed, run_start, changes = EagleState(planned=cfg.steps), 0.0, 0, []
    planner = StepPlanner(cfg, state)
    while state.step < state.planned:
        if state.step == resume_at:  # a new run: a new planner, its first steps slow again
            planner, run_start = StepPlanner(cfg, state), state.step
        seconds = 2.0 if state.step - run_start < PROBE_STEPS else 0.5
        state.step += 1
        elapsed += seconds
        if planner.observe(state, seconds, elapsed):
            changes.append((state.step, state.planned, elapsed))
        state.train_seconds = elapsed
    assert abs(elapsed - 600) <= 12, (elapsed, changes)
    assert len(changes) >= 2 and all(spent <= 1.5 * 0.25 * 600 for _, _, spent in changes)
    assert planner.next is None and not planner.timing
    first_only = plan_steps(cfg, PROBE_STEPS, 40.0, [2.0] * 10)  # the plan of the first 20 steps alone
    assert 40 + (first_only - PROBE_STEPS) * 0.5 < 0.6 * 600
    assert not StepPlanner(EagleTrainConfig(out="x", tokens="y"), EagleState()).timing  # no budget: no timing


def _reference_unrolled_loss(draft, teacher, ids, valid, unroll, decay, mix):
    """The unrolled loss scored directly (log_softmax of each step's whole logits, autograd through them): what
    ``unrolled_loss``'s chunked linear KL must equal. Returns the loss and per step (kl, top1, kl_t, overlap)."""
    from specdec.models.llama import ForwardContext
    from specdec.training.eagle_unroll import UnrolledBackend, UnrolledBatch, shift_right

    b, s = ids.shape
    positions = torch.arange(s).repeat(b)
    ctx = ForwardContext(UnrolledBackend(), UnrolledBatch(b, s), [(None, None)])
    g = shift_right(draft.fuse(teacher.aux), b, s)
    rows = valid.reshape(-1).nonzero().squeeze(1)
    t_logp = teacher.logp[rows]
    t_logp_t = torch.log_softmax(t_logp / mix.temperature, -1)
    weights = [decay**k / sum(decay**j for j in range(unroll)) for k in range(unroll)]
    loss, figures = 0, []
    for k in range(unroll):
        h = draft(ids.reshape(-1), positions, ctx, g)
        logits = draft.compute_logits(h[rows])
        logp, logp_t = torch.log_softmax(logits, -1), torch.log_softmax(logits / mix.temperature, -1)
        ok = (positions[rows] >= k).float()
        n = ok.sum().clamp_min(1)
        kl = ((t_logp.exp() * (t_logp - logp)).sum(-1) * ok).sum() / n
        kl_t = ((t_logp_t.exp() * (t_logp_t - logp_t)).sum(-1) * ok).sum() / n
        loss = loss + weights[k] * ((1 - mix.sampled_weight) * kl + mix.sampled_weight * kl_t)
        overlap = (torch.minimum(t_logp_t.exp(), logp_t.exp()).sum(-1) * ok).sum() / n
        top1 = ((logp.argmax(-1) == t_logp.argmax(-1)).float() * ok).sum() / n
        figures.append(torch.stack([kl.detach(), top1, kl_t.detach(), overlap.detach()]))
        g = shift_right(h, b, s)
    return loss, figures


@pytest.mark.parametrize("chunk", [4, 8192])
@pytest.mark.parametrize("mix", [LossMix(), LossMix(0.7, 0.5), LossMix(0.5, 1.0)])
def test_chunked_linear_kl_equals_scoring_whole_logits(setup, mix, chunk, monkeypatch):
    """The loss scored chunk by chunk through the frozen head (its gradient made in the forward) equals scoring each
    step's whole logits with autograd through them: the loss, every trained tensor's gradient and the per-step
    figures (float32), in chunks of 4 scored rows (several per step) or one; a trainable head is refused."""
    import specdec.training.linear_kl as lk

    monkeypatch.setattr(lk, "LOSS_CHUNK", chunk)
    _, target, _, _ = setup
    draft, teacher, ids, valid = _teacher_and_draft(target, seed=2)
    trained = [p for p in draft.parameters() if p.requires_grad]
    want, figures = _reference_unrolled_loss(draft, teacher, ids, valid, 3, 0.8, mix)
    want_grads = torch.autograd.grad(want, trained)
    got = unrolled_loss(draft, teacher, ids, valid, 3, 0.8, mix, measure=True)
    grads = torch.autograd.grad(got.loss, trained)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    assert len(grads) > 5 and all(g.abs().sum() > 0 for g in grads)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    for k, want_k in enumerate(figures):
        torch.testing.assert_close(torch.stack([got.kl[k], got.top1[k], got.kl_t[k], got.overlap_t[k]]), want_k,
                                   rtol=1e-5, atol=1e-6)
    draft.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen LM head"):
        unrolled_loss(draft, teacher, ids, valid, 3, 0.8, mix)


def test_time_budget_plans_the_run_through_the_cli(setup, capsys):
    """``--time-budget`` through the CLI: the step count is planned from timed steps (far below ``--steps``) and the
    run ends exactly at its plan with the draft written."""
    root, _, _, _ = setup
    out = root / "budget"
    args = ["distill", "--target", str(root / "target"), "--tokens", str(root / "regen.npz"),
            *_args(**{"--steps": "100000", "--ckpt-every": "1000"}), "--time-budget", "3", "--out", str(out)]
    assert main(args) == 0
    state = _ckpt(out)["state"]
    assert 20 <= state["planned"] < 100000 and state["step"] == state["planned"]
    assert (out / "model.safetensors").exists()


def test_cli_regenerates_from_a_start_and_trains_on_two_files(setup, tmp_path):
    """``--regen-start K`` regenerates from prompt conversation K on; ``--tokens A,B`` trains on both files as one,
    and the record names both and keeps each file's figures."""
    root, target, _, _ = setup
    prompt_token_file(root / "text.npz", tmp_path / "p.npz", eos_ids(target.tokenizer, target.config), 1)
    tiny = ["--target", str(root / "target"), "--device", "cpu"]
    regen = [*tiny, "--regenerate", str(tmp_path / "p.npz"), "--regen-new-tokens", "6", "--regen-batch", "8"]
    assert main(["distill", "--kind", "eagle", *regen, "--write-tokens", str(tmp_path / "b.npz"),
                 "--regen-start", "10"]) == 0
    later = load_token_file(tmp_path / "b.npz")
    assert later.num_docs > 0 and min(later.meta["source_docs"]) >= 10
    both = f"{root / 'regen.npz'},{tmp_path / 'b.npz'}"
    assert main(["distill", "--target", str(root / "target"), "--tokens", both,
                 *_args(**{"--steps": "2", "--val-docs": "2"}), "--out", str(tmp_path / "d")]) == 0
    rec = json.loads((tmp_path / "d" / "specdec_draft.json").read_text())["training"]
    assert rec["tokens_file"] == "regen.npz,b.npz"
    assert [f["num_docs"] for f in rec["data"]["files"]] == [load_token_file(root / "regen.npz").num_docs,
                                                             later.num_docs]
    assert rec["train_conversations"] + rec["val_conversations"] == rec["data"]["num_docs"]
    assert main(["distill", "--kind", "eagle", *regen, "--write-tokens", str(tmp_path / "c.npz"),
                 "--regen-start", "100000"]) == 2  # past the prompts: an error, not an empty file
