"""Presence and frequency penalties (``SamplingParams.presence_penalty`` / ``frequency_penalty``, OpenAI's and
vLLM's): the logits lose ``frequency * count + presence * (count > 0)`` for each token's count in the output so
far (the prompt is not counted), after the repetition penalty; each verify token counts its own path; greedy
output with speculation equals a plain reference loop over the full model's logits (so target-only decoding's),
seeded sampled output equals target-only decoding's token for token, and the penalty changes a repeating output."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from specdec.scheduler.request import Request
from test_repetition_penalty import CONFIGS, NEW_TOKENS, PROMPTS
from test_spec_sampling import tiny_eagle  # noqa: F401 (the fixture)

from specdec.acceptance import count_penalty
from specdec.engine import SpecConfig, SpecEngine
from specdec.repetition_penalty import ContextPenalty
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")

COUNTED = dict(presence_penalty=0.7, frequency_penalty=0.9)
ALL_THREE = dict(COUNTED, repetition_penalty=1.3)
SAMPLED = dict(temperature=0.9, seed=11, presence_penalty=-2.0, frequency_penalty=-0.5)  # repeats are likely


def _penalized(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float, frequency: float,
               repetition: float) -> torch.Tensor:
    """(V,) ``logits`` with the three penalties written out: repetition over prompt + output, then the
    frequency and presence penalties over the output's counts."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[torch.tensor(prompt + output)] = True
    x = torch.where(seen & (logits > 0), logits / repetition, torch.where(seen, logits * repetition, logits))
    counts = torch.zeros_like(logits)
    for t in output:
        counts[t] += 1
    return x - (frequency * counts + presence * (counts > 0))


def _reference(model, prompt: list[int], options: dict, n: int) -> list[int]:
    """Greedy decoding, one full forward per token: argmax of the last position's penalized logits."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()  # (V,)
            x = _penalized(logits, prompt, tokens[len(prompt):], options.get("presence_penalty", 0.0),
                           options.get("frequency_penalty", 0.0), options.get("repetition_penalty", 1.0))
            tokens.append(int(x.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]), dtype=torch.float32).eval()
    return {name: [_reference(hf, p, options, NEW_TOKENS) for p in PROMPTS]
            for name, options in (("counted", COUNTED), ("all", ALL_THREE), ("plain", {}))}


def _batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy rows with presence and frequency penalties, with all three penalties, a plain greedy row and a
    seeded sampled row with presence and frequency penalties, batched."""
    fixed = dict(max_tokens=NEW_TOKENS, ignore_eos=True)
    params = ([SamplingParams(**fixed, **COUNTED)] * len(PROMPTS) + [SamplingParams(**fixed, **ALL_THREE)] *
              len(PROMPTS) + [SamplingParams(**fixed), SamplingParams(**fixed, **SAMPLED)])
    return [*PROMPTS, *PROMPTS, PROMPTS[0], PROMPTS[1]], params


@pytest.fixture(scope="module")
def target_only(tiny_target):
    """The seeded sampled row's tokens, target-only and alone (the penalties change them)."""
    prompts, params = _batch()
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=4))
    penalized, unpenalized = eng.generate([prompts[-1]] * 2, [params[-1], replace(params[-1], presence_penalty=0,
                                                                                  frequency_penalty=0)])
    assert penalized.token_ids != unpenalized.token_ids
    return penalized.token_ids


@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{'-'.join(o) or 'packed'}" for n, o in CONFIGS])
def test_penalized_rows_equal_the_reference(tiny_target, tiny_draft, tiny_eagle, reference, target_only,  # noqa: F811
                                            name, options):
    """Every proposer and step kind (float32): the greedy penalized rows equal the reference loop token for
    token (so target-only decoding), the plain row its unpenalized reference, the seeded sampled row its
    target-only tokens; every block is free afterwards."""
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                    **options))
    outs = [o.token_ids for o in eng.generate(*_batch())]
    k = len(PROMPTS)
    assert reference["counted"] != reference["plain"] != reference["all"] != reference["counted"]
    assert outs[:k] == reference["counted"] and outs[k:2 * k] == reference["all"]
    assert outs[2 * k] == reference["plain"][0] and outs[2 * k + 1] == target_only
    assert eng.all_blocks_free()


def test_count_penalty_is_the_formula():
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    got = count_penalty(x, counts, torch.tensor([[0.5]]), torch.tensor([[0.25]]))
    assert got.tolist() == [[1.0, -2.75, -0.75, 2.0]]  # x - (0.25 * count + 0.5 * (count > 0))


def test_counts_are_the_output_and_each_verify_tokens_path():
    """``ContextPenalty.of`` of a request with prompt [1, 2] and output [2, 3, 3] (the pending token the last 3),
    applied at the verify tokens of root -> 3 -> 3, root -> 4: token 1 (prompt only) is unpenalized, and each
    verify token counts the output plus its own path, as the formula over that context says."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    req = Request("r", [1, 2], params, tokens=[1, 2, 2, 3, 3])
    tree = DraftTree.of_parents([3, 3, 4], [-1, 0, -1])
    masks, _ = tree.verify_rows()
    tokens = torch.tensor([[0, 3, 3, 4]])
    logits = torch.linspace(-1.5, 2.0, 8).repeat(1, 4, 1)  # (1, Q, V)
    got = ContextPenalty.of([req], [0], 1, 8, "cpu").apply(logits, tokens, torch.tensor([masks]))[0]
    paths = [[], [3], [3, 3], [4]]
    want = torch.stack([_penalized(logits[0, j], [1, 2], [2, 3, 3] + path, 0.5, 0.25, 1.0)
                        for j, path in enumerate(paths)])
    assert torch.equal(got, want)
    assert torch.equal(got[:, :2], logits[0, :, :2])  # tokens 0 and 1 (in the prompt alone) keep their logits


def test_only_the_output_is_counted():
    """A token of the prompt that the output does not hold keeps its logit; with repetition_penalty it would
    not (that penalty counts the prompt too)."""
    req = Request("r", [5, 6], SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), tokens=[5, 6, 7])
    logits = torch.ones(1, 1, 8)
    got = ContextPenalty.of([req], [0], 1, 8, "cpu").apply(logits, torch.zeros(1, 1, dtype=torch.int64),
                                                           torch.ones(1, 1, dtype=torch.int64))[0, 0]
    assert got[5] == got[6] == 1.0 and got[7] == 1.0 - 4.0


def test_frequency_penalty_changes_a_repeating_output(tiny_target, reference):
    """Negative control: the unpenalized greedy output of a prompt repeats a token; frequency_penalty=2 changes
    it (n-gram drafter), and the change is the reference loop's."""
    plain = reference["plain"][0]
    assert len(set(plain)) < len(plain)  # the greedy output repeats
    eng = SpecEngine("ngram", tiny_target, SpecConfig(tree="chain:3", num_blocks=256, block_size=4))
    out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                  frequency_penalty=2.0))[0].token_ids
    assert out != plain and len(set(out)) > len(set(plain))


def test_validation_names_the_field():
    for name in ("presence_penalty", "frequency_penalty"):
        for bad in (2.5, -2.01, float("nan"), float("inf"), "1", True, None):
            with pytest.raises(ValueError, match=rf"{name} must be a number in \[-2, 2\]"):
                SamplingParams(**{name: bad})
        assert SamplingParams(**{name: -2}).logits_processed and SamplingParams(**{name: 2.0}).logits_processed
        assert not SamplingParams(**{name: 0}).logits_processed
