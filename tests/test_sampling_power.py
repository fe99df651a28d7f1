"""Speculative sampling keeps the target distribution, tested with power.

A tiny target over an 8-token vocabulary and a draft correlated with it (the target with noise on
its output projection: mean accepted length about 2, so acceptance, rejection and the bonus token are all
exercised). For each tree kind (chain, top-k tree, dynamic tree) and two sampling
settings, SAMPLES seeded requests of one prompt run as one ``generate`` call; the first token and
the first two tokens jointly are chi-square tested against the exact target distribution
(transformers logits of the same weights, shaped by ``specdec.acceptance.shape_probs``). A negative
control runs the engine with a deliberately wrong rule (one noise for every position) and must fail the same
test.

CI runs SAMPLES = 3000 per configuration (the negative control shows that this size has power);
``SPECDEC_CHISQ_SAMPLES=20000`` runs the full-size test (bench/RESULTS.md has its figures).
"""

from __future__ import annotations

import os

import pytest
import torch

from specdec.acceptance import shape_probs
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 8
PROMPT = [1, 5, 2, 7, 3, 6, 4]  # block_size 2: its first 6 tokens are served from the prefix cache
NGRAM_PROMPT = [1, 5, 2, 1, 5, 2, 1]  # the n-gram drafter proposes 5, 2, 1 after it
SAMPLES = int(os.environ.get("SPECDEC_CHISQ_SAMPLES", "3000"))
P_MIN = 1e-3
DRAFT_NOISE = 0.3  # std of the noise on the draft's lm_head, relative to the weights' std
TREES = ["chain:2", "topk:2x2", "dynamic:18"]
SETTINGS = [(0.9, 6, 1.0), (0.7, 0, 0.9)]  # (temperature, top_k, top_p)
CONFIGS = [(tree, *s) for tree in TREES for s in SETTINGS]
IDS = [f"{c[0]}-T{c[1]}-k{c[2]}-p{c[3]}" for c in CONFIGS]


@pytest.fixture(scope="module")
def pair(tiny_factory):
    """(target folder, target, draft): the draft is the target with a noisy lm_head."""
    kw = dict(vocab_size=VOCAB, max_position_embeddings=64, eos_token_id=None, bos_token_id=None,
              initializer_range=0.2)
    target_dir = tiny_factory("v8_power_target", seed=100, num_hidden_layers=2, **kw)
    draft = load_model(target_dir)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = draft.model.lm_head.weight
        w.add_(DRAFT_NOISE * w.std() * torch.randn(w.shape, generator=g))
    return target_dir, load_model(target_dir), draft


@pytest.fixture(scope="module")
def target_logits(pair):
    """(first-position logits (V,), second-position logits (V, V) indexed by the first token) after PROMPT."""
    return _prompt_logits(pair, PROMPT)


@pytest.fixture(scope="module")
def ngram_logits(pair):
    """``target_logits`` after NGRAM_PROMPT."""
    return _prompt_logits(pair, NGRAM_PROMPT)


def _prompt_logits(pair, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(pair[0]), dtype=torch.float32).eval()
    seqs = torch.tensor([prompt + [x] for x in range(VOCAB)])  # (V, len+1)
    with torch.inference_mode():
        logits = hf(seqs).logits.double()  # (V, len+1, V)
    return logits[0, -2], logits[:, -1]


def exact_dists(target_logits, temperature, top_k, top_p):
    first, second = target_logits
    p1 = shape_probs(first, temperature, top_k, top_p).double()  # (V,)
    p2 = shape_probs(second, temperature, top_k, top_p).double()  # (V, V): p(x2 | x1)
    return p1, p1[:, None] * p2


