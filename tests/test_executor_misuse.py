"""The executor under misuse (issue 28): a prompt whose preparation raises, run_on_loop functions that generate
or raise anything, and prompts tokenised off the loop thread."""

from __future__ import annotations

import threading

import pytest
from serving_helpers import BAD_CHAT, GOOD_CHAT

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams
from specdec.serving.executor import Executor

pytestmark = pytest.mark.usefixtures("single_thread")
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture()
def executor(strict_target):
    ex = Executor(SpecEngine(None, strict_target, SpecConfig(num_blocks=64)))
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def reference(strict_target):
    return SpecEngine(None, strict_target, SpecConfig(num_blocks=64)).generate([GOOD_CHAT], PARAMS)[0].token_ids


def test_a_raising_chat_template_fails_its_request_and_the_loop_lives(executor, reference):
    """The template's TemplateError killed the loop thread: no answer, streams stopped, every later request
    failed. Now the request is refused naming the cause while a running stream goes on."""
    running = executor.enqueue(GOOD_CHAT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    stream = executor.stream(running, timeout=60)
    next(stream)  # admitted
    bad = executor.result(executor.enqueue(BAD_CHAT, PARAMS), timeout=60)
    assert bad.finish_reason == "error" and "roles must alternate" in str(bad.error)
    assert isinstance(bad.error, ValueError)
    outs = list(stream)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 40
    assert executor.alive
    assert executor.result(executor.enqueue(GOOD_CHAT, PARAMS), timeout=60).token_ids == reference


def test_run_on_loop_generating_while_requests_run(executor, reference):
    """A nested generate finished the live requests inside its own steps and their readers waited forever."""
    ids = [executor.enqueue(GOOD_CHAT, PARAMS) for _ in range(3)]
    nested = executor.run_on_loop(lambda e: e.generate([GOOD_CHAT], PARAMS)[0].token_ids)
    assert nested == reference
    for rid in ids:
        assert executor.result(rid, timeout=30).token_ids == reference
    assert executor.run_on_loop(lambda e: e.all_blocks_free())


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError])
def test_run_on_loop_hands_back_any_exception(executor, reference, exc):
    """A KeyboardInterrupt stopped the loop and the caller got queue.Empty."""
    def boom(engine):
        raise exc("from the function")

    with pytest.raises(exc, match="from the function"):
        executor.run_on_loop(boom, timeout=10)
    assert executor.alive
    assert executor.result(executor.enqueue(GOOD_CHAT, PARAMS), timeout=30).token_ids == reference


def test_run_on_loop_timeout_is_a_timeout_error(executor):
    release = threading.Event()
    with pytest.raises(TimeoutError, match="within 0.2 s"):
        executor.run_on_loop(lambda e: release.wait(10), timeout=0.2)
    release.set()
    assert executor.run_on_loop(lambda e: 7) == 7
