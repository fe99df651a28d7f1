"""Repetition penalty (``SamplingParams.repetition_penalty``): greedy output with speculation equals target-only
decoding with the same penalty and a plain reference loop over the full model's logits; each verify token's
penalty set is its own context's; sampled output keeps the penalized target distribution (chi-square, with a
negative control against the unpenalized one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampling_power import VOCAB, check_with_control, pair, sample  # noqa: F401 (pair: the fixture)
from test_spec_sampling import tiny_eagle  # noqa: F401 (the fixture)

from specdec.acceptance import repetition_penalty, shape_probs
from specdec.engine import SpecConfig, SpecEngine
from specdec.repetition_penalty import ContextPenalty
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("single_thread")

PENALTY = 1.3
NEW_TOKENS = 12
PROMPTS = [[5, 9, 5, 9, 5, 9, 5], [17, 30, 41, 17, 30, 41, 17, 30], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4]]


def _reference(model, prompt: list[int], penalty: float, n: int) -> list[int]:
    """Greedy decoding, one full forward per token: argmax of the last position's logits after dividing the
    positive logits (multiplying the negative ones) of every token seen so far by ``penalty``."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()  # (V,)
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(tokens)] = True
            logits = torch.where(seen & (logits > 0), logits / penalty, torch.where(seen, logits * penalty, logits))
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"]), dtype=torch.float32).eval()
    return [_reference(hf, p, PENALTY, NEW_TOKENS) for p in PROMPTS]


PADDED = dict(cuda_graphs=True)  # on the CPU: the padded steps (and the captured code) run eagerly
PIPELINED = dict(cuda_graphs=True, pipeline=True)
CONFIGS = [("none", {}), ("none", PADDED), ("none", PIPELINED), ("ngram", {}), ("ngram", PADDED),
           ("ngram", dict(PIPELINED, ngram_device=True)), ("model", {}), ("model", PADDED), ("eagle", {}),
           ("eagle", PADDED), ("eagle", PIPELINED)]


@pytest.mark.parametrize("name,options", CONFIGS, ids=[f"{n}-{'-'.join(o) or 'packed'}" for n, o in CONFIGS])
def test_greedy_with_penalty_equals_the_reference(tiny_target, tiny_draft, tiny_eagle, reference, name,  # noqa: F811
                                                  options):
    """Greedy, penalized rows batched with a plain greedy row and a sampled one: the penalized outputs equal the
    reference loop (so target-only does too), and the plain row is unchanged by its neighbours."""
    draft = {"none": None, "ngram": "ngram", "model": tiny_draft, "eagle": tiny_eagle}[name]
    tree = "chain:3" if name in ("none", "ngram") else "topk:2x2"
    eng = SpecEngine(draft, tiny_target, SpecConfig(tree=tree, num_blocks=256, block_size=4, adaptive=False,
                                                    **options))
    penal = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=PENALTY)
    plain = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    hot = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.8, seed=3)
    outs = eng.generate([*PROMPTS, PROMPTS[0], PROMPTS[1]], [penal] * len(PROMPTS) + [plain, hot])
    assert [o.token_ids for o in outs[:len(PROMPTS)]] == reference
    alone = SpecEngine(None, tiny_target, SpecConfig(num_blocks=256, block_size=4)).generate([PROMPTS[0]], plain)
    assert outs[len(PROMPTS)].token_ids == alone[0].token_ids != reference[0]  # the penalty changed something
    assert eng.all_blocks_free()


def test_each_verify_token_has_its_own_context():
    """``ContextPenalty.apply``: each verify token's penalized tokens are the row's context plus exactly the tokens
    on its path."""
    tree = DraftTree.of_parents([7, 8, 9, 7], [-1, 0, -1, 2])  # root -> 7 -> 8, root -> 9 -> 7
    masks, _ = tree.verify_rows()
    present = torch.zeros(1, 12, dtype=torch.bool)
    present[0, [1, 2]] = True
    x = ContextPenalty(present, torch.full((1,), 2.0)).apply(torch.ones(1, 5, 12), torch.tensor([[0, 7, 8, 9, 7]]),
                                                            torch.tensor([masks]))
    want = [{1, 2}, {1, 2, 7}, {1, 2, 7, 8}, {1, 2, 9}, {1, 2, 9, 7}]
    assert [set((row == 0.5).nonzero().flatten().tolist()) for row in x[0]] == want


