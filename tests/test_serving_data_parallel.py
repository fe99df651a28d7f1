"""Data-parallel replicas behind the real server (docs/parallel.md): two engine processes, the openai client. Every
stream (streamed and not, greedy and seeded sampled) equals the same request run alone in one engine, both
replicas serve, and once drained no replica holds a KV block. The router's choices are checked on their own."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from serving_helpers import with_tokenizer

from specdec.engine import SpecConfig, SpecEngine
from specdec.outputs import RequestOutput
from specdec.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from specdec.serving.data_parallel import DataParallelExecutor, Router, held_blocks
from specdec.serving.replica_process import EngineRecipe, ReplicaValueError, portable, start_replicas
from specdec.serving.server import ServerThread, build_app

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "tiny"
CONFIG = SpecConfig(tree="chain:4", num_blocks=96, max_batch_size=4)  # requests queue behind the batch cap
SHARED = "The quick brown fox jumps over the lazy dog; "  # longer than one block: routed with affinity
PROMPTS = ["Hello there, tell me a story.", "abc", SHARED + "again", SHARED + "and then", "x" * 40, "Once upon"]
# (prompt index, stream, temperature, seed): greedy and seeded sampled rows, streamed and not
JOBS = [(i, i % 2 == 0, 0.0 if i < 3 else 0.7, 11 + i) for i in range(len(PROMPTS))] + [
    (0, False, 0.7, 5), (2, True, 0.0, 0), (3, False, 1.0, 7), (5, True, 0.7, 9)]


@pytest.fixture(scope="module")
def target_dir(tiny_dirs, tmp_path_factory):
    return with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("dp") / "llama")


@pytest.fixture(scope="module")
def dp_server(target_dir, tiny_dirs):
    """(url, executor) of a server over 2 replica processes (tiny draft model, chain:4), one torch thread each."""
    recipe = EngineRecipe(str(tiny_dirs["llama_draft"]), str(target_dir), CONFIG, threads=1)
    replicas = start_replicas([recipe, recipe], context="forkserver")
    executor = DataParallelExecutor(replicas, block_size=replicas[0].info.block_size)
    srv = ServerThread(build_app(executor, MODEL)).start()
    yield srv.url, executor
    srv.stop()
    executor.shutdown()


def _params(temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=temperature, seed=seed if temperature else None)


def _ask(client: openai.OpenAI, job: tuple) -> str:
    i, stream, temperature, seed = job
    kw = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=temperature, seed=seed)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)


def test_dp2_streams_equal_one_replica_and_free_every_block(dp_server, target_dir, tiny_draft):
    url, executor = dp_server
    engine = SpecEngine(tiny_draft, str(target_dir), CONFIG)  # one replica, each request alone
    want = [engine.generate(PROMPTS[i], _params(t, s))[0].text for i, _, t, s in JOBS]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with ThreadPoolExecutor(len(JOBS)) as pool:  # all at once: both replicas batch and queue
        got = list(pool.map(lambda job: _ask(client, job), JOBS))
    assert got == want
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    assert all(r["routed"] > 0 and r["outstanding_requests"] == 0 for r in health["replicas"]), health
    assert sum(r["routed"] for r in health["replicas"]) == len(JOBS)
    routed = [r["routed"] for r in health["replicas"]]
    n3 = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0.7, seed=3, n=3)
    alone = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=16, temperature=0.7, seed=3, n=3))[0]
    assert [c.text for c in n3.choices] == [c.text for c in alone.outputs]
    after = [r["routed"] for r in httpx.get(f"{url}/health").json()["replicas"]]
    assert sorted(a - b for a, b in zip(after, routed)) == [0, 3]  # the samples share one replica (and its KV)
    assert executor.run_on_replicas(held_blocks) == [0, 0]
    assert executor.run_on_replicas(SpecEngine.all_blocks_free) == [True, True]


def test_dp2_log_probabilities_equal_one_engine(dp_server, target_dir, tiny_draft):
    """Streamed through a replica process (whose outputs after the first come as deltas): echo with logprobs gives
    the prompt's and the output's log-probabilities of one engine alone, once each."""
    url, _ = dp_server
    engine = SpecEngine(tiny_draft, str(target_dir), CONFIG)
    want = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=12, logprobs=2, prompt_logprobs=2))[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    lps = []
    for c in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0, echo=True,
                                       logprobs=2, stream=True):
        lps += c.choices[0].logprobs.token_logprobs if c.choices and c.choices[0].logprobs else []
    entries = [*want.prompt_logprobs[1:], *want.logprobs]
    chosen = [*want.prompt_token_ids[1:], *want.token_ids]
    assert lps[0] is None and lps[1:] == pytest.approx([e[t].logprob for e, t in zip(entries, chosen)], abs=1e-5)


def test_dp2_replicas_of_tp2_groups_equal_one_engine(target_dir, tiny_dirs, tiny_draft):
    """Two replicas, each a tensor-parallel group of 2 ranks (gloo; rank 0 of each talks to the server and sends
    its operations to rank 1): every stream, greedy and seeded sampled, equals the same request alone in one
    unsplit engine, both replicas serve, and once drained no replica's pool has a block in use (no prefix cache:
    ``/health``'s count is then what requests hold; ``run_on_loop`` is refused on a tensor-parallel rank 0)."""
    cfg = SpecConfig(tree="chain:4", num_blocks=96, max_batch_size=4, tensor_parallel_size=2, prefix_cache=False)
    recipe = EngineRecipe(str(tiny_dirs["llama_draft"]), str(target_dir), cfg, threads=1)
    replicas = start_replicas([recipe, recipe], context="forkserver")
    executor = DataParallelExecutor(replicas, block_size=replicas[0].info.block_size)
    srv = ServerThread(build_app(executor, MODEL)).start()
    try:
        engine = SpecEngine(tiny_draft, str(target_dir), CONFIG)
        jobs = JOBS[:6]
        want = [engine.generate(PROMPTS[i], _params(t, s))[0].text for i, _, t, s in jobs]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: _ask(client, job), jobs))
        assert got == want
        for _ in range(50):  # (a replica's load comes with its step statistics, just after its last step)
            health = httpx.get(f"{srv.url}/health").json()["replicas"]
            if all(r["kv_blocks_used"] == 0 for r in health):
                break
            time.sleep(0.1)
        assert all(r["routed"] > 0 and r["kv_blocks_used"] == 0 for r in health), health
    finally:
        srv.stop()
        executor.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_dp2_replicas_on_two_gpus_equal_one(target_dir, tiny_dirs, tiny_draft):
    """Two replicas on cuda:0 and cuda:1 (float32, the CUDA defaults: graphs captured at start, pipelined steps)
    behind the server: every stream equals the same request alone in one engine on cuda:0, both replicas serve,
    and once drained neither holds a block."""
    cfg = {"tree": "chain:4", "num_blocks": 96, "max_batch_size": 4, "dtype": "float32"}
    recipes = [EngineRecipe(str(tiny_dirs["llama_draft"]), str(target_dir), SpecConfig(device=f"cuda:{i}", **cfg))
               for i in range(2)]
    replicas = start_replicas(recipes, context="spawn")
    executor = DataParallelExecutor(replicas, block_size=replicas[0].info.block_size)
    srv = ServerThread(build_app(executor, MODEL)).start()
    try:
        assert [r.info.device for r in replicas] == ["cuda:0", "cuda:1"]
        engine = SpecEngine(str(tiny_dirs["llama_draft"]), str(target_dir), SpecConfig(device="cuda:0", **cfg))
        want = [engine.generate(PROMPTS[i], _params(t, s))[0].text for i, _, t, s in JOBS]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        with ThreadPoolExecutor(len(JOBS)) as pool:
            got = list(pool.map(lambda job: _ask(client, job), JOBS))
        assert got == want
        assert all(r["routed"] > 0 for r in httpx.get(f"{srv.url}/health").json()["replicas"])
        assert executor.run_on_replicas(held_blocks) == [0, 0]
    finally:
        srv.stop()
        executor.shutdown()


