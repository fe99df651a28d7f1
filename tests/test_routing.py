"""Request routing: every output reaches the stream that submitted its request; a failed submission
leaves nothing queued; a stop string matched at offset 0 is cut from the text (bugs A, B, C of #13)."""

from __future__ import annotations

import pytest

from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

P1 = [[5, 6, 7, 8], [40, 41, 42], [90, 3, 17, 60, 61]]
P2 = [[11, 12], [70, 71, 72, 73, 74, 75], [120, 121, 5], [33, 34, 35, 36]]
PARAMS = SamplingParams(max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    return SpecEngine(tiny_draft, tiny_target, SpecConfig(tree="chain:3", num_blocks=256, block_size=4))


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Target-only greedy outputs of P1 + P2, each prompt alone (a fresh engine, no prefix cache)."""
    eng = SpecEngine(None, tiny_target, SpecConfig(num_blocks=64, block_size=4, prefix_cache=False))
    return {tuple(p): eng.generate([p], PARAMS)[0].token_ids for p in P1 + P2}


def _drain(*streams) -> list[list]:
    """Advance the streams in turn, one output each, until all are exhausted."""
    got, live = [[] for _ in streams], list(range(len(streams)))
    while live:
        for i in list(live):
            out = next(streams[i], None)
            if out is None:
                live.remove(i)
            else:
                got[i].append(out)
    return got


def _finals(outs) -> dict[tuple, list[int]]:
    finals = [o for o in outs if o.finished]
    assert len(finals) == len({o.request_id for o in finals}), "a request finished twice"
    return {tuple(o.prompt_token_ids): o.token_ids for o in finals}


def test_interleaved_streams_get_only_their_own_requests(engine, reference):
    """Bug C: two streams driven in turn; each sees exactly its requests, all of them, to the end."""
    s1, s2 = engine.stream(P1, PARAMS), engine.stream(P2, PARAMS)
    got1, got2 = _drain(s1, s2)
    assert {tuple(o.prompt_token_ids) for o in got1} == {tuple(p) for p in P1}
    assert {tuple(o.prompt_token_ids) for o in got2} == {tuple(p) for p in P2}
    assert _finals(got1) == {tuple(p): reference[tuple(p)] for p in P1}
    assert _finals(got2) == {tuple(p): reference[tuple(p)] for p in P2}
    for got in (got1, got2):  # the streamed pieces add up to the final outputs
        for p in {tuple(o.prompt_token_ids) for o in got}:
            pieces = [t for o in got if tuple(o.prompt_token_ids) == p for t in o.new_token_ids]
            assert pieces == reference[p]
    assert engine.all_blocks_free()


def test_stream_finished_while_the_other_drives(engine, reference):
    """Bug C: stream 1 is consumed only after stream 2 ran the engine dry; nothing of it is lost."""
    s1 = engine.stream(P1, PARAMS)
    first = next(s1)  # submits P1 and runs a step
    rest2 = list(engine.stream(P2, PARAMS))  # drives the engine until P2 is done (P1 finishes too)
    rest1 = [first, *s1]
    assert _finals(rest1) == {tuple(p): reference[tuple(p)] for p in P1}
    assert _finals(rest2) == {tuple(p): reference[tuple(p)] for p in P2}
    assert not engine.scheduler.has_work and engine.all_blocks_free()


def test_closing_one_stream_leaves_the_other_running(engine, reference):
    s1, s2 = engine.stream(P1, PARAMS), engine.stream(P2, PARAMS)
    next(s1)
    next(s2)
    s1.close()  # aborts P1's requests only
    assert _finals(list(s2)) == {tuple(p): reference[tuple(p)] for p in P2}
    assert engine.all_blocks_free()


@pytest.mark.parametrize("bad", [{"temperature": 0.5}, "greedy", 0.7])
def test_bad_params_entry_queues_nothing(engine, reference, bad):
    """Bug A: a params entry that is not SamplingParams raises before any prompt is queued."""
    with pytest.raises(TypeError, match=r"params\[1\] must be SamplingParams"):
        engine.generate(P1, [PARAMS, bad, PARAMS])
    with pytest.raises(TypeError, match=r"params\[2\] must be SamplingParams"):
        next(engine.stream(P1, [PARAMS, PARAMS, bad]))
    assert not engine.scheduler.has_work
    outs = engine.generate([P2[0]], PARAMS)  # the next call yields only its own request
    assert [o.prompt_token_ids for o in outs] == [P2[0]]
    assert outs[0].token_ids == reference[tuple(P2[0])]
    assert engine.all_blocks_free()


def test_failed_submission_aborts_what_it_queued(engine, reference, monkeypatch):
    """Bug A: any exception while submitting aborts the requests this call already queued."""
    add = engine._queue
    calls = []

    def flaky(ids, params, request_id, prompt_text):
        calls.append(ids)
        if len(calls) == 3:
            raise RuntimeError("submission failed")
        return add(ids, params, request_id, prompt_text)

    monkeypatch.setattr(engine, "_queue", flaky)
    with pytest.raises(RuntimeError, match="submission failed"):
        engine.generate(P2, PARAMS)
    monkeypatch.undo()
    assert not engine.scheduler.has_work
    assert engine.all_blocks_free()
    outs = list(engine.stream([P1[0]], PARAMS))
    assert {tuple(o.prompt_token_ids) for o in outs} == {tuple(P1[0])}
    assert _finals(outs) == {tuple(P1[0]): reference[tuple(P1[0])]}


# ---------------------------------------------------------------- bug B: stop string at offset 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_at_offset_zero_is_cut(letter_target, stream):
    eng = SpecEngine(None, letter_target, SpecConfig(num_blocks=64, block_size=4))
    prompt = [5, 6, 7, 8]
    free = eng.generate([prompt], PARAMS)[0]
    assert len(free.text) > 2
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, stop=[free.text[0]])
    if stream:
        outs = list(eng.stream([prompt], params))
        out = outs[-1]
        assert "".join(o.new_text for o in outs) == ""
    else:
        out = eng.generate([prompt], params)[0]
    assert out.finish_reason == "stop"
    assert out.text == ""
    assert out.token_ids == free.token_ids[:1]
    later = SamplingParams(max_new_tokens=10, ignore_eos=True, stop=[free.text[1:3]])  # a match further in
    assert eng.generate([prompt], later)[0].text == free.text[:free.text.index(free.text[1:3])]
    assert eng.all_blocks_free()


def test_generate_builds_only_final_outputs_while_a_stream_alongside_gets_every_step(engine, reference,
                                                                                     monkeypatch):
    """``generate`` (no progress bar) builds one output per request, at its finish, with the whole output
    in ``new_token_ids``/``new_text``; a stream sharing the engine still gets an output per step."""
    import specdec.engine as engine_mod

    built = []
    output = engine_mod.request_output
    monkeypatch.setattr(engine_mod, "request_output", lambda req, stopper: built.append(req.request_id) or
                        output(req, stopper))
    outs = engine.generate(P1, PARAMS)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in P1]
    assert sorted(built) == sorted(o.request_id for o in outs)  # once each: at the finish
    assert all(o.new_token_ids == o.token_ids and o.new_text == o.text and o.finished for o in outs)
    built.clear()
    streamed = list(engine.stream(P2[:1], PARAMS))
    assert len(built) >= len(streamed) > 1  # (an output with no new token is built but not queued)
    assert sum((o.new_token_ids for o in streamed), []) == reference[tuple(P2[0])]
