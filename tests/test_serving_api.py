"""The OpenAI-compatible server, run for real (uvicorn on a free port) and spoken to with the `openai`
client: completions (one prompt or several) and chat, streaming and not, stop strings, seeded sampling, 400s
naming the field, disconnects that free every KV block, /metrics."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from serving_helpers import stream_completion, with_tokenizer

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.serving.executor import Executor
from specdec.serving.server import ServerThread, build_app

pytestmark = pytest.mark.usefixtures("single_thread")
MODEL = "tiny"
PROMPTS = ["Hello there, tell me a story.", "abc", "The quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture(scope="module")
def target_dir(tiny_dirs, tmp_path_factory):
    return with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("served") / "llama")


@pytest.fixture(scope="module")
def server(target_dir, tiny_draft):
    """(url, executor) of a speculative server (tiny draft model, chain:4) on a free port."""
    engine = SpecEngine(tiny_draft, str(target_dir), SpecConfig(tree="chain:4", num_blocks=256))
    executor = Executor(engine)
    srv = ServerThread(build_app(executor, MODEL)).start()
    yield srv.url, executor
    srv.stop()
    executor.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(target_dir):
    """Target-only greedy text of each prompt, run alone in a plain engine (24 tokens)."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    return [engine.generate(p, SamplingParams(max_new_tokens=24))[0].text for p in PROMPTS]


def _idle_and_free(executor: Executor, timeout: float = 20.0) -> bool:
    """Wait until the engine has no work, then report whether every KV block is free."""
    deadline = time.monotonic() + timeout
    while executor.run_on_loop(lambda e: e.scheduler.has_work):
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    return executor.run_on_loop(lambda e: e.all_blocks_free())


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_completion_greedy_equals_engine(client, server, reference, i):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0)
    assert r.choices[0].text == reference[i]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(PROMPTS[i].encode())  # byte tokenizer: one token per byte
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.model_extra["mean_accepted_length"] >= 1.0
    assert _idle_and_free(server[1])


def test_completion_stream_equals_non_stream(client, reference):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[0]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it really streamed


