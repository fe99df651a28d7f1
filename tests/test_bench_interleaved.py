"""bench/gpu_interleaved.py (the GPU runner's speed rounds) end to end on the CPU with the tiny model: the
environment it reads, its rounds and ratios, and the JSON the runner keeps. ``bench`` imports as a package
because CI runs ``python -m pytest`` from the repository root."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
from serving_helpers import with_tokenizer


def _run(tiny_dirs, tmp_path, monkeypatch, prompt_sets: dict, env: dict, batch: int) -> dict:
    """bench/gpu_interleaved.py's main over the tiny target with ``prompt_sets`` and the environment ``env`` at
    ``batch`` rows: the JSON it wrote."""
    target = with_tokenizer(tiny_dirs["llama"], tmp_path / "llama")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(prompt_sets))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delitem(sys.modules, "bench.gpu_interleaved", raising=False)
    bench = importlib.import_module("bench.gpu_interleaved")  # reads the environment at import
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_interleaved.py", str(out), str(target), str(prompts), str(batch)])
    bench.main()
    return json.loads((out / "interleaved.json").read_text())


def test_gpu_interleaved_rounds_and_json(tiny_dirs, tmp_path, monkeypatch):
    env = {"ENGINES": "plan", "ONLY": "ngram", "COLD": "1", "PROMPT_SET": "sharegpt", "NUM_PROMPTS": "4",
           "REPEATS": "2", "SCHEDULES": "continuous", "TEMPERATURE": "0"}
    res = _run(tiny_dirs, tmp_path, monkeypatch,
               {"mtbench": [[5, 6, 7, 8, 9]] * 4, "sharegpt": [[9, 10, 11, 9, 10, 11]] * 4}, env, 2)
    assert (res["engines"], res["cold"], res["prompt_set"], res["rounds"], res["temperature"]) == \
        ("plan", True, "sharegpt", 2, 0.0)
    assert "b2_waves" not in res  # SCHEDULES=continuous
    entry = res["b2_continuous"]
    assert set(entry) == {"target_only", "ngram"}  # ONLY keeps target-only beside the named engine
    for e in entry.values():
        assert len(e["tok_per_s_runs"]) == 2 and e["median"] > 0 and e["first_over_later"] > 0
        assert isinstance(e["plan"], dict) and "graphs" in e and "capture_s" in e
        assert e["late_captures"] == [[0, 0.0, []], [0, 0.0, []]]  # on the CPU nothing is captured or compiled
    assert len(entry["ngram"]["ratio_runs"]) == 2 and entry["ngram"]["speedup"] > 0
    assert entry["ngram"]["mean_accepted_length"] >= 1.0
    assert entry["ngram"]["epochs"] == []  # (no budget controller on the CPU by default: no epochs)


def test_the_logprobs_set_asks_for_them_on_its_engines_requests_only(tiny_dirs, tmp_path, monkeypatch):
    """``ENGINES=logprobs``: the ``_lp`` engines' requests carry ``logprobs=5``, target-only's none."""
    from specdec.engine import SpecEngine

    seen, queue = [], SpecEngine._queue

    def spy(self, ids, params, *rest):
        seen.append(params.logprobs)
        return queue(self, ids, params, *rest)

    monkeypatch.setattr(SpecEngine, "_queue", spy)
    env = {"ENGINES": "logprobs", "ONLY": "target_only_lp", "COLD": "1", "NUM_PROMPTS": "4", "REPEATS": "1",
           "SCHEDULES": "continuous", "TEMPERATURE": "0"}
    entry = _run(tiny_dirs, tmp_path, monkeypatch, {"mtbench": [[5, 6, 7, 8, 9]] * 4}, env, 2)["b2_continuous"]
    assert set(entry) == {"target_only", "target_only_lp"}
    assert sorted(seen, key=str) == [5] * 4 + [None] * 4  # 4 prompts for each engine, one round


def test_the_epoch_summary_gives_each_buckets_phases_and_each_budgets_rates():
    """Each budget's epochs, and each probe from plain decoding with what the watch's counts said of it and what it
    measured against plain decoding's held epochs (520 against their median 620), and the share of looked-up rows
    whose chain began right."""
    bench = importlib.import_module("bench.gpu_interleaved")

    def epoch(nodes, phase, rate, step_ms, bucket=64):
        return {"bucket": bucket, "greedy": False, "nodes": nodes, "phase": phase, "steps": 17, "rate": rate,
                "median_step_s": step_ms / 1e3, "best_before": 3 if phase == "search" else 0,
                "shadow_gains": {1: 1.3, 3: None}}

    log = [epoch(3, "search", 500.0, 1.9), epoch(0, "search", 560.0, 1.6), epoch(0, "hold", 600.0, 1.5),
           epoch(0, "hold", 640.0, 1.4), epoch(1, "probe", 520.0, 1.8),
           epoch(0, "search", 700.0, 1.4, bucket=8)]
    assert bench._epoch_summary(log) == (
        "b8 sampled steps {'search': 17, 'hold': 0, 'probe': 0} | 0: 1x 700 [1.40 ms]; "
        "b64 sampled steps {'search': 34, 'hold': 34, 'probe': 17} | 0: 3x 600 [1.50 ms], 1: 1x 520 [1.80 ms], "
        "3: 1x 500 [1.90 ms] | probes from plain (counted -> measured over plain's rate) 1: 1.30->0.84")


def test_row_slot_use_is_the_tokens_over_steps_times_batch_times_mal():
    """Target-only in lockstep (80 prompts x 128 tokens at batch 16: 640 decode steps and 5 waves' prefills) uses
    its row-slots but for the prefill steps; a speculating run whose steps commit 24 tokens over 16 rows at MAL 1.67
    uses 90% of them (the rest: its drain and admissions)."""
    bench = importlib.import_module("bench.gpu_interleaved")
    lockstep = {"decode_steps": 640, "prefill_steps": 5}
    assert bench._slot_use(lockstep, 80 * 128, 16, 1.0) == pytest.approx(640 / 645)
    speculating = {"decode_steps": 400, "prefill_steps": 27}
    assert bench._slot_use(speculating, 427 * 24, 16, 1.67) == pytest.approx(24 / 16 / 1.67)


def test_triton_compiles_are_named_through_the_post_compile_hook(monkeypatch):
    """The bench's compile log chains Triton's post-compile hook: a compile appends the kernel's name and calls the
    hook that was there before."""
    knobs = pytest.importorskip("triton").knobs
    import types

    from bench.gpu_interleaved import TritonCompiles

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["key"]))
    compiles = TritonCompiles()
    knobs.runtime.jit_post_compile_hook(key=7, fn=types.SimpleNamespace(name="paged_attention"))
    assert compiles.names == ["paged_attention"] and seen == [7]


def test_promised_is_the_held_budgets_rate_over_plain_decodings_in_the_runs_bucket():
    bench = importlib.import_module("bench.gpu_interleaved")
    rates = {"b8 sampled": {7: 990.0, 0: 790.0}, "b16 sampled": {3: 900.0, 0: 600.0, 1: 700.0}}
    assert bench._promised(rates, 16) == (3, 1.5)  # the held budget (first) over budget 0, in the batch's bucket
    assert bench._promised(rates, 8) == (7, 990.0 / 790.0)
    assert bench._promised(rates, 64) is None  # no such bucket
    assert bench._promised({"b16 sampled": {0: 733.0, 1: 739.6}}, 16) is None  # plain decoding held: no promise
    assert bench._promised({"b16 greedy": {3: None, 0: 600.0}}, 16) is None  # the held budget not measured yet