def chisquare_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs; cells with expected < 5 are pooled.

    Cells of probability 0 must be empty (asserted), and are left out of the test."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    zero = probs == 0
    assert counts[zero].sum() == 0, f"tokens of zero target probability were sampled: {counts[zero]}"
    counts, expected = counts[~zero], probs[~zero] / probs[~zero].sum() * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    assert len(counts) >= 2
    return float(scipy_stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


def sample(pair, tree, temperature, top_k, top_p, n, seed0, cuda_graphs=None, prompt=PROMPT, setup=None,
           params=None):
    """Joint counts (V, V) of the first two tokens of n seeded requests, and the engine's statistics. ``pair``:
    (target folder, target, draft: a model, "ngram" or None); ``setup(engine)`` runs before generating;
    ``params``: more SamplingParams fields (min_p, repetition_penalty)."""
    _, target, draft = pair
    eng = SpecEngine(draft, target, SpecConfig(tree=tree, num_blocks=16384, block_size=2, max_batch_size=512,
                                               max_num_tokens=8192, policy="max_utilization",
                                               cuda_graphs=cuda_graphs))
    if setup is not None:
        setup(eng)
    more = params or {}
    plist = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed0 + s, max_new_tokens=3,
                            ignore_eos=True, **more) for s in range(n)]
    outs = eng.generate([prompt] * n, plist)
    assert eng.all_blocks_free() and not any(o.error for o in outs)
    pairs = torch.tensor([o.token_ids[:2] for o in outs])  # (n, 2)
    joint = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    joint.index_add_(0, pairs[:, 0] * VOCAB + pairs[:, 1], torch.ones(n, dtype=torch.float64))
    return joint.view(VOCAB, VOCAB), eng.stats


def check_with_control(label: str, joint: torch.Tensor, stats, p1: torch.Tensor, exact: torch.Tensor,
                       wrong: torch.Tensor) -> None:
    """The first token and the first two (``joint`` counts) pass the chi-square test against the exact ``p1`` and
    ``exact``, fail it against the ``wrong`` joint distribution (the negative control), and speculation took
    part (``stats``: some draft token was accepted)."""
    p_first, p_joint, p_wrong = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact), chisquare_p(joint, wrong)
    print(f"\n{label}: samples={int(joint.sum())} p(first)={p_first:.3g} p(joint)={p_joint:.3g} "
          f"p(control)={p_wrong:.3g} accepted={stats.accepted}")
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)
    assert p_wrong < P_MIN, p_wrong
    assert stats.accepted > 0


@pytest.fixture(scope="module")
def sampled(pair):
    return {c: sample(pair, *c, SAMPLES, 100_000 * i) for i, c in enumerate(CONFIGS)}


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_first_two_tokens_follow_the_target(sampled, target_logits, config):
    joint, stats = sampled[config]
    p1, exact = exact_dists(target_logits, *config[1:])
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\n{config}: samples={SAMPLES} p(first)={p_first:.3g} p(joint)={p_joint:.3g} mean accepted length="
          f"{stats.mean_accepted_length:.2f} acceptance rate={stats.acceptance_rate:.2f}")
    assert (p1 > 0.02).sum() >= 2 and (exact > 0.01).sum() >= 5, "the target is too peaked to test anything"
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint, joint.tolist())
    # the draft is correlated: draft tokens are accepted often, at depth 1 and 2, but not always
    assert stats.mean_accepted_length >= 1.8, stats.as_dict()
    assert stats.depth_accepted[1] > 0.05 * stats.target_forwards, stats.as_dict()
    assert stats.accepted < stats.drafted


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2]], ids=[IDS[1], IDS[2]])
def test_padded_step_keeps_the_target_distribution(pair, target_logits, config, monkeypatch):
    """cuda_graphs=True (on the CPU: the padded step, run eagerly): sampled rows are accepted by the device rule
    (``sampled_rule``; the host rule is forbidden), and the first two tokens still follow the target."""
    import specdec.verifier

    def forbidden(*args, **kwargs):
        raise AssertionError("host stochastic rule used on the padded path")

    monkeypatch.setattr(specdec.verifier, "_host_rule", forbidden)
    monkeypatch.setattr(specdec.verifier, "DEVICE_SAMPLED_MIN_ROWS", 1)  # every sampled row on the device
    joint, stats = sample(pair, *config, SAMPLES, 500_000, cuda_graphs=True)
    p1, exact = exact_dists(target_logits, *config[1:])
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\npadded step {config}: samples={SAMPLES} p(first)={p_first:.3g} p(joint)={p_joint:.3g} "
          f"mean accepted length={stats.mean_accepted_length:.2f}")
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint, joint.tolist())
    assert stats.depth_accepted[1] > 0.05 * stats.target_forwards, stats.as_dict()


