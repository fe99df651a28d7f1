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
def test_unknown_flag_is_one_line_naming_it(capsys, command, rest):
    """``error: --flag: what`` on one line (no usage block), pointing at the subcommand's help, exit status 2."""
    with pytest.raises(SystemExit) as done:
        main([command, *rest, "--no-such-flag=1"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err == f"error: --no-such-flag: unknown flag (`specdec {command} --help` lists the flags)\n", err


@pytest.mark.parametrize("argv,line", [
    (["--max-tokns", "8"], "error: --max-tokns: unknown flag (did you mean --max-tokens or --max-new-tokens?)"),
    (["--temprature", "0.5"], "error: --temprature: unknown flag (did you mean --temperature?)"),
    (["--top_p", "0.5"], "error: --top_p: unknown flag (did you mean --top-p?)"),
    (["--model-path", "x"], "error: --model-path: unknown flag (did you mean --model?)"),
    (["--do-sample"], "error: --do-sample: not a specdec generate flag; use --temperature T (> 0 samples; 0, the "
                      "default, is greedy)"),
    (["--max-length", "9"], "error: --max-length: not a specdec generate flag; use --max-new-tokens N (it counts new "
                            "tokens only)"),
    (["--max-model-len", "4096"], "error: --max-model-len: not supported by specdec generate (the model's own "
                                  "context length, its max_position_embeddings, is used)"),
    (["--api-key", "k"], "error: --api-key: not supported by specdec generate (the key of `specdec serve "
                         "--api-key`: a client's requests carry it)"),
    (["--speculative-config", '{"method": "ngram"}'], "error: --speculative-config: not a specdec generate flag; use "
     "--draft NAME (a draft model, or ngram) and --tree chain:K for its num_speculative_tokens"),
    (["--enable-prefix-caching"], "error: --enable-prefix-caching: not supported by specdec generate (prefix caching "
                                  "is on by default; serve's --no-prefix-cache turns it off)"),
    (["story"], "error: unexpected argument story (options take --flag VALUE)"),
    (["--temperature", "hot"], "error: --temperature: invalid float value: 'hot'"),
    (["--max-tokens", "x"], "error: --max-new-tokens: invalid int value: 'x'"),
])
def test_flag_typos_and_other_engines_flags_get_one_line_with_a_suggestion(capsys, argv, line):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--prompt", "hi", *argv])
    assert done.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_flag_another_command_has_is_not_suggested_where_it_is_missing(capsys):
    """``--n`` is generate's; ``bench`` has none, so --num-return-sequences is just not supported there."""
    with pytest.raises(SystemExit):
        main(["bench", "--num-return-sequences", "2"])
    assert capsys.readouterr().err == "error: --num-return-sequences: not supported by specdec bench\n"


def test_each_commands_help_shows_only_what_it_accepts():
    """generate has no --adaptive, and runs one engine (--data-parallel-size only 1); --tree lists every form
    SpecConfig takes; bench's --draft does not offer 'none'."""
    commands = build_parser().commands
    generate, bench = (" ".join(commands[c].format_help().split()) for c in ("generate", "bench"))
    assert "--adaptive" not in generate and "--adaptive on" in bench
    for text in (generate, bench):
        assert "dynamic:BUDGET:KxD" in text and "| auto" in text
        assert "1 only: this command runs one engine" in text
    assert "engine replicas: M processes" in commands["serve"].format_help()
    assert "no 'none'" in bench
    for flag in ("--stop STR", "--ignore-eos", "--system SYSTEM", "or - to read it from stdin"):
        assert flag in generate, flag


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


@pytest.mark.parametrize("threads, words", [("0", ">= 1"), ("100000", "[1, 1024]")])
def test_bad_thread_count_is_a_usage_error(capsys, monkeypatch, threads, words):
    """--threads 100000 was handed to torch, whose thread pool then segfaulted (or libgomp aborted) making them."""
    from cli_helpers import refuse_model_loads, run_cli

    refuse_model_loads(monkeypatch)
    err = run_cli(capsys, ["generate", "--prompt", "hi", "--device", "cpu", "--threads", threads])
    assert err.startswith("error: --threads: must be an integer") and words in err, err


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["distill", "--help"],
                                  ["--version"]])
def test_help_does_not_import_torch(argv):
    """Help and the version answer without importing torch (a second and more): the package's names load on first
    use, and distill's options come from the training configs, which are free of torch."""
    import subprocess
    import sys

    code = ("import sys; from specdec.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr
    assert "specdec" in done.stdout
