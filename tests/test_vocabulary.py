"""One vocabulary across the Python API, the CLI and the server, with vLLM's names where users bring them:
``--model`` (alias ``--target``) and a positional ``serve MODEL``, the same defaults in every subcommand and in
``SpecConfig()``, ``SamplingParams(max_tokens=...)``, ``out.outputs[0].text``, the server's field rules equal to
``SamplingParams``', ``gpu_memory_utilization`` as a fraction of the total memory, ``vllm bench serve``'s flags."""

from __future__ import annotations

import pytest
import torch
from cli_helpers import refuse_model_loads, run_cli

from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.cli import main
from specdec.cli.main import build_parser
from specdec.errors import FieldError

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench"], ["serve"], ["distill"]])
def test_model_and_target_name_the_same_option(command):
    dest = "target" if command[0] == "distill" else "model"
    for flag in ("--model", "--target"):
        assert getattr(build_parser().parse_args([*command, flag, "some/dir"]), dest) == "some/dir"


def test_serve_takes_the_model_positionally(capsys, monkeypatch):
    from specdec.serving.cli import serve_model

    assert serve_model(build_parser().parse_args(["serve", "some/dir"])) == "some/dir"
    assert serve_model(build_parser().parse_args(["serve", "--model", "some/dir"])) == "some/dir"
    assert serve_model(build_parser().parse_args(["serve"])) == "smollm2-135m"
    refuse_model_loads(monkeypatch)
    err = run_cli(capsys, ["serve", "a/dir", "--model", "b/dir", "--device", "cpu"])
    assert err.startswith("error: --model: the model is given twice: 'a/dir' (MODEL) and 'b/dir'"), err


class _Built(Exception):
    pass


def _engine_options(monkeypatch, argv) -> dict:
    """The SpecConfig fields and the draft a command would build (stopped before any model loads)."""
    import specdec.cli.checks as checks
    import specdec.defaults as defaults

    seen = {}
    real_build, real_draft = checks.build, defaults.default_draft

    def build(cls, **fields):
        if cls is SpecConfig:
            seen.update(fields)
            raise _Built
        return real_build(cls, **fields)

    def draft(*args, **kwargs):
        seen["draft"] = real_draft(*args, **kwargs)
        return seen["draft"]

    monkeypatch.setattr(checks, "build", build)
    monkeypatch.setattr(defaults, "default_draft", draft)
    with pytest.raises(_Built):
        main(argv)
    return seen


def test_every_subcommand_has_the_same_defaults(monkeypatch):
    """generate, bench and serve pick the same draft, tree, device, dtype and memory share (serve used n-gram
    chain:4 while the others used the shipped draft, and n-gram chain:8)."""
    runs = {name: _engine_options(monkeypatch, argv) for name, argv in
            (("generate", ["generate", "--prompt", "hi"]), ("bench", ["bench"]), ("serve", ["serve"]))}
    keys = ("draft", "tree", "device", "dtype", "gpu_memory_utilization")
    assert len({tuple(run[k] for k in keys) for run in runs.values()}) == 1, runs
    for argv in (["generate", "--prompt", "hi"], ["serve"]):
        assert _engine_options(monkeypatch, [*argv, "--draft", "ngram"])["tree"] == "chain:8"


def test_spec_config_auto_takes_the_same_defaults(tiny_target, monkeypatch):
    from specdec.defaults import default_device, resolve_auto

    cfg = SpecConfig()
    assert (cfg.tree, cfg.device, cfg.dtype) == ("auto", "auto", "auto")
    engine = SpecEngine("ngram", tiny_target, SpecConfig(num_blocks=32))
    assert (engine.config.tree, engine.config.device, engine.config.dtype) == ("chain:8", "cpu", "float32")
    assert SpecEngine(None, tiny_target, SpecConfig(num_blocks=32)).config.tree == "chain:4"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda" and default_device(tiny_target) == "cpu"  # a loaded target stays put
    monkeypatch.setattr("specdec.config_checks.check_device", lambda d: str(d))
    on_gpu = resolve_auto(SpecConfig(), "smollm2-135m-draft", "smollm2-135m")
    assert (on_gpu.device, on_gpu.dtype, on_gpu.tree) == ("cuda", "bfloat16", "dynamic:31")
    explicit = SpecConfig(tree="chain:3", device="cpu", dtype="float32")
    assert resolve_auto(explicit, "ngram", tiny_target) is explicit