@pytest.mark.parametrize("draft,wrong", [("ngram", False), (None, False), ("ngram", True)],
                         ids=["ngram", "target-only", "ngram-one-noise"])
def test_graphed_sampled_rule_keeps_the_target_distribution(pair, ngram_logits, draft, wrong, monkeypatch):
    """CUDA stood in (``test_sampled_rule.stand_in_verify_graphs``): every verify is a captured graph, so sampled
    rows go through the captured rule (``specdec.sampled_rule``; the host rule is forbidden) at every batch size;
    n-gram chains (point-mass drafts, accepted sometimes) and target-only decode keep the target distribution of
    the first two tokens (SAMPLES requests, chi-square). Negative control: the rule with one noise for every
    position (the tokens of a request are then not independent draws) fails the same test."""
    from test_sampled_rule import stand_in_verify_graphs

    import specdec.verifier

    def forbidden(*args, **kwargs):
        raise AssertionError("host stochastic rule used on the graphed path")

    monkeypatch.setattr(specdec.verifier, "_host_rule", forbidden)
    if wrong:
        _one_noise_everywhere(monkeypatch, "specdec.sampled_rule")
    engines = []
    settings = (0.7, 0, 0.9)

    def setup(eng):
        stand_in_verify_graphs(monkeypatch, eng)
        engines.append(eng)

    joint, stats = sample((pair[0], pair[1], draft), "chain:3", *settings, SAMPLES, 700_000, cuda_graphs=True,
                          prompt=NGRAM_PROMPT, setup=setup)
    p1, exact = exact_dists(ngram_logits, *settings)
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\ngraphed rule {draft} wrong={wrong}: samples={SAMPLES} p(first)={p_first:.3g} p(joint)={p_joint:.3g} "
          f"accepted={stats.accepted} drafted={stats.drafted}")
    rule = engines[0].verifier.sampled_rule
    assert rule.graphs and sum(g.replays for g, *_ in rule.graphs.values()) > 0
    if draft is not None:
        assert 0.02 * stats.drafted < stats.accepted < stats.drafted  # proposals tried, some accepted
    if wrong:
        assert p_joint < P_MIN
    else:
        assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint, joint.tolist())


def _one_noise_everywhere(monkeypatch, module: str) -> None:
    """A wrong rule for the negative controls: ``module``'s token choice uses the noise of position 0 at every
    position, so each token's own distribution is still the target's but a request's tokens are not independent
    draws (the second follows the first's noise): the joint distribution of the first two tokens is wrong."""
    import importlib

    mod = importlib.import_module(module)
    choose = mod.choose_tokens

    def wrong(x, temperature, key0, key1, position, kept=None, **kw):
        return choose(x, temperature, key0, key1, torch.zeros_like(position), kept, **kw)

    monkeypatch.setattr(mod, "choose_tokens", wrong)


def test_negative_control_one_noise_fails(pair, target_logits, monkeypatch):
    """The host rule choosing every token with the noise of position 0 (the same Gumbel noise at every position of a
    request) keeps each token's marginal but correlates a request's tokens; the chi-square test of the first two
    tokens jointly, at the same sample size, catches it."""
    _one_noise_everywhere(monkeypatch, "specdec.verifier")
    config = CONFIGS[0]
    joint, stats = sample(pair, *config, SAMPLES, 0)
    p1, exact = exact_dists(target_logits, *config[1:])
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\nnegative control {config}: samples={SAMPLES} p(first)={p_first:.3g} p(joint)={p_joint:.3g}")
    assert p_joint < P_MIN


