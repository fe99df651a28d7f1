"""``specdec --version``, every default in ``--help``, and an unknown flag reported with its subcommand's usage."""

from __future__ import annotations

import pytest

from specdec.cli import main
from specdec.cli.main import build_parser

COMMANDS = ("generate", "bench", "serve", "bench-serve", "distill")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.split()
    assert out[0] == "specdec" and out[1][0].isdigit(), out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_default(command):
    """Every option but the on/off switches and the required ones says its default (``(default: X)`` or in
    words) or that it is required (options a subcommand's run needs, checked by its config); the required ones
    have help too."""
    parser = build_parser().commands[command]
    formatter = parser._get_formatter()
    options = [a for a in parser._actions if a.option_strings and a.nargs != 0 and not a.required]
    assert len(options) >= 5
    for action in options:
        text = formatter._expand_help(action) if action.help else ""
        assert "default" in text or "(required" in text, (action.option_strings, text)
    assert all(a.help for a in parser._actions if a.required)


@pytest.mark.parametrize("command,rest", [("generate", ["--prompt", "hi"]), ("bench", []), ("serve", []),
                                          ("bench-serve", [])])
def test_unknown_flag_shows_the_subcommands_usage(capsys, command, rest):
    with pytest.raises(SystemExit) as done:
        main([command, *rest, "--no-such-flag=1"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith(f"usage: specdec {command} ") and "unrecognized arguments: --no-such-flag=1" in err, err


def test_cpu_runs_set_a_sane_thread_count(monkeypatch):
    """Half the cores (1 to 8) unless --threads says otherwise; torch's default of every core oversubscribed a
    busy 2-core machine 20-30x."""
    import torch

    from specdec.cli.common import MAX_DEFAULT_THREADS, cpu_threads, device_dtype

    assert [cpu_threads(cores=n) for n in (1, 2, 3, 16, 128)] == [1, 1, 1, 8, MAX_DEFAULT_THREADS]
    assert cpu_threads(3, cores=2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    device_dtype(build_parser().parse_args(["generate", "--prompt", "hi", "--device", "cpu", "--threads", "3"]))
    assert torch.get_num_threads() == 3
    device_dtype(build_parser().parse_args(["generate", "--prompt", "hi", "--device", "cpu"]))
    assert torch.get_num_threads() == cpu_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    device_dtype(build_parser().parse_args(["bench", "--device", "cpu"]))
    assert torch.get_num_threads() == cpu_threads()  # OMP_NUM_THREADS set: left as it was


def test_bad_thread_count_is_a_usage_error(capsys):
    from cli_helpers import run_cli

    err = run_cli(capsys, ["generate", "--prompt", "hi", "--device", "cpu", "--threads", "0"])
    assert err.startswith("error: --threads: must be an integer >= 1"), err