def test_chat_stream_and_not(client, target_dir):
    messages = [{"role": "user", "content": "Name three rivers."}]
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    ref = engine.generate([messages], SamplingParams(max_new_tokens=20))[0].text
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_content_as_text_parts_is_its_text_joined_by_newlines(client, target_dir):
    """OpenAI's content parts (what many clients send for text too): the reply is the one to the parts' texts joined
    with newlines, as vLLM joins them."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    ref = engine.generate([[{"role": "user", "content": "Name three\nrivers."}]], SamplingParams(max_new_tokens=12))
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "rivers."}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == ref[0].text and ref[0].text


def _stop_string(text: str) -> tuple[str, int]:
    """A 2-character stop string first occurring a few characters in, and where it occurs."""
    for k in range(3, len(text) - 2):
        s = text[k:k + 2]
        if "\ufffd" not in s and text.find(s) == k:
            return s, k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, reference, stream):
    stop, at = _stop_string(reference[0])
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == reference[0][:at] and reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=1.0, top_p=0.95, extra_body={"top_k": 50})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != c


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=5)])
def test_presence_and_frequency_penalties_equal_the_python_api(client, server, target_dir, sampling):
    """The two OpenAI fields reach SamplingParams: a completion (greedy, or seeded sampled) equals target-only
    decoding of the same params through the Python API, and differs from the unpenalized one; chat takes them
    too."""
    penalties = dict(presence_penalty=-2.0, frequency_penalty=-1.0)  # repeats are likely, greedy or sampled
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, **sampling, **penalties)
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    want, plain = engine.generate([PROMPTS[2]] * 2, [SamplingParams(max_tokens=16, **sampling, **penalties),
                                                     SamplingParams(max_tokens=16, **sampling)])
    assert r.choices[0].text == want.text != plain.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          **sampling, **penalties)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert _idle_and_free(server[1])


def test_logits_processors_equal_the_python_api(client, server, target_dir):
    """``logit_bias`` (OpenAI's, string keys) and vLLM's ``min_tokens``, ``allowed_token_ids`` and ``bad_words``
    (the openai client's ``extra_body``) reach SamplingParams: a greedy completion equals target-only decoding of the
    same params through the Python API, and differs from the plain one."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    tok = engine.target.tokenizer
    plain = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0]
    first = plain.token_ids[0]
    fields = dict(logit_bias={first: -100.0}, min_tokens=4, allowed_token_ids=list(range(0, 200)) + [first],
                  bad_words=[tok.decode([plain.token_ids[2]]).strip() or "x"])
    want = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, **fields))[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  logit_bias={str(first): -100},
                                  extra_body={k: v for k, v in fields.items() if k != "logit_bias"})
    assert r.choices[0].text == want.text != plain.text
    assert want.token_ids[0] != first and all(t < 200 for t in want.token_ids)
    assert _idle_and_free(server[1])


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_equal_the_python_api(client, server, target_dir, stream):
    """Completions' ``logprobs`` (OpenAI's legacy shape) and chat's ``logprobs``/``top_logprobs``: each token's
    log-probability, text and top tokens equal the Python API's for the same params, streamed or not."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    want = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    chosen = [e[t] for e, t in zip(want.logprobs, want.token_ids)]
    kw = dict(model=MODEL, max_tokens=8, temperature=0, stream=stream)
    r = client.completions.create(prompt=PROMPTS[0], logprobs=3, **kw)
    if stream:
        parts = [c.choices[0].logprobs for c in r if c.choices and c.choices[0].logprobs]
        lp = {k: sum((getattr(p, k) for p in parts), []) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}
    else:
        lp = {k: getattr(r.choices[0].logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs",
                                                               "text_offset")}
    assert lp["tokens"] == [c.decoded_token for c in chosen]
    assert lp["token_logprobs"] == pytest.approx([c.logprob for c in chosen], abs=1e-5)
    assert [set(d) for d in lp["top_logprobs"]] == [{v.decoded_token for v in e.values()} for e in want.logprobs]
    assert lp["text_offset"] == [sum(len(c.decoded_token) for c in chosen[:j]) for j in range(len(chosen))]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = engine.generate([messages], SamplingParams(max_tokens=8, temperature=0, logprobs=2))[0]
    r = client.chat.completions.create(messages=messages, logprobs=True, top_logprobs=2, **kw)
    content = (sum((c.choices[0].logprobs.content for c in r if c.choices and c.choices[0].logprobs), [])
               if stream else r.choices[0].logprobs.content)
    assert [c.token for c in content] == [e[t].decoded_token for e, t in zip(want.logprobs, want.token_ids)]
    assert [c.logprob for c in content] == pytest.approx([e[t].logprob for e, t in zip(want.logprobs,
                                                                                       want.token_ids)], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               and ("\ufffd" in c.token or bytes(c.bytes).decode() == c.token) for c in content)
    plain = client.chat.completions.create(messages=messages, **kw)
    if not stream:
        assert plain.choices[0].logprobs is None
    assert _idle_and_free(server[1])


def test_n_returns_n_choices(client, server):
    """n = 3 seeded samples: three choices (indexes 0..2), distinct at T = 1, the same again for the same seed,
    usage counting every choice's tokens; chat too; every block free afterwards."""
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=3, seed=4,
              extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "ignore_eos": True})
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in r.choices]
    assert r.usage.completion_tokens == 3 * 12 and {c.finish_reason for c in r.choices} == {"length"}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == \
        chat.choices[1].message.content  # greedy: identical copies
    assert _idle_and_free(server[1])


@pytest.mark.parametrize("chat", [False, True])
def test_n_streams_n_choices(client, server, chat):
    """Streamed, each choice's chunks carry its index; joined, they are the non-streamed choices of the same seed;
    the usage chunk counts every choice."""
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, n=2, seed=9, extra_body={"ignore_eos": True})
    if chat:
        create, kw["messages"] = client.chat.completions.create, [{"role": "user", "content": "hi"}]
    else:
        create, kw["prompt"] = client.completions.create, PROMPTS[0]
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, reasons = ["", ""], [None, None]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    whole = create(**kw).choices
    assert texts == [c.message.content if chat else c.text for c in whole] and reasons == ["length"] * 2
    assert chunks[-1].usage.completion_tokens == 2 * 10
    assert _idle_and_free(server[1])


@pytest.mark.parametrize("as_ids", [False, True])
def test_several_prompts_equal_one_request_each(client, server, reference, as_ids):
    """A list of prompts (strings or token-id lists, as lm-eval sends them) runs every prompt: choice i is prompt i's
    greedy text alone, and usage counts every prompt's tokens and every choice's."""
    prompts = [list(p.encode()) for p in PROMPTS[:2]] if as_ids else PROMPTS[:2]  # byte tokenizer: id = byte
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == reference[:2]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).usage for p in prompts]
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in alone) == sum(len(p.encode()) for p in PROMPTS[:2])
    assert r.usage.completion_tokens == sum(u.completion_tokens for u in alone)
    assert _idle_and_free(server[1])


