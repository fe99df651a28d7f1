"""How `specdec serve` and a data-parallel replica stop: a bounded graceful shutdown, and the startup heap unfrozen
(else triton's nanobind bindings print their "leaked instances" lines at exit)."""

from __future__ import annotations

import pytest
from serving_helpers import with_tokenizer

from specdec.engine import SpecConfig


@pytest.fixture(scope="module")
def target_dir(tiny_dirs, tmp_path_factory):
    return with_tokenizer(tiny_dirs["llama"], tmp_path_factory.mktemp("served") / "llama")


def test_serve_bounds_its_graceful_shutdown_and_unfreezes_the_heap(monkeypatch):
    """``specdec serve`` ran uvicorn with no graceful-shutdown bound (SIGTERM with a half-sent body or a long stream
    kept it alive indefinitely), and left its startup heap frozen, so at exit triton's nanobind bindings printed
    some 30 lines of "leaked instances" warnings."""
    import gc
    from types import SimpleNamespace

    import uvicorn

    from specdec.serving import cli

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(
        (self.config.timeout_graceful_shutdown, gc.get_freeze_count())))
    args = SimpleNamespace(served_model_name=None, model="tiny", default_max_tokens=16, max_request_bytes=None,
                           draft="none", tree="chain:1", host="127.0.0.1", port=0, log_level="warning", api_key=None)
    gc.unfreeze()
    try:
        cli._run_server(SimpleNamespace(add_stats_listener=lambda fn: None, load=None), args, None, "stand-ins")
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()  # (the test process goes on collecting)
    assert len(seen) == 1 and seen[0][0] == cli.GRACEFUL_SHUTDOWN_S and seen[0][1] > 0
    assert after == 0


def test_serve_exits_without_nanobind_leak_warnings():
    """The same, end to end in a fresh interpreter that imports triton: nothing on stderr after the server ran."""
    import subprocess
    import sys

    code = ("import uvicorn, triton; from types import SimpleNamespace as NS; from specdec.serving import cli\n"
            "uvicorn.Server.run = lambda self, sockets=None: None\n"
            "cli._run_server(NS(add_stats_listener=lambda fn: None, load=None), NS(served_model_name=None, "
            "model='tiny', default_max_tokens=16, max_request_bytes=None, draft='none', tree='chain:1', "
            "host='127.0.0.1', port=0, log_level='warning', api_key=None), None, 'stand-ins')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "nanobind: leaked" not in done.stderr, done.stderr[-2000:]


def test_a_replica_unfreezes_its_heap_when_it_stops(monkeypatch, target_dir):
    """A data-parallel replica's process serves with its startup heap frozen and unfreezes it when it stops."""
    import gc
    import queue

    from specdec.serving import replica_process
    from specdec.serving.replica_process import EngineRecipe

    seen = []
    monkeypatch.setattr(replica_process, "_serve_parent", lambda *args: seen.append(gc.get_freeze_count()))
    outbox = queue.Queue()
    gc.unfreeze()
    try:
        replica_process._child_main(EngineRecipe("ngram", str(target_dir), SpecConfig(num_blocks=16)),
                                    queue.Queue(), outbox)
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert outbox.get_nowait()[0] == "ready" and len(seen) == 1 and seen[0] > 0
    assert after == 0