def test_the_context_tensors_hold_each_rows_tokens_counts_biases_and_held_back_tokens():
    """``ContextPenalty.of`` builds its (B, V) tensors from the rows' token ids: ``present`` marks the prompt and
    output tokens, ``output.counts`` counts the output's (repeats too), ``bias`` is -inf outside the allowed ids plus
    each logit bias there, ``held`` marks the ending tokens of rows still under ``min_tokens``; rows without the
    option (and the batch's other rows) hold zeros. Compared with a dense reference built token by token."""
    from types import SimpleNamespace

    vocab, b = 12, 4

    def req(prompt, output, **kw):
        params = SamplingParams(max_tokens=8, **kw)
        return SimpleNamespace(tokens=prompt + output, output_ids=output, num_output=len(output), params=params,
                               eos_token_ids=(11,), bad_word_ids=(), penalized=True)

    reqs = [req([1, 2, 2], [3, 3, 5], repetition_penalty=1.5, presence_penalty=0.5),
            req([4], [], allowed_token_ids=[0, 6, 7], logit_bias={6: 2.0, 9: -1.0}, min_tokens=2,
                stop_token_ids=[10]),
            req([5, 5], [7], frequency_penalty=1.0, logit_bias={7: 3.0}),
            req([8], [9])]  # (not among the rows: unchanged)
    got = ContextPenalty.of(reqs, [0, 1, 2], b, vocab, "cpu")
    present = torch.zeros(b, vocab, dtype=torch.bool)
    present[0, [1, 2, 3, 5]] = True
    assert torch.equal(got.present, present) and got.penalty.tolist() == [1.5, 1.0, 1.0, 1.0]
    counts = torch.zeros(b, vocab)
    counts[0, 3], counts[0, 5], counts[2, 7] = 2, 1, 1
    assert torch.equal(got.output.counts, counts)
    assert got.output.presence.tolist() == [0.5, 0, 0, 0] and got.output.frequency.tolist() == [0, 0, 1.0, 0]
    bias = torch.zeros(b, vocab)
    bias[1] = -torch.inf
    bias[1, [0, 6, 7]] = 0.0
    bias[1, 6] += 2.0
    bias[1, 9] += -1.0  # (outside the allowed ids: stays -inf)
    bias[2, 7] = 3.0
    assert torch.equal(got.bias, bias)
    held = torch.zeros(b, vocab, dtype=torch.bool)
    held[1, [10, 11]] = True
    assert torch.equal(got.held.tokens, held) and got.held.left.tolist() == [0, 2, 0, 0]
    assert got.bad is None