def test_several_prompts_with_n_and_seed_equal_single_requests(client, server):
    """n = 2 seeded samples of two prompts: four choices, index = prompt * n + sample, each the same as that
    sample of the prompt sent alone with the same seed."""
    kw = dict(model=MODEL, max_tokens=10, temperature=1.0, n=2, seed=11, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=PROMPTS[:2], **kw)
    alone = [c.text for p in PROMPTS[:2] for c in client.completions.create(prompt=p, **kw).choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == alone and len(set(alone)) == 4
    assert r.usage.completion_tokens == 4 * 10
    assert _idle_and_free(server[1])


def test_several_prompts_stream(server, reference):
    """Streamed, every chunk carries its choice's index; joined per index they are the prompts' greedy texts; one
    [DONE] ends the stream, after a usage chunk over both prompts."""
    body = {"prompt": PROMPTS[:2], "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=60) as http:
        lines = [ln for ln in http.post(f"{server[0]}/v1/completions", json=body).text.splitlines() if ln]
        whole = http.post(f"{server[0]}/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 24,
                                                                "temperature": 0}).json()["usage"]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    texts, reasons = ["", ""], [None, None]
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == reference[:2] and None not in reasons
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["prompt_tokens"] == sum(len(p.encode()) for p in PROMPTS[:2])
    assert (usage["completion_tokens"], usage["total_tokens"]) == (whole["completion_tokens"], whole["total_tokens"])
    assert _idle_and_free(server[1])


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=["hi", 5]), "prompt[1]"),  # mixed: prompts and a bare token id
    (dict(prompt=[5, "hi"]), "prompt[0]"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["hi", ""]), "prompt[1]"),
    (dict(prompt=[[5, 6], []]), "prompt[1]"),
    (dict(prompt=[[5, 6], [5, "x"]]), "prompt[1]"),
    (dict(prompt=["hi"] * 257), "prompt"),  # over MAX_PROMPTS
    (dict(prompt=["hi"] * 16, n=65), "n"),  # 1,040 choices: over MAX_CHOICES
    (dict(prompt=["hi", [5] * 600]), "prompt[1]"),  # refused by the engine: longer than the model holds
    (dict(prompt=["hi", 5], stream=True), "prompt[1]"),
])
def test_bad_prompt_list_is_400_naming_the_prompt(client, server, kwargs, field):
    kw = {"model": MODEL, "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        r = client.completions.create(**kw)
        list(r) if kw.get("stream") else None
    assert err.value.status_code == 400
    assert field in str(err.value) and err.value.body["param"] == field
    assert _idle_and_free(server[1])


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(n=0), "n"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(logprobs=30), "logprobs"),
    (dict(prompt=""), "prompt"),
    (dict(stop=[""]), "stop"),
    (dict(seed=-3), "seed"),
    (dict(extra_body={"top_k": "ten"}), "top_k"),
    (dict(extra_body={"bogus": 1}), "bogus"),
    (dict(stream=True, temperature=-0.5), "temperature"),
])
def test_bad_completion_request_is_400_naming_the_field(client, kwargs, field):
    kw = {"model": MODEL, "prompt": "hi", "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        r = client.completions.create(**kw)
        list(r) if kw.get("stream") else None
    assert err.value.status_code == 400
    assert field in str(err.value) and err.value.body["param"] == field


@pytest.mark.parametrize("messages, kwargs, field", [
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     {}, "messages[0].content[1]"),
    ([{"role": "user", "content": [{"type": "text"}]}], {}, "messages[0].content[0]"),
    ([{"role": "user", "content": []}], {}, "messages[0].content"),
    ([{"role": "user", "content": None}], {}, "messages[0]"),
    ([], {}, "messages"),
    ([{"role": "user", "content": "hi"}], dict(n=0), "n"),
    ([{"role": "user", "content": "hi"}], dict(presence_penalty=2.5), "presence_penalty"),
    ([{"role": "user", "content": "hi"}], dict(frequency_penalty="high"), "frequency_penalty"),
])
def test_bad_chat_request_is_400_naming_the_field(client, messages, kwargs, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **kwargs)
    assert err.value.status_code == 400 and field in str(err.value)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_disconnect_mid_stream_frees_every_block(server):
    url, executor = server
    with httpx.Client(timeout=30) as http:
        res = stream_completion(http, url, {"prompt": PROMPTS[2], "max_tokens": 300, "ignore_eos": True,
                                            "temperature": 0}, disconnect_after=3)
    assert res.disconnected and res.finish_reason is None
    assert _idle_and_free(executor)
    # a non-streaming client that gives up (read timeout) is cancelled too
    with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{url}/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 300, "ignore_eos": True})
    assert _idle_and_free(executor)
    metrics = httpx.get(f"{url}/metrics").text
    assert 'specdec_requests_finished_total{finish_reason="abort"} 2.0' in metrics
    assert "specdec_running_requests 0.0" in metrics and "specdec_kv_blocks_used 0.0" in metrics


