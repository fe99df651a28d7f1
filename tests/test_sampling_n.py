"""``SamplingParams.n``: n samples of one prompt as one ``RequestOutput`` (vLLM's ``outputs``), run as n requests
that share the prompt's KV through the prefix cache; each sample seeded from (seed, i)."""

from __future__ import annotations

import pytest

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams, sample_seed

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = list(range(10, 43))  # 33 tokens: 4 full blocks of 8 before the pending token
OTHER = [7, 8, 9, 10, 11]


def _engine(target, draft="ngram", **kw):
    return SpecEngine(draft, target, SpecConfig(tree="chain:3", num_blocks=256, block_size=8, adaptive=False, **kw))


def _samples(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_n_samples_in_one_output(tiny_target):
    eng = _engine(tiny_target)
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=8, ignore_eos=True)
    outs = eng.generate([PROMPT, OTHER], [params, SamplingParams(max_tokens=4)])
    assert len(outs) == 2 and len(outs[1].outputs) == 1
    out = outs[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.prompt_token_ids == PROMPT
    assert len({tuple(s) for s in _samples(out)}) == 4  # T = 1: distinct samples
    assert eng.all_blocks_free()


def test_seeded_samples_repeat_alone_and_in_a_batch(tiny_target):
    """The same seed gives the same n samples, alone or batched with other requests; sample i is the request of
    seed ``sample_seed(seed, i)``, sample 0 the one of the seed itself."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=10, ignore_eos=True)
    alone = _samples(_engine(tiny_target).generate([PROMPT], params)[0])
    noisy = SamplingParams(temperature=1.0, max_tokens=12)
    batched = _engine(tiny_target).generate([OTHER, PROMPT, OTHER], [noisy, params, noisy])
    assert _samples(batched[1]) == alone
    single = [SamplingParams(temperature=0.9, top_p=0.95, seed=sample_seed(11, i), max_tokens=10, ignore_eos=True)
              for i in range(3)]
    assert [o.token_ids for o in _engine(tiny_target).generate([PROMPT] * 3, single)] == alone
    assert sample_seed(11, 0) == 11 and len({sample_seed(11, i) for i in range(3)}) == 3


def test_greedy_n_gives_identical_copies(tiny_target, tiny_draft):
    """Greedy with n = 3 under speculation (n-gram, a draft model): three copies of target-only greedy output."""
    want = _engine(tiny_target, None).generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    for draft in ("ngram", tiny_draft):
        out = _engine(tiny_target, draft).generate([PROMPT], SamplingParams(n=3, max_tokens=12, ignore_eos=True))[0]
        assert _samples(out) == [want] * 3


def test_samples_share_the_prompt_blocks(tiny_target):
    """The n requests reuse the prompt's KV blocks computed once (prefix-cache hits of every full block), and
    free every block at the end."""
    eng = _engine(tiny_target)
    cache = eng.scheduler.prefix_cache
    eng.generate([PROMPT], SamplingParams(temperature=1.0, n=4, max_tokens=6, ignore_eos=True))
    assert cache.stats.hit_tokens == 3 * 32, cache.stats  # samples 1..3 each reuse the 4 full blocks
    assert eng.all_blocks_free()


def test_add_request_refuses_several_samples(tiny_target):
    with pytest.raises(ValueError, match="n must be 1"):
        _engine(tiny_target).add_request(PROMPT, SamplingParams(n=2))


BAD_VALUES = [(dict(n=0), "n"), (dict(n=1.5), "n"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
              (dict(repetition_penalty=0), "repetition_penalty"),
              (dict(repetition_penalty=float("nan")), "repetition_penalty")]


@pytest.mark.parametrize("kwargs, field", BAD_VALUES)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} ") as err:
        SamplingParams(**kwargs)
    assert err.value.field == field


def test_cli_prints_each_sample(tiny_dirs, tmp_path, capsys):
    from serving_helpers import with_tokenizer

    from specdec.cli import main

    model = with_tokenizer(tiny_dirs["llama"], tmp_path / "llama")
    rc = main(["generate", "--model", str(model), "--draft", "ngram", "--device", "cpu", "--prompt", "abc", "--n", "2",
               "--temperature", "1", "--seed", "3", "--min-p", "0.05", "--repetition-penalty", "1.2",
               "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("[sample 0]\n") and "\n[sample 1]\n" in out
