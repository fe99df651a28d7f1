"""A server over a tensor-parallel group (docs/parallel.md, ``serving.tensor_parallel``): requests reach rank 0,
whose executor sends every add, abort and step to rank 1. Two gloo ranks, the tiny target split in two, the real
app and the openai client: every completion (streamed and not, greedy and seeded sampled, n-gram and a draft model)
equals the same request run alone on one unsplit engine (also after a reader left mid-stream: its abort reaches
rank 1 too), rank 1 applied every operation rank 0 sent (heartbeats while idle included), and both ranks end with
every KV block free."""

from __future__ import annotations

import pytest
from serving_helpers import with_tokenizer
from tp_helpers import run_ranks, serve_rank

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["Hello there, tell me a story.", "abc", "The quick brown fox jumps over the lazy dog; again", "x" * 40,
           "Once upon"]
JOBS = [(i, i % 2 == 0, 0.0 if i < 3 else 0.7, 11 + i) for i in range(len(PROMPTS))] + [(1, True, 1.0, 4)]
CONFIG = dict(tree="chain:4", num_blocks=96, max_batch_size=3)  # requests queue behind the batch cap


@pytest.fixture(scope="module")
def target_dir(tiny_dirs, tmp_path_factory):
    return str(with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("tp_serve") / "llama"))


@pytest.mark.parametrize("which", ["ngram", "draft"])
def test_tp2_server_streams_equal_one_engine(target_dir, tiny_dirs, which):
    draft = "ngram" if which == "ngram" else str(tiny_dirs["llama_draft"])
    one = SpecEngine(draft, target_dir, SpecConfig(**CONFIG))
    want = [one.generate(PROMPTS[i], SamplingParams(max_new_tokens=16, temperature=t, seed=s if t else None))[0].text
            for i, _, t, s in JOBS]
    (texts, sent, free0), (received, free1) = run_ranks(
        serve_rank, 2, target_dir, draft, SpecConfig(**CONFIG, tensor_parallel_size=2), JOBS, PROMPTS, 0.4,
        timeout=180)
    assert texts == [*want, want[0]] and all(want)
    assert received == sent and sent > len(JOBS) + 3  # adds, steps, heartbeats and the stop, all applied
    assert free0 and free1
