"""Lossless with greedy and sampled rows in one batch, at batch 1, 7 and 32: through the EAGLE engine of the
device's defaults (on CUDA: captured graphs, pipelined steps and the epoch budget controller), every row, greedy
or seeded sampled (T=0.7 top-p 0.9, T=1.0), gives exactly the tokens of eager target-only decoding of the whole
batch, and a seeded sampled row gives them alone too. float32, the trained tiny EAGLE pair of ``test_eagle``; on
the CPU the same engine runs eagerly ([cpu]), on CUDA ([cuda]) the GPU round of the runner runs it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_eagle import DEVICES, _sentence, setup, trained_pair  # noqa: F401 - setup: the trained tiny draft, a fixture

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")


def _rows(n: int) -> tuple[list, list[SamplingParams]]:
    """``n`` chat prompts of different lengths, every third row greedy, the others seeded sampled."""
    prompts = [[{"role": "user", "content": _sentence(random.Random(100 + i), 3 + (5 * i) % 23)}] for i in range(n)]
    kinds = [{}, dict(temperature=0.7, top_p=0.9), dict(temperature=1.0)]
    params = [SamplingParams(max_new_tokens=10 + (7 * i) % 13, ignore_eos=True, seed=1000 + i, **kinds[i % 3])
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_rows", [1, 7, 32])
def test_mixed_greedy_and_sampled_rows_equal_target_only(setup, device, n_rows):  # noqa: F811 - the fixture
    prompts, params = _rows(n_rows)
    draft, target, _ = trained_pair(setup, device, params[0])
    cfg = dict(num_blocks=800, block_size=8, max_batch_size=32, device=device, prefix_cache=False)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, pipeline=False, **cfg))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [len(w) for w in want] == [p.max_new_tokens for p in params]
    eng = SpecEngine(draft, target, SpecConfig(**cfg))  # the device's defaults
    assert eng.plan.pipeline == (device == "cuda") and eng.plan.adaptive == (device == "cuda")
    for _ in range(2):  # (the second call runs under the budgets the first measured)
        assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.all_blocks_free() and (eng.stats.accepted > 0 or n_rows == 1)  # (the draft did propose)
    sampled = next((i for i, p in enumerate(params) if not p.greedy), None)
    if sampled is not None:  # a seeded sampled row alone: the same tokens as in the batch
        assert eng.generate([prompts[sampled]], params[sampled])[0].token_ids == want[sampled]


@pytest.mark.parametrize("device", DEVICES)
def test_penalized_rows_in_a_mixed_batch_equal_target_only(setup, device):  # noqa: F811 - the fixture
    """Rows with presence, frequency and repetition penalties (greedy and seeded sampled) among plain ones, through
    the device's defaults (on CUDA in pipelined steps, each queued step's penalties counting the tokens the step in
    flight commits, applied on the device to each verify token's path): every row gives eager target-only decoding's
    tokens."""
    prompts, params = _rows(7)
    penalties = [dict(presence_penalty=0.8, frequency_penalty=0.6), dict(presence_penalty=-1.5, frequency_penalty=-0.5,
                                                                         repetition_penalty=1.2)]
    params = [replace(p, **penalties[i // 3 % 2]) if i in (0, 1, 4) else p for i, p in enumerate(params)]
    draft, target, _ = trained_pair(setup, device, params[0])
    cfg = dict(num_blocks=800, block_size=8, max_batch_size=32, device=device, prefix_cache=False)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, pipeline=False, **cfg))
    want = [o.token_ids for o in plain.generate(prompts, params)]
    eng = SpecEngine(draft, target, SpecConfig(**cfg))
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    unpenalized = [replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) for p in params]
    assert [o.token_ids for o in plain.generate(prompts, unpenalized)] != want  # the penalties changed something
    assert eng.all_blocks_free()


@pytest.mark.parametrize("device", DEVICES)
def test_processed_rows_in_a_mixed_batch_equal_target_only(setup, device):  # noqa: F811 - the fixture
    """Rows with a ``logit_bias``, an ``allowed_token_ids`` set and ``min_tokens`` (its stop ids held back until it
    has its tokens), greedy and seeded sampled, among plain ones, through the device's defaults (pipelined on CUDA):
    every row gives eager target-only decoding's tokens."""
    prompts, params = _rows(9)
    draft, target, _ = trained_pair(setup, device, params[0])
    plain_cfg = dict(num_blocks=800, block_size=8, max_batch_size=32, device=device, prefix_cache=False)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, pipeline=False, **plain_cfg))
    free = [o.token_ids for o in plain.generate(prompts, params)]
    vocab = target.config.vocab_size
    processors = [dict(logit_bias={free[0][0]: -100.0, free[0][1]: 5.0}),
                  dict(allowed_token_ids=tuple(range(0, vocab, 2))),
                  dict(min_tokens=6, stop_token_ids=[free[2][3], free[2][4]])]
    params = [replace(p, **processors[i % 3]) if i < 6 else p for i, p in enumerate(params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    eng = SpecEngine(draft, target, SpecConfig(**plain_cfg))
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert want[:6] != free[:6] and all(t % 2 == 0 for i in (1, 4) for t in want[i])
    assert all(not set(want[i][:6]) & set(params[i].stop_token_ids) for i in (2, 5))
    assert eng.all_blocks_free()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_logprobs_in_a_mixed_batch_equal_target_only(setup, device):  # noqa: F811 - the fixture
    """Rows asking for log-probabilities (greedy and seeded sampled; on CUDA pipelined, each verify's asking rows'
    logits kept before the next step is queued and read after the acceptance) among plain ones, through the device's
    defaults, twice: every row gives eager target-only decoding's tokens, and each asked-for token's
    log-probability, rank and top 4 equal eager target-only decoding's (float32, 1e-4)."""
    prompts, params = _rows(9)
    params = [replace(p, logprobs=4) if i % 2 == 0 else p for i, p in enumerate(params)]
    draft, target, _ = trained_pair(setup, device, params[0])
    cfg = dict(num_blocks=800, block_size=8, max_batch_size=32, device=device, prefix_cache=False)
    plain = SpecEngine(None, target, SpecConfig(cuda_graphs=False, pipeline=False, **cfg))
    want = plain.generate(prompts, params)
    eng = SpecEngine(draft, target, SpecConfig(**cfg))
    for _ in range(2):
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        for o, w, p in zip(outs, want, params):
            assert (o.logprobs is None) == (p.logprobs is None)
            for got, ref in zip(o.logprobs or (), w.logprobs or ()):
                assert list(got) == list(ref) or set(got) == set(ref)  # (near-ties may order the top ones apart)
                assert all(abs(got[t].logprob - ref[t].logprob) < 1e-4 for t in ref)
                assert next(iter(got.values())).rank == next(iter(ref.values())).rank
    assert eng.all_blocks_free()