def test_max_tokens_is_max_new_tokens(tiny_target):
    from dataclasses import replace

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    assert params == SamplingParams(max_new_tokens=5, ignore_eos=True) and params.max_tokens == 5
    assert replace(params, max_new_tokens=7).max_tokens == 7
    with pytest.raises(FieldError, match="max_tokens.*one of the two"):
        SamplingParams(max_tokens=5, max_new_tokens=6)
    with pytest.raises(FieldError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    out = SpecEngine("ngram", tiny_target, SpecConfig(num_blocks=64)).generate([[5, 6, 7]], params)[0]
    assert len(out.token_ids) == 5
    first = out.outputs[0]  # vLLM's RequestOutput.outputs[0]
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (0, out.text, out.token_ids, "length")


SERVER_BODIES = [{"top_k": -1}, {"top_k": -2}, {"top_k": 2.5}, {"temperature": 3.0}, {"temperature": -0.1},
                 {"top_p": 0.0}, {"seed": 2**64}, {"seed": 2**63}, {"max_tokens": 0}, {"ignore_eos": 1}]


@pytest.mark.parametrize("body", SERVER_BODIES, ids=str)
def test_server_field_rules_equal_sampling_params(body):
    """A body is accepted over HTTP exactly when SamplingParams accepts the same fields (top_k=-1 was
    accepted by the server and refused by SamplingParams)."""
    from specdec.serving.protocol import BadRequest, parse_completion

    try:
        SamplingParams(**{"temperature": 1.0, **body})
        api_ok = True
    except FieldError:
        api_ok = False
    try:
        parsed = parse_completion({"prompt": "hi", **body}, "m")
        http_ok, field = True, None
    except BadRequest as err:
        http_ok, field = False, err.field
    assert http_ok == api_ok, body
    assert http_ok or field == next(iter(body))
    if body == {"top_k": -1}:
        assert parsed.params.top_k == 0  # off, as top_k=0


def test_gpu_memory_utilization_is_a_fraction_of_the_total(capsys, monkeypatch):
    from specdec.memory_budget import kv_budget

    gib = 2**30
    first = kv_budget(0.4, 100 * gib, available=95 * gib, weights=gib)
    assert first == int(0.4 * 100 * gib) - gib
    assert kv_budget(0.4, 100 * gib, available=55 * gib, weights=gib) == first  # a second engine: the same size
    assert kv_budget(0.9, 100 * gib, available=20 * gib, weights=gib) == int(0.9 * 20 * gib)  # never past free
    with pytest.raises(FieldError, match="gpu_memory_utilization.*no GPU memory for the KV pool"):
        kv_budget(0.01, 100 * gib, available=95 * gib, weights=2 * gib)
    with pytest.raises(FieldError, match="gpu_memory_utilization"):
        SpecConfig(gpu_memory_utilization=1.5)
    refuse_model_loads(monkeypatch)
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--gpu-memory-utilization", "0"])
    assert err.startswith("error: --gpu-memory-utilization: "), err


def test_vllm_flag_names():
    serve = build_parser().parse_args(["serve", "--max-num-seqs", "8"])
    assert serve.max_batch_size == 8
    bench = build_parser().parse_args(["bench-serve", "--base-url", "http://x:1", "--max-concurrency", "4",
                                       "--dataset-name", "mtbench", "--dataset-path", "p.jsonl", "--save-result",
                                       "--result-dir", "out", "--result-filename", "r.json", "--max-tokens", "9",
                                       "--endpoint", "/v1/completions", "--model", "m"])
    assert (bench.url, bench.concurrency, bench.dataset, bench.dataset_path, bench.max_new_tokens) == \
        ("http://x:1", 4, "mtbench", "p.jsonl", 9)
    from specdec.serving.cli import result_path

    assert bench.save_result and result_path(bench) == "out/r.json"
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--max-tokens", "3", "--dtype", "auto"])
    assert (generate.max_new_tokens, generate.dtype) == (3, "auto")
