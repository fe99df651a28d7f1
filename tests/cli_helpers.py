"""Helpers of the CLI error tests: run a command that must fail as a user error, refuse model loads."""

from __future__ import annotations

from specdec.cli import main


def run_cli(capsys, argv: list[str]) -> str:
    """Run ``specdec argv``; assert exit status 2 and an ``error: `` line without a traceback; return stderr."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def refuse_model_loads(monkeypatch) -> None:
    """Make loading a model a test failure: the argument checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a model was loaded before the arguments were checked: {args}")

    monkeypatch.setattr("specdec.loading.registry.load_model", refuse)
    monkeypatch.setattr("specdec.engine_setup.load_model", refuse)
