"""``--tensor-parallel-size`` / ``--data-parallel-size`` on the command line (docs/parallel.md): the checks that
name the numbers, ``specdec generate`` run as 2 gloo ranks printing what one process prints, and the launcher
that starts the ranks itself (rank 0's output kept, a failing rank ending the others)."""

from __future__ import annotations

import sys
import time

import pytest
from serving_helpers import with_tokenizer
from tp_helpers import cli_rank, run_ranks

from specdec.cli.main import main
from specdec.cli.parallel import start_ranks


@pytest.fixture(scope="module")
def model_dir(tiny_dirs, tmp_path_factory):
    return str(with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("tp_cli") / "llama"))


def _generate(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "hello world, hello", "--max-new-tokens", "12", "--device",
            "cpu", *extra]


def test_generate_on_two_ranks_prints_what_one_process_prints(model_dir, capsys):
    """A seeded sampled request with n-gram drafts: rank 0 prints one process's text, rank 1 nothing."""
    argv = _generate(model_dir, "--draft", "ngram", "--temperature", "0.7", "--seed", "5")
    assert main(argv) == 0
    want = capsys.readouterr().out
    ranks = run_ranks(cli_rank, 2, [*argv, "--tensor-parallel-size", "2"])
    assert ranks == [(0, want), (0, "")] and want.strip()