@pytest.mark.parametrize("prompt, n", [(PROMPTS[2], 3), ([PROMPTS[2], PROMPTS[0]], 2)])
@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_frees_every_request(server, stream, prompt, n):
    """A client that goes away while its requests run (n = 3 samples of a prompt; n = 2 of each of two prompts)
    cancels all of them."""
    url, executor = server
    body = {"prompt": prompt, "max_tokens": 300, "ignore_eos": True, "temperature": 1.0, "n": n}
    if stream:
        with httpx.Client(timeout=30) as http:
            assert stream_completion(http, url, body, disconnect_after=3).disconnected
    else:
        with httpx.Client(timeout=httpx.Timeout(30, read=0.3)) as http, pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json=body)
    assert _idle_and_free(executor)


def test_models_health_and_metrics(client, server):
    url = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["specdec_kv_blocks_total"] == 256
    assert values["specdec_time_to_first_token_seconds_count"] >= 1
    assert values["specdec_time_per_output_token_seconds_count"] >= 1
    assert values["specdec_generation_tokens_total"] >= 8
    assert values["specdec_draft_tokens_total"] > 0
    assert 0 <= values["specdec_acceptance_rate"] <= 1
    assert values["specdec_tokens_per_second"] > 0
    assert values["specdec_queue_length"] == 0 and values["specdec_running_requests"] == 0


@pytest.mark.slow
def test_smollm2_chat_over_http_equals_target_only(smollm2, smollm2_target_only, smollm2_new_tokens):
    """The real SmolLM2 behind the server (n-gram speculation): chat answers, streamed and not, equal
    the engine's target-only greedy outputs of the same chat prompts."""
    from conftest import CHAT_QUESTIONS

    executor = Executor(SpecEngine("ngram", smollm2, SpecConfig(tree="chain:4", num_blocks=256)))
    srv = ServerThread(build_app(executor, "smollm2-135m")).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for i in (3,):  # one short answer keeps CI time down
            kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": CHAT_QUESTIONS[i]}],
                      max_tokens=smollm2_new_tokens, temperature=0)
            r = client.chat.completions.create(**kw)
            chunks = client.chat.completions.create(stream=True, **kw)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert r.choices[0].message.content == streamed == smollm2_target_only[i].text
            assert r.usage.completion_tokens == len(smollm2_target_only[i].token_ids)
        assert _idle_and_free(executor)
    finally:
        srv.stop()
        executor.shutdown()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_the_server(server, tmp_path, endpoint):
    import json

    from specdec.serving.bench_client import BenchServeConfig, run_bench

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    rep = run_bench(BenchServeConfig(url=server[0], dataset=str(path), num_prompts=6, request_rate=50.0,
                                     concurrency=3, max_tokens=8, endpoint=endpoint, ignore_eos=True))
    assert rep["completed"] == 6 and rep["failed"] == 0 and rep["model"] == MODEL
    assert rep["mean_output_tokens"] == 8  # ignore_eos: exactly max_tokens, counted by the server's usage
    for key in ("ttft", "tpot", "e2e_latency"):
        assert 0 < rep[key]["p50_ms"] <= rep[key]["p99_ms"]
    assert rep["ttft"]["p50_ms"] <= rep["e2e_latency"]["p50_ms"]
    assert rep["mean_accepted_length"] >= 1.0


def test_poisson_arrivals():
    from specdec.serving.bench_client import arrival_times

    times = arrival_times(4000, rate=8.0, seed=3)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times == sorted(times) and times[0] == 0.0
    assert abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01  # exponential gaps with mean 1/rate
    assert arrival_times(5, float("inf"), 0) == [0.0] * 5