def test_a_queued_steps_context_counts_what_the_step_before_commits():
    """``committed_ahead`` gathers each going-on row's accepted path tokens and bonus token from a verify's outcome
    and input ids (rows picked by ``sel``, a joined row committing none), and ``ContextPenalty.of(..., ahead=)``
    equals the context built on the host once those tokens are committed: present tokens, output counts, the tail
    bad words match and the tokens ``min_tokens`` still holds back."""
    from types import SimpleNamespace

    from specdec.repetition_penalty import committed_ahead

    vocab, q = 16, 3

    def req(prompt, output, words=(), **kw):
        params = SamplingParams(max_tokens=12, **kw)
        return SimpleNamespace(tokens=prompt + output, output_ids=output, num_output=len(output), params=params,
                               eos_token_ids=(15,), bad_word_ids=words, penalized=True)

    def rows(extra):
        return [req([1, 2], [3] + extra[0], ((4, 5, 6), (7,)), repetition_penalty=1.5, presence_penalty=0.5,
                    min_tokens=4),
                req([8], [9, 9] + extra[1], ((9, 10),), frequency_penalty=1.0, min_tokens=3),
                req([11, 12], [] + extra[2], repetition_penalty=1.2)]

    # the step before: 3 rows of 3 queries (root, then a chain), its outcome [m, bonus, path (query indices)...]
    ids = torch.tensor([[0, 5, 6], [0, 12, 13], [0, 4, 5]])
    outcome = torch.tensor([[2, 7, 1, 2, 0, 1], [0, 2, 0, 0, 0, 1], [1, 6, 1, 0, 0, 1]])
    sel = np.array([2, 1])  # rows 0 and 1 of the queued step were rows 2 and 1 of the step before; row 2 joined
    tokens, counts = committed_ahead(outcome, ids, 2, sel, joined=1)
    assert tokens.tolist() == [[4, 6, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]] and counts.tolist() == [2, 1, 0]
    got = ContextPenalty.of(rows([[], [], []]), [0, 1, 2], 4, vocab, "cpu", (tokens, counts))
    want = ContextPenalty.of(rows([[4, 6], [2], []]), [0, 1, 2], 4, vocab, "cpu")
    # (the rows an option is off for gain the tokens too, which changes nothing: a penalty of 1, no count weight)
    assert torch.equal(got.present[[0, 2]], want.present[[0, 2]])
    assert torch.equal(got.output.counts[:2], want.output.counts[:2])
    assert got.held.left.tolist()[:2] == [1, 0] and torch.equal(got.bad.tail[:2], want.bad.tail[:2])
    logits, path, masks = torch.randn(4, q, vocab), torch.tensor([[0, 5, 10]] * 4), torch.tensor([[1, 3, 7]] * 4)
    torch.testing.assert_close(got.apply(logits, path, masks), want.apply(logits, path, masks), rtol=0, atol=0)


def test_kept_contexts_equal_contexts_built_from_the_tokens():
    """``ContextState`` kept across steps (tokens appended, a row taken by a new request, a request back on another
    row after a preemption, a row needing only counts) gives, for the rows that need them, the same ``present`` and
    ``counts`` as ``ContextPenalty.of`` builds from each request's whole token list, sending only new tokens."""
    from types import SimpleNamespace

    from specdec.repetition_penalty import ContextState

    vocab, rng = 20, np.random.default_rng(0)

    def req(row, prompt, **kw):
        r = SimpleNamespace(tokens=list(prompt), num_prompt=len(prompt), bt_row=row, eos_token_ids=(19,),
                            params=SamplingParams(max_tokens=50, **kw), bad_word_ids=(), penalized=True)
        return r

    def built(reqs, idx, b):  # the reference: from each request's tokens
        for r in reqs:
            r.output_ids, r.num_output = r.tokens[r.num_prompt:], len(r.tokens) - r.num_prompt
        return ContextPenalty.of(reqs, idx, b, vocab, "cpu")

    state = ContextState(6, "cpu")
    a = req(0, [1, 2, 3], repetition_penalty=1.3, presence_penalty=0.5)
    b = req(3, [4, 4, 5], frequency_penalty=0.7)
    c = req(5, [6, 7], repetition_penalty=1.1)
    batches = [[a, b], [a, b, c], [b, c], [a, b, c]]
    sent = []
    for step, batch in enumerate(batches * 2):
        if step == 4:  # a preempted, back on row 2; a new request takes row 5
            a.bt_row, c = 2, req(5, [8, 9, 9], repetition_penalty=1.2, presence_penalty=1.0)
            batch = [a, b, c]
        for r in batch:
            r.tokens += rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
        for r in batch:
            r.output_ids, r.num_output = r.tokens[r.num_prompt:], len(r.tokens) - r.num_prompt
        idx = list(range(len(batch)))
        before = state.synced["present"].sum() + state.synced["counts"].sum()
        got = ContextPenalty.of(batch, idx, 4, vocab, "cpu", state=state)
        want = built(batch, idx, 4)
        sent.append(state.synced["present"].sum() + state.synced["counts"].sum() - before)
        for i, r in enumerate(batch):
            if r.params.repetition_penalty != 1.0:
                assert torch.equal(got.present[i], want.present[i]), (step, i)
            if r.params.presence_penalty or r.params.frequency_penalty:
                assert torch.equal(got.output.counts[i], want.output.counts[i]), (step, i)
    assert max(sent[1:4]) < 30  # (steps after the first send what was committed since, not whole contexts)


