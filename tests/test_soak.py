"""Soak (sized for CI): mixed greedy / seeded / stop-string requests with shared prefixes, an
interleaved stream that is abandoned half-way, preemption and the prefix cache, on one engine.
Everything finishes, no block leaks, greedy output equals a cache-free target-only run, and seeded
samples are reproduced by an engine that batches them differently."""

from __future__ import annotations

import random

import pytest

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

NUM_REQUESTS = 36
STOPS = ["e", "k", "ab", "bz", "q"]


def workload(seed: int = 0):
    """(prompts, params, kinds): prompts share four prefixes; kinds are greedy / seeded / stop."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 190) for _ in range(9 + 4 * b)] for b in range(4)]
    prompts, params, kinds = [], [], []
    for i in range(NUM_REQUESTS):
        prompts.append(bases[i % 4] + [rng.randrange(3, 190) for _ in range(rng.randrange(0, 7))])
        n = rng.randrange(6, 22)
        kind = ("greedy", "seeded", "stop")[i % 3]
        kinds.append(kind)
        if kind == "greedy":
            params.append(SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0))
        elif kind == "seeded":
            params.append(SamplingParams(temperature=rng.choice([0.8, 1.0]), top_p=0.9, seed=1000 + i,
                                         max_new_tokens=n, ignore_eos=True))
        else:
            params.append(SamplingParams(max_new_tokens=n, stop=rng.sample(STOPS, 2),
                                         stop_token_ids=[rng.randrange(3, 190)]))
    return prompts, params, kinds


def spec_engine(tiny_draft, target, **kw) -> SpecEngine:
    # 64 blocks: tight enough to preempt with the seeded requests' UniformStream samples (72 with the old generators)
    opts = dict(tree="chain:3", num_blocks=64, block_size=4, max_batch_size=10, policy="max_utilization")
    return SpecEngine(tiny_draft, target, SpecConfig(**{**opts, **kw}))


def test_soak(tiny_draft, letter_target):
    prompts, params, kinds = workload()
    eng = spec_engine(tiny_draft, letter_target)
    preempted = []
    preempt = eng.scheduler.preempt
    eng.scheduler.preempt = lambda req: (preempted.append(req.request_id), preempt(req))

    # a second stream runs alongside and is abandoned half-way: its requests are aborted
    noise = eng.stream([p[::-1] for p in prompts[:12]], SamplingParams(max_new_tokens=30, ignore_eos=True))
    main = eng.stream(prompts, params)
    outs, noise_seen = [], 0
    for out in main:
        outs.append(out)
        if noise is not None:
            noise_seen += 1
            next(noise, None)
            if noise_seen == 25:
                noise.close()
                noise = None
    finals = {o.request_id: o for o in outs if o.finished}
    assert len(finals) == NUM_REQUESTS
    finals = sorted(finals.values(), key=lambda o: int(o.request_id))
    assert all(o.error is None and o.finish_reason in ("stop", "length") for o in finals)
    assert preempted, "the pool was meant to be tight enough to preempt"
    assert eng.scheduler.prefix_cache.stats.hit_tokens > 0
    assert not eng.scheduler.has_work and eng.all_blocks_free()

    # greedy (with or without stop rules) equals a cache-free, target-only run of each request alone
    plain = SpecEngine(None, letter_target, SpecConfig(num_blocks=64, block_size=4, prefix_cache=False))
    for o, prompt, p, kind in zip(finals, prompts, params, kinds):
        if kind == "seeded":
            continue
        ref = plain.generate([prompt], p)[0]
        assert (o.token_ids, o.text, o.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        if kind == "stop" and o.finish_reason == "stop":
            assert not any(s in o.text for s in p.stop), (o.text, p.stop)
    assert any(o.finish_reason == "stop" and o.token_ids[-1] not in p.stop_token_ids
               for o, p, k in zip(finals, params, kinds) if k == "stop"), "no stop string ever matched"

    # seeded samples do not depend on batch composition: another engine, other batches, same tokens
    seeded = [i for i, k in enumerate(kinds) if k == "seeded"]
    other = spec_engine(tiny_draft, letter_target, max_batch_size=3, num_blocks=256)
    again = other.generate([prompts[i] for i in seeded[::-1]], [params[i] for i in seeded[::-1]])
    assert [o.token_ids for o in again[::-1]] == [finals[i].token_ids for i in seeded]
    assert other.all_blocks_free()
