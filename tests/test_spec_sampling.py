"""End-to-end sampling through the engine: speculative sampling keeps the target distribution.

A tiny target and a different tiny draft over an 8-token vocabulary; thousands of seeded requests
of one prompt run as one generate() call, and the empirical distribution of the first token and
of the first two tokens jointly is chi-square tested against the exact target distribution
(transformers logits of the same weights, shaped by ``specdec.acceptance.shape_probs``).
The exact accept-rule checks live in tests/test_acceptance.py.
"""

from __future__ import annotations

import pytest
import torch

from specdec.acceptance import shape_probs
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams

scipy_stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 8
PROMPT = [1, 5, 2, 7, 3, 6, 4]
RUNS = 4000
P_MIN = 1e-3


@pytest.fixture(scope="module")
def small_pair(tiny_factory):
    # initializer_range 0.1: spread-out distributions (T=0.7/top_p=0.9 keeps 4 of the 8 tokens)
    kw = dict(vocab_size=VOCAB, max_position_embeddings=64, eos_token_id=None, bos_token_id=None,
              initializer_range=0.1)
    target_dir = tiny_factory("v8_target", seed=100, num_hidden_layers=2, **kw)
    draft_dir = tiny_factory("v8_draft", seed=200, num_hidden_layers=1, **kw)
    return target_dir, load_model(target_dir), load_model(draft_dir)