def test_eagle_draft_keeps_the_target_distribution(pair, target_logits):
    """A feature-conditioned (eagle) draft whose vocabulary leaves out tokens 2 and 5 (draft probability 0):
    the first two sampled tokens still follow the target exactly (top-k tree drawn without replacement)."""
    from specdec.loading.registry import LoadedModel
    from specdec.models.eagle import EagleShape, eagle_from_target

    target_dir, target, _ = pair
    model = eagle_from_target(target.model, EagleShape((0, 1), 6), torch.tensor([0, 1, 3, 4, 6, 7]), seed=3)
    eagle = LoadedModel("eagle", model.eval().requires_grad_(False), None, model.config)
    settings = (0.7, 0, 0.9)
    joint, stats = sample((target_dir, target, eagle), "topk:2x2", *settings, SAMPLES, 900_000)
    p1, exact = exact_dists(target_logits, *settings)
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\neagle topk:2x2 {settings}: p(first)={p_first:.3g} p(joint)={p_joint:.3g} "
          f"mean accepted length={stats.mean_accepted_length:.2f}")
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint, joint.tolist())
    assert 0 < stats.accepted < stats.drafted  # its proposals are tried, and sometimes accepted


@pytest.mark.parametrize("tree,wrong", [("topk:2x2", False), ("dynamic:6", False), ("dynamic:6", True)],
                         ids=["topk", "dynamic", "dynamic-one-noise"])
def test_eagle_device_program_keeps_the_target_distribution(pair, target_logits, tree, wrong, monkeypatch):
    """Sampled rows drafted by the EAGLE device program (cuda_graphs=True: the padded path, CUDA stood in so the
    verify counts as captured and the sampled rule is the captured one): every proposal comes from the device
    program (no host-drafted step), its deterministic trees are verified point-mass by point-mass, and the first
    two tokens follow the target (SAMPLES requests, chi-square). Negative control: one noise for every
    position fails."""
    from test_sampled_rule import stand_in_verify_graphs

    import specdec.verifier
    from specdec.loading.registry import LoadedModel
    from specdec.models.eagle import EagleShape, eagle_from_target

    def forbidden(*args, **kwargs):
        raise AssertionError("host stochastic rule used on the device path")

    monkeypatch.setattr(specdec.verifier, "_host_rule", forbidden)
    if wrong:
        _one_noise_everywhere(monkeypatch, "specdec.sampled_rule")
    target_dir, target, _ = pair
    model = eagle_from_target(target.model, EagleShape((0, 1), 6), torch.tensor([0, 1, 3, 4, 6, 7]), seed=3)
    eagle = LoadedModel("eagle", model.eval().requires_grad_(False), None, model.config)
    engines = []

    def setup(eng):
        stand_in_verify_graphs(monkeypatch, eng)
        engines.append(eng)

    settings = (0.7, 0, 0.9)
    joint, stats = sample((target_dir, target, eagle), tree, *settings, SAMPLES, 1_100_000, cuda_graphs=True,
                          setup=setup)
    p1, exact = exact_dists(target_logits, *settings)
    p_first, p_joint = chisquare_p(joint.sum(1), p1), chisquare_p(joint, exact)
    print(f"\neagle device {tree} wrong={wrong}: samples={SAMPLES} p(first)={p_first:.3g} p(joint)={p_joint:.3g} "
          f"mean accepted length={stats.mean_accepted_length:.2f}")
    paths = engines[0].drafter.paths
    assert paths["device"] == paths["fused"] > 0 and paths["host"] == 0, paths  # every step fused
    assert 0.02 * stats.drafted < stats.accepted < stats.drafted
    if wrong:
        assert p_joint < P_MIN
    else:
        assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint, joint.tolist())


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_drafts_coupled_with_the_target_are_accepted_more_often(pair, kind, monkeypatch):
    """A sampled row's draft children are drawn with the noise the target's rule uses at their positions (a Llama
    draft's chain on the host, the EAGLE device program's tree): the first child then agrees with the target's own
    draw as often as the two distributions allow. Against the same drafts drawn with noise of other positions
    (independent draws), they are accepted clearly more often (1,000 requests each, T = 0.7)."""
    import specdec.drafters.model_drafter as md
    from specdec.drafters.eagle_device import DeviceDraftProgram
    from specdec.loading.registry import LoadedModel
    from specdec.models.eagle import EagleShape, eagle_from_target

    target_dir, target, draft = pair
    if kind == "eagle":
        model = eagle_from_target(target.model, EagleShape((0, 1), 6), torch.tensor([0, 1, 3, 4, 6, 7]), seed=3)
        draft = LoadedModel("eagle", model.eval().requires_grad_(False), None, model.config)
    run = {"model": lambda: sample(pair, "chain:2", 0.7, 0, 1.0, 1000, 0),
           "eagle": lambda: sample((target_dir, target, draft), "topk:2x2", 0.7, 0, 1.0, 1000, 0, cuda_graphs=True)}
    _, coupled = run[kind]()
    children, scores = md._coupled_children, DeviceDraftProgram._children_scores
    monkeypatch.setattr(md, "_coupled_children", lambda q, k, s, pos: children(q, k, s, [p + 10**6 for p in pos]))
    monkeypatch.setattr(DeviceDraftProgram, "_children_scores", lambda self, c, lg, d: scores(self, c, lg, d + 10**6))
    _, apart = run[kind]()
    print(f"\n{kind}: accepted {coupled.accepted} coupled, {apart.accepted} drawn apart; mean accepted length "
          f"{coupled.mean_accepted_length:.2f} against {apart.mean_accepted_length:.2f}")
    assert coupled.accepted > 1.25 * apart.accepted
    assert coupled.mean_accepted_length > apart.mean_accepted_length