def test_cli_registers_serve_and_bench_serve():
    from specdec.cli.main import build_parser

    a = build_parser().parse_args(["serve", "--target", "t", "--draft", "none", "--port", "9", "--host", "0.0.0.0"])
    assert (a.model, a.draft, a.port, a.host) == ("t", "none", 9, "0.0.0.0")
    b = build_parser().parse_args(["bench-serve", "--url", "http://x:1", "--request-rate", "4", "--concurrency", "8"])
    assert (b.url, b.request_rate, b.concurrency) == ("http://x:1", 4.0, 8)


def test_models_retrieve(client):
    """GET /v1/models/{model} was a 404 ({"detail": ...}) for the served model too."""
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert "'gpt-4' is not served here" in str(err.value)


def test_tokenize_gives_the_ids_a_request_runs(client, server):
    """vLLM's /tokenize: a prompt's or a chat's ids as the engine runs them (a chat completion's usage counts as
    many), their count and the model's length; /detokenize gives their text back."""
    url, executor = server
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]
    for body, prompt in (({"prompt": PROMPTS[2]}, PROMPTS[2]), ({"messages": chat, "model": MODEL}, chat)):
        r = httpx.post(f"{url}/tokenize", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["tokens"] == executor.prepare(prompt) and got["count"] == len(got["tokens"])
        assert got["max_model_len"] == executor.engine.target.config.max_position_embeddings
        text = httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
        assert all(part in text for part in ([PROMPTS[2]] if "prompt" in body else [m["content"] for m in chat]))
    used = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2).usage.prompt_tokens
    assert used == httpx.post(f"{url}/tokenize", json={"messages": chat}).json()["count"]


@pytest.mark.parametrize("path,body,field,status", [
    ("tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None, 400),
    ("tokenize", {}, None, 400),
    ("tokenize", {"prompt": 5}, "prompt", 400),
    ("tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens", 400),
    ("tokenize", {"messages": [{"role": "tool", "content": "a"}]}, "messages[0].role", 400),
    ("tokenize", {"prompt": "a", "model": "gpt-4"}, "model", 404),
    ("tokenize", {"prompt": "a" * 5000}, "prompt", 400),  # (longer than the tiny model holds)
    ("detokenize", {"tokens": "abc"}, "tokens", 400),
    ("detokenize", {"tokens": [1, True]}, "tokens", 400),
    ("detokenize", {"tokens": [1, -1]}, "tokens[1]", 400),
    ("detokenize", {"tokens": [10 ** 9]}, "tokens[0]", 400),
    ("detokenize", {"tokens": [1], "extra": 1}, "extra", 400),
])
def test_tokenize_and_detokenize_refuse_bad_bodies(server, path, body, field, status):
    r = httpx.post(f"{server[0]}/{path}", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == field, r.text


def test_version(server):
    import specdec

    assert httpx.get(f"{server[0]}/version").json() == {"version": specdec.__version__}


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_the_prompt(client, server, target_dir, stream):
    """Completions' ``echo`` with ``logprobs``: the choice's text is the prompt's and the output's, its legacy
    log-probabilities the prompt's tokens (the first with none) then the output's, equal to the Python API's
    ``prompt_logprobs`` and ``logprobs``; ``max_tokens: 0`` scores the prompt alone (OpenAI's way), streamed or not."""
    engine = SpecEngine(None, str(target_dir), SpecConfig(num_blocks=64))
    want = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, temperature=0, logprobs=1,
                                                        prompt_logprobs=1))[0]
    prompt_lps = [e[t].logprob for e, t in zip(want.prompt_logprobs[1:], want.prompt_token_ids[1:])]
    out_lps = [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)]

    def run(max_tokens: int):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0, echo=True,
                                      logprobs=1, stream=stream)
        if not stream:
            assert r.usage.completion_tokens == max_tokens  # (a prompt only scored counts no output)
            return r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.tokens
        text, lps, toks = "", [], []
        for c in r:
            if c.choices:
                text += c.choices[0].text
                if c.choices[0].logprobs:
                    lps += c.choices[0].logprobs.token_logprobs
                    toks += c.choices[0].logprobs.tokens
        return text, lps, toks

    text, lps, toks = run(3)
    assert text == PROMPTS[0] + want.text and lps[0] is None and len(toks) == len(lps)
    assert lps[1:] == pytest.approx(prompt_lps + out_lps, abs=1e-5)
    assert "".join(toks) == engine.detokenize(want.prompt_token_ids + want.token_ids)
    text, lps, _ = run(0)
    assert text == PROMPTS[0] and lps[0] is None and lps[1:] == pytest.approx(prompt_lps, abs=1e-5)
    assert _idle_and_free(server[1])