def test_kept_bias_rows_equal_bias_rows_built_from_the_params():
    """``ContextState.bias_of``: each biased row's request's bias row, made once and kept while the request holds its
    block-table row (a new request on the row gets its own), equals ``ContextPenalty.of``'s built one; rows of the
    batch without a bias hold 0, whatever their block-table row held before."""
    from types import SimpleNamespace

    from specdec.repetition_penalty import ContextState

    def req(row, **kw):
        return SimpleNamespace(tokens=[1, 2], num_prompt=2, bt_row=row, output_ids=[], num_output=0,
                               eos_token_ids=(19,), params=SamplingParams(max_tokens=8, **kw), bad_word_ids=())

    state = ContextState(4, "cpu")
    a, b = req(0, allowed_token_ids=[3, 5, 7], logit_bias={5: 2.0}), req(2, logit_bias={9: -3.0})
    plain = req(1)
    c = req(0, logit_bias={4: 1.5})  # (a's row, after a ended)
    for batch in ([a, b], [a, b], [b, plain], [c, plain, b], [plain, c]):
        idx = [i for i, r in enumerate(batch) if r.params.logits_processed]
        got = ContextPenalty.of(batch, idx, 4, 12, "cpu", state=state).bias
        assert torch.equal(got, ContextPenalty.of(batch, idx, 4, 12, "cpu").bias), batch
    assert state.bias_owner[0] is c and not got[0].any()  # (plain, on row 1, first in the last batch)


def test_penalty_divides_positive_and_multiplies_negative_logits():
    x = torch.tensor([2.0, -2.0, 3.0, -1.0])
    got = repetition_penalty(x, torch.tensor([True, True, False, False]), 2.0)
    assert got.tolist() == [1.0, -4.0, 3.0, -1.0]


def _exact(logits, prompt, temperature, penalty):
    """(p1 (V,), joint (V, V)) of the first two tokens after ``prompt`` with the penalty (1: none)."""
    first, second = logits
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[torch.tensor(prompt)] = True
    p1 = shape_probs(repetition_penalty(first, seen, penalty), temperature).double()  # (V,)
    seen2 = seen.expand(VOCAB, VOCAB).clone()
    seen2[torch.arange(VOCAB), torch.arange(VOCAB)] = True  # row x1: the context has x1 too
    p2 = shape_probs(repetition_penalty(second, seen2, penalty), temperature).double()  # (V, V)
    return p1, p1[:, None] * p2


CHI_SAMPLES = 3000
CHI_PENALTY = 1.8
PENALTY_PROMPT = [1, 5, 1, 5, 1, 5, 1]  # few distinct tokens: the penalty moves the distribution a lot


@pytest.fixture(scope="module")
def penalty_logits(pair):  # noqa: F811
    from test_sampling_power import _prompt_logits

    return _prompt_logits(pair, PENALTY_PROMPT)


@pytest.mark.parametrize("proposer,tree,graphs", [("model", "chain:2", None), ("model", "chain:2", True),
                                                  ("ngram", "chain:3", True)])
def test_penalized_sampling_follows_the_penalized_target(pair, penalty_logits, proposer, tree, graphs):  # noqa: F811
    """CHI_SAMPLES seeded T=1 requests with a draft model (its sampled children through the host rule, or padded:
    the sampled rule) or n-gram chains (padded steps, the sampled rule): the first two tokens follow the
    penalized target distribution and fail the test against the unpenalized one."""
    setup = pair if proposer == "model" else (pair[0], pair[1], "ngram")
    joint, stats = sample(setup, tree, 1.0, 0, 1.0, CHI_SAMPLES, 7_000, cuda_graphs=graphs, prompt=PENALTY_PROMPT,
                          params=dict(repetition_penalty=CHI_PENALTY))
    p1, exact = _exact(penalty_logits, PENALTY_PROMPT, 1.0, CHI_PENALTY)
    _, unpenalized = _exact(penalty_logits, PENALTY_PROMPT, 1.0, 1.0)
    check_with_control(f"penalty {proposer} graphs={graphs}", joint, stats, p1, exact, unpenalized)