@pytest.mark.parametrize("extra, flag, says", [
    (("--tensor-parallel-size", "3"), "--tensor-parallel-size", "num_heads (4)"),
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size", "got 0"),
    (("--data-parallel-size", "2"), "--data-parallel-size", "specdec serve --data-parallel-size 2"),
])
def test_parallel_flags_refused_naming_the_numbers(model_dir, capsys, extra, flag, says):
    assert main(_generate(model_dir, "--draft", "none", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}: ") and says in err, err


def test_serve_checks_the_gpus_replicas_and_ranks_need(monkeypatch):
    import torch

    from specdec.cli import parallel
    from specdec.cli.checks import UsageError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = type("Args", (), {"tensor_parallel_size": 1, "data_parallel_size": 2})()
    with pytest.raises(UsageError, match="2 replicas x 1 GPUs each need 2 GPUs; this machine has 1"):
        parallel.check_parallel(args, "cuda", "serve")
    with pytest.raises(UsageError, match="--device: 'cuda:1' names one GPU"):
        parallel.check_parallel(args, "cuda:1", "serve")
    tp2 = type("Args", (), {"tensor_parallel_size": 2, "data_parallel_size": 1})()  # a rank on each GPU (NCCL)
    with pytest.raises(UsageError, match="1 replicas x 2 GPUs each need 2 GPUs; this machine has 1"):
        parallel.check_parallel(tp2, "cuda", "generate")
    dp2tp2 = type("Args", (), {"tensor_parallel_size": 2, "data_parallel_size": 2})()  # replicas of TP groups
    with pytest.raises(UsageError, match="2 replicas x 2 GPUs each need 4 GPUs; this machine has 1"):
        parallel.check_parallel(dp2tp2, "cuda", "serve")
    parallel.check_parallel(dp2tp2, "cpu", "serve")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parallel.check_parallel(tp2, "cuda", "generate")
    with pytest.raises(UsageError, match="runs on the CPU .gloo. or CUDA"):
        parallel.check_parallel(tp2, "mps", "generate")


def test_launcher_keeps_rank0_output_and_ends_the_group_on_a_failure(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # (a fresh interpreter never starts in the checkout: its kernels/ shadows PyPI's)
    say = "import os; e = os.environ; print('rank', e['RANK'], 'of', e['WORLD_SIZE'], e['MASTER_PORT'] > '0')"
    assert start_ranks([sys.executable, "-c", say], 2) == 0
    assert capfd.readouterr().out == "rank 0 of 2 True\n"
    fail = ("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit('rank 1 broke')\ntime.sleep(60)")
    t0 = time.monotonic()
    assert start_ranks([sys.executable, "-c", fail], 2) == 1
    assert time.monotonic() - t0 < 30  # rank 0 was ended, not waited for
    assert "[rank 1] rank 1 broke" in capfd.readouterr().err


def test_launcher_kills_a_rank_that_does_not_end_when_asked(tmp_path, monkeypatch, capfd):
    """Rank 1 fails; rank 0 ignores the request to end (a rank stuck in a collective or a slow shutdown): it is killed
    once the grace has passed, and the command ends with rank 1's failure."""
    from specdec.cli import parallel

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(parallel, "RANK_GRACE_SECONDS", 2.0)
    stubborn = ("import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "if os.environ['RANK'] == '1': time.sleep(1); sys.exit('rank 1 broke')\ntime.sleep(120)")
    t0 = time.monotonic()
    assert start_ranks([sys.executable, "-c", stubborn], 2) == 1
    assert time.monotonic() - t0 < 30
    assert "[rank 1] rank 1 broke" in capfd.readouterr().err


def test_serve_on_two_ranks_answers_as_one_engine(model_dir, tmp_path):
    """``specdec serve --tensor-parallel-size 2``: the command starts its two ranks, rank 0 serves on the port and
    answers a greedy completion with the unsplit target's tokens; an interrupt ends both ranks and the command, with
    status 130 and no traceback."""
    import signal
    import subprocess

    import httpx
    import openai

    from specdec.engine import SpecConfig, SpecEngine
    from specdec.parallel import free_port
    from specdec.sampling_params import SamplingParams

    port = free_port()
    # (Ctrl-C's default restored in the command: a harness that starts the tests in the background hands them SIGINT
    # ignored, which the command would inherit)
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", model_dir, "--draft", "ngram", "--device",
                             "cpu", "--tensor-parallel-size", "2", "--port", str(port), "--threads", "1"],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=model_dir, prompt="hello world, hello", max_tokens=12, temperature=0)
        want = SpecEngine(None, model_dir, SpecConfig()).generate("hello world, hello", SamplingParams(max_tokens=12))
        assert got.choices[0].text == want[0].text and want[0].text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    err = proc.stderr.read()
    assert proc.returncode == 130 and "Traceback" not in err, err  # an interrupt ends the command quietly


def _launcher_of_sleeping_ranks(tmp_path):
    """A launcher process (``start_ranks`` of two ranks that write their pids and sleep) and the ranks' pids."""
    import subprocess

    rank = ("import os, pathlib, time\npathlib.Path(f\"rank{os.environ['RANK']}.pid\").write_text(str(os.getpid()))\n"
            "time.sleep(120)")
    launcher = ("import sys\nfrom specdec.cli.parallel import start_ranks\n"
                f"sys.exit(start_ranks([sys.executable, '-c', {rank!r}], 2))")
    proc = subprocess.Popen([sys.executable, "-c", launcher], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}.pid").is_file() and (tmp_path / f"rank{r}.pid").read_text() for r in (0, 1)):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return proc, [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]


def _ended(pid: int, within: float) -> bool:
    """Whether process ``pid`` (not a child of this one) ends within ``within`` seconds: gone, or a zombie (dead,
    left for a parent that does not reap it)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a rank ending with its launcher uses Linux's prctl")
def test_launcher_stopped_or_killed_takes_its_ranks_with_it(tmp_path):
    """SIGTERM (a service manager's stop) ends the ranks and the command with status 143; a launcher killed outright
    (SIGKILL, no handler runs) still leaves no rank running."""
    import signal

    proc, ranks = _launcher_of_sleeping_ranks(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM, proc.stderr.read()
    assert all(_ended(pid, 10) for pid in ranks)
    for r in (0, 1):
        (tmp_path / f"rank{r}.pid").unlink()
    proc, ranks = _launcher_of_sleeping_ranks(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert all(_ended(pid, 10) for pid in ranks)