@pytest.fixture(scope="module")
def target_logits(small_pair):
    """(first-position logits (V,), second-position logits (V, V) indexed by the first token)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(small_pair[0]), dtype=torch.float32).eval()
    seqs = torch.tensor([PROMPT + [x] for x in range(VOCAB)])  # (V, len+1)
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


CONFIGS = [  # (draft, tree, temperature, top_k, top_p)
    ("model", "chain:2", 1.0, 0, 1.0),
    ("model", "chain:2", 0.7, 0, 0.9),
    ("model", "topk:2x2", 1.0, 5, 1.0),
    ("model", "topk:2x2", 0.7, 0, 0.9),
    ("eagle", "topk:2x2", 0.7, 0, 0.9),  # feature-conditioned draft over 6 of the 8 tokens
    (None, "chain:2", 0.7, 0, 0.9),  # target-only sampling, the baseline the others must equal
]


def _eagle_draft(target):
    """An untrained eagle draft whose vocabulary leaves out tokens 2 and 5 (draft probability 0)."""
    from specdec.drafts.eagle import EagleShape, eagle_from_target
    from specdec.loading.registry import LoadedModel

    model = eagle_from_target(target.model, EagleShape((0, 1), 6), torch.tensor([0, 1, 3, 4, 6, 7]), seed=3)
    model = model.eval().requires_grad_(False)
    return LoadedModel("eagle", model, None, model.config)


@pytest.fixture(scope="module")
def sampled(small_pair):
    """Per config: (counts of x1 (V,), counts of (x1, x2) (V, V), engine stats)."""
    _, target, draft = small_pair
    results = {}
    for n, (kind, tree, temp, top_k, top_p) in enumerate(CONFIGS):
        chosen = {"model": draft, "eagle": _eagle_draft(target) if kind == "eagle" else None, None: None}[kind]
        eng = SpecEngine(chosen, target, SpecConfig(
            tree=tree, num_blocks=2048, block_size=4, max_batch_size=128, max_num_tokens=8192,
            policy="max_utilization"))
        params = [SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=10_000 * n + s,
                                 max_new_tokens=2, ignore_eos=True) for s in range(RUNS)]
        outs = eng.generate([PROMPT] * RUNS, params)
        assert eng.all_blocks_free()
        pairs = torch.tensor([o.token_ids for o in outs])  # (RUNS, 2)
        assert pairs.shape == (RUNS, 2)
        joint = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
        joint.index_add_(0, pairs[:, 0] * VOCAB + pairs[:, 1], torch.ones(RUNS, dtype=torch.float64))
        joint = joint.view(VOCAB, VOCAB)
        results[CONFIGS[n]] = (joint.sum(1), joint, eng.stats)
    return results


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c[0]}-{c[1]}-T{c[2]}-k{c[3]}-p{c[4]}" for c in CONFIGS])
def test_first_token_distribution(sampled, target_logits, config):
    counts, _, stats = sampled[config]
    p1, _ = exact_dists(target_logits, *config[2:])
    assert (p1 > 0.02).sum() >= 3, "the target distribution is too peaked to test anything"
    p = chisquare_p(counts, p1)
    assert p > P_MIN, f"first-token counts {counts.tolist()} vs exact {p1.tolist()}: p={p:.2g}"
    if config[0] in ("model", "eagle"):
        # both branches of the accept rule ran: some draft tokens accepted, some rejected,
        # and the second level of the tree was reached and accepted sometimes
        assert 0.05 < stats.acceptance_rate < 0.95, stats.as_dict()
        assert len(stats.depth_accepted) >= 2 and stats.depth_accepted[1] > 0, stats.as_dict()


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c[0]}-{c[1]}-T{c[2]}-k{c[3]}-p{c[4]}" for c in CONFIGS])
def test_first_two_tokens_joint_distribution(sampled, target_logits, config):
    _, joint, _ = sampled[config]
    _, exact = exact_dists(target_logits, *config[2:])
    p = chisquare_p(joint, exact)
    assert p > P_MIN, f"joint counts vs exact target joint: p={p:.2g}"


def test_chisquare_detects_a_wrong_distribution(sampled, target_logits):
    """The test has power: the counts of T=1.0 are rejected against the T=0.7/top_p=0.9 target."""
    counts, joint, _ = sampled[CONFIGS[0]]
    p1, exact = exact_dists(target_logits, 0.7, 0, 0.9)
    with pytest.raises(AssertionError):
        assert chisquare_p(counts, p1) > P_MIN and chisquare_p(joint, exact) > P_MIN


# ---------------------------------------------------------------- seeded reproducibility


@pytest.mark.parametrize("tree", ["chain:2", "topk:2x2", "dynamic:8"])
def test_seed_reproducible_across_batch_composition(tiny_target, tiny_draft, tree):
    prompt = [17, 4, 99, 23, 5, 61, 8]
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_new_tokens=20, ignore_eos=True)

    def engine(**kw):
        return SpecEngine(tiny_draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=8, **kw))

    alone = engine().generate([prompt], mine)[0].token_ids
    assert len(alone) == 20
    others = [[3, 4, 5], prompt, list(range(40, 80)), prompt, [9] * 12]
    params = [SamplingParams(temperature=0.8, seed=1, max_new_tokens=25, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=15),
              mine,
              SamplingParams(temperature=1.3, top_k=20, seed=7, max_new_tokens=30, ignore_eos=True)]
    eng = engine()
    batch = eng.generate(others, params)
    assert batch[3].token_ids == alone
    assert batch[1].token_ids != alone  # another seed gives another sample
    one_by_one = engine(max_batch_size=1).generate(others, params)
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in batch]
    again = eng.generate([prompt], mine)[0]  # same engine, prefix now cached
    assert again.token_ids == alone
    assert eng.stats.accepted > 0
    assert eng.all_blocks_free()


def test_seeded_sampling_unchanged_by_preemption(tiny_target, tiny_draft):
    """Preemption recomputes a request's KV from its tokens; its random stream continues unchanged."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 256, (15 + 3 * i,), generator=g).tolist() for i in range(10)]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=100 + i, max_new_tokens=20, ignore_eos=True)
              for i in range(10)]
    roomy = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=512, block_size=4))
    expect = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:4", num_blocks=26, block_size=4,
                                                           policy="max_utilization"))
    preempted = []
    preempt = tight.scheduler.preempt
    tight.scheduler.preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    outs = tight.generate(prompts, params)
    assert preempted
    assert [o.token_ids for o in outs] == expect
    assert tight.all_blocks_free()
