"""bench/gpu_step_timeline.py's analysis: GPU idle time inside a step charged to the innermost host frame."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_step_timeline import STEP, idle_attribution, merge  # noqa: E402


def _ev(name, ts, dur, cat="python_function", tid=1):
    return {"name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


def test_merge_joins_overlapping_intervals():
    assert merge([(5, 9), (0, 2), (1, 3), (9, 10)]) == [(0, 3), (5, 10)]


def test_idle_time_goes_to_the_innermost_frame_and_its_specdec_owner():
    events = [
        _ev(STEP, 0, 100, cat="user_annotation"),
        _ev("kernel_a", 10, 30, cat="kernel", tid=7), _ev("kernel_b", 60, 10, cat="kernel", tid=7),
        _ev("kernel_c", 35, 20, cat="kernel", tid=8),  # overlaps kernel_a: busy 10..55
        _ev("/site/specdec/engine.py(10): step", 0, 100),
        _ev("<built-in method item of Tensor object at 0x7f00ab>", 50, 15),  # idle 55..60 under it
        _ev("cudaStreamSynchronize", 52, 10, cat="cuda_runtime"),  # idle 55..60 inside: the innermost frame
        _ev("torch/functional.py(1): helper", 80, 10),  # idle 80..90
    ]
    r = idle_attribution(events)
    assert r["steps"] == 1 and r["wall_us"] == 100
    assert r["gpu_busy_us"] == 55 and r["gpu_idle_us"] == 45 and r["idle_gaps"] == 3  # 0-10, 55-60, 70-100
    fn = r["idle_by_function_us"]
    assert fn["cudaStreamSynchronize"] == 5 and fn["torch/functional.py(1): helper"] == 10
    assert fn["/site/specdec/engine.py(10): step"] == 30  # 0..10 and 70..80, 90..100
    assert "<built-in method item>" not in fn  # its idle time is all inside its child
    ours = r["idle_by_specdec_function_us"]
    assert ours == {"/site/specdec/engine.py(10): step": 45}
