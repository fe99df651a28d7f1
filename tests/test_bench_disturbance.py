"""``specdec bench`` warns when its measurement was disturbed: a short target-only probe timed before and after a
batch size's runs must agree within DISTURBED_SPREAD (a busy machine once gave a meaningless speedup silently)."""

from __future__ import annotations

import pytest

from specdec.benchmark.data import BenchPrompt
from specdec.benchmark.disturbance import DISTURBED_SPREAD, disturbance_note, time_probe
from specdec.cli.bench import run_batch_size
from specdec.engine import SpecConfig, SpecEngine
from specdec.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[5, 17, 99, 42, 8], [7, 7, 120, 33]]


def test_note_only_past_the_spread():
    assert disturbance_note(4, 1.0, 1.0 + DISTURBED_SPREAD * 0.9) is None
    assert disturbance_note(4, 1.0 + DISTURBED_SPREAD * 0.9, 1.0) is None
    note = disturbance_note(4, 0.1, 0.3)
    assert note.startswith("warning: batch size 4: the measurement was disturbed") and "100 ms" in note
    assert "300 ms" in note and "--threads 1" in note
    assert disturbance_note(4, 0.3, 0.1) is not None  # either direction


def test_run_batch_size_records_both_probes(tiny_target, capsys, monkeypatch):
    params = SamplingParams(max_new_tokens=4)
    engines = (SpecEngine("ngram", tiny_target, SpecConfig()), SpecEngine(None, tiny_target, SpecConfig()))
    prompts = [BenchPrompt(id=str(i), category="c", prompt="x") for i in range(len(PROMPTS))]
    probes = {}
    run_batch_size(engines, None, prompts, PROMPTS, params, 2, tiny_target, "float32", probes=probes)
    before, after = probes[2]
    assert before > 0 and after > 0
    assert time_probe(engines[1], PROMPTS, params) > 0
    times = iter([1.0, 2.0])  # a disturbed machine: the second probe took twice as long
    monkeypatch.setattr("specdec.benchmark.disturbance.time_probe", lambda *a: next(times))
    capsys.readouterr()
    run_batch_size(engines, None, prompts, PROMPTS, params, 2, tiny_target, "float32", probes=probes)
    assert probes[2] == (1.0, 2.0) and "batch size 2: the measurement was disturbed" in capsys.readouterr().err