def test_dp_refusal_names_the_field(dp_server):
    """A request a replica refuses comes back as the same 400 a single engine gives (its FieldError crossed)."""
    client = openai.OpenAI(base_url=dp_server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    err = portable(ValueError("plain"))
    assert type(err) is ValueError
    from specdec.errors import FieldError

    crossed = portable(FieldError("SamplingParams", "top_p", "must be in (0, 1]", 2))
    assert isinstance(crossed, ReplicaValueError) and crossed.field == "top_p" and "top_p" in str(crossed)


def test_dp_tokenize_and_detokenize_cross_to_the_replicas(dp_server, target_dir):
    """/tokenize and /detokenize run on a replica (in turn) and answer what one engine answers; a refusal crosses
    naming its token."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=16))
    for _ in range(2):  # (both replicas)
        got = httpx.post(f"{dp_server[0]}/tokenize", json={"prompt": PROMPTS[0]}).json()
        assert got["tokens"] == engine.prepare(PROMPTS[0], SamplingParams(max_new_tokens=1))
        assert got["max_model_len"] == engine.target.config.max_position_embeddings
        text = httpx.post(f"{dp_server[0]}/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
        assert text == engine.detokenize(got["tokens"])
    bad = httpx.post(f"{dp_server[0]}/detokenize", json={"tokens": [1, -5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]", bad.text


def test_router_balances_and_keeps_prefix_affinity():
    router = Router(2, block_size=4, affinity_slack=8)
    shared = [1, 2, 3, 4]
    a = router.route(shared + [9], 10, [True, True])
    b = router.route([5, 6, 7, 8, 9], 10, [True, True])  # a new prefix: the idle replica
    assert (a.replica, b.replica) == (0, 1)
    assert router.route(shared + [7], 10, [True, True]).replica == 0  # its home, as busy as replica 1
    far = router.route(shared + [8], 10, [True, True])  # now 30 tokens busier than replica 1: balance wins
    assert far.replica == 1 and router.route(shared, 2, [True, True]).replica == 1  # the prefix moved with it
    assert router.route([1, 2], 1, [True, True]).replica == 0  # shorter than a block: least loaded
    assert router.route([5, 6, 7, 8], 1, [False, True]).replica == 1  # a stopped replica is skipped
    assert router.route([5, 6, 7, 8], 99, [True, True], beside=a).replica == 0  # another sample of a's prompt
    before = list(router.tokens)
    router.progress(b, RequestOutput("b", [5, 6, 7, 8, 9], [3, 3], "", None, None))  # prefilled, 2 generated
    assert router.tokens[1] == before[1] - 5 - 2
    router.finish(b)
    router.finish(b)  # once only
    assert router.tokens[1] == before[1] - 15 and router.requests[1] == 3


def test_router_counts_an_unbounded_request_as_a_default_reply():
    router = Router(2, block_size=4)
    open_ended = router.route([1, 2, 3], None, [True, True])
    assert router.tokens[open_ended.replica] == 3 + DEFAULT_MAX_NEW_TOKENS
    assert router.route([1, 2, 3], 8, [True, True]).replica != open_ended.replica  # it counts as work
    router.progress(open_ended, RequestOutput("a", [1, 2, 3], [7] * 5, "", None, None))
    assert router.tokens[open_ended.replica] == DEFAULT_MAX_NEW_TOKENS - 5


def test_dp_unset_max_tokens_shrinks_to_the_room_left(dp_server):
    """A request that set no max_tokens and whose prompt leaves less room than the default 16 gets the room left
    (512 positions less the prompt and the 4-token lookahead), as with one engine, not a 400 naming max_tokens."""
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{dp_server[0]}/v1/completions", json={"model": MODEL, "prompt": [5] * 500, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 512 - 4 - 500
