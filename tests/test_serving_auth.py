"""``specdec serve --api-key``: every request carries the key (401 in OpenAI's shape without it), while /health,
/metrics and /version stay open to probes and scrapers."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving_helpers import with_tokenizer

from specdec.engine import SpecConfig, SpecEngine
from specdec.serving.executor import Executor
from specdec.serving.server import ServerThread, build_app

pytestmark = pytest.mark.usefixtures("single_thread")
KEY = "sk-test-0123"


@pytest.fixture(scope="module")
def keyed_server(tiny_dirs, tmp_path_factory):
    target = with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("served") / "llama")
    executor = Executor(SpecEngine(None, str(target), SpecConfig(num_blocks=64)))
    srv = ServerThread(build_app(executor, "tiny", api_key=KEY)).start()
    yield srv.url
    srv.stop()
    executor.shutdown()


@pytest.mark.parametrize("key", ["wrong", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_401(keyed_server, key):
    client = openai.OpenAI(base_url=keyed_server + "/v1", api_key=key, max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_no_key_is_401_and_probes_stay_open(keyed_server):
    answer = httpx.post(f"{keyed_server}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == 401
    assert httpx.get(f"{keyed_server}/health").status_code == 200
    assert httpx.get(f"{keyed_server}/metrics").status_code == 200
    assert httpx.get(f"{keyed_server}/version").status_code == 200
    for path, body in (("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": [1]})):  # (vLLM leaves them open)
        assert httpx.post(f"{keyed_server}/{path}", json=body).status_code == 401
        keyed = httpx.post(f"{keyed_server}/{path}", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200, keyed.text


def test_the_key_serves(keyed_server):
    client = openai.OpenAI(base_url=keyed_server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_serve_takes_its_key_from_the_flag_or_the_environment(monkeypatch):
    from specdec.cli.main import build_parser

    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("SPECDEC_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
    with pytest.raises(ValueError, match="api_key"):
        build_app(None, "tiny", api_key="")


def test_bench_serve_sends_the_key(keyed_server, tmp_path, monkeypatch):
    """bench-serve against a keyed server: with the key every request completes; without it, or with another, the
    server check names --api-key; the flag's default is $OPENAI_API_KEY (as vLLM's benchmark reads it)."""
    import json

    from specdec.cli.checks import UsageError
    from specdec.cli.main import build_parser
    from specdec.serving.bench_client import BenchServeConfig, run_bench
    from specdec.serving.cli import check_server

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(["hi", "abc", "xyz"])))
    rep = run_bench(BenchServeConfig(url=keyed_server, dataset=str(path), num_prompts=3, concurrency=2, max_tokens=4,
                                     endpoint="completions", ignore_eos=True, api_key=KEY))
    assert rep["completed"] == 3 and rep["failed"] == 0
    check_server("--base-url", keyed_server, api_key=KEY)
    for key in (None, "other"):
        with pytest.raises(UsageError) as err:
            check_server("--base-url", keyed_server, api_key=key)
        assert err.value.flag == "--api-key", err.value
    monkeypatch.setenv("OPENAI_API_KEY", "env-key")
    assert build_parser().parse_args(["bench-serve"]).api_key == "env-key"