@pytest.mark.parametrize("graphs", [None, True])
def test_n_samples_of_one_request_follow_the_target(pair, target_logits, graphs):
    """``SamplingParams(n=...)``: the samples of seeded requests (each run as n requests sharing the prompt) are
    independent draws of the target's distribution with the draft model speculating (packed host steps, and the
    padded steps run eagerly): the first two tokens of about SAMPLES // 2 samples (requests of n = 125, each with
    its own seed: n is at most 128) pass the chi-square test; the negative control (the same counts against the
    target's distribution at T = 1.3 instead of 0.9) fails it."""
    _, target, draft = pair
    per = 125  # samples per request (n is at most 128)
    requests = max(1, SAMPLES // 2 // per)
    n = per * requests
    eng = SpecEngine(draft, target, SpecConfig(tree="chain:2", num_blocks=16384, block_size=2, max_batch_size=512,
                                               max_num_tokens=8192, policy="max_utilization", cuda_graphs=graphs))
    params = [SamplingParams(temperature=0.9, top_k=6, seed=7 + i, n=per, max_new_tokens=3,
                             ignore_eos=True) for i in range(requests)]
    outs = eng.generate([PROMPT] * requests, params)
    samples = [c for out in outs for c in out.outputs]
    assert len(samples) == n and eng.all_blocks_free()
    pairs = torch.tensor([c.token_ids[:2] for c in samples])  # (n, 2)
    joint = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    joint.index_add_(0, pairs[:, 0] * VOCAB + pairs[:, 1], torch.ones(n, dtype=torch.float64))
    p1, exact = exact_dists(target_logits, 0.9, 6, 1.0)
    wrong = exact_dists(target_logits, 1.3, 6, 1.0)[1]
    check_with_control(f"n={n} graphs={graphs}", joint.view(VOCAB, VOCAB), eng.stats, p1, exact, wrong)
