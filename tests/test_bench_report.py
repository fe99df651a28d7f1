"""Tests for specdec.benchmark.report on hand-made records (numbers checked by hand)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest

from specdec.benchmark.plot import plot_report
from specdec.benchmark.report import (
    REPORT_KEYS,
    SUMMARY_KEYS,
    build_report,
    check_lossless,
    environment_info,
    format_table,
    lossless_ok,
    write_json,
)
from specdec.benchmark.sweep import format_sweep, merge_sweeps


def rec(rid, category, *, out, time_s, drafted, accepted, forwards, pd_d, pd_a, tgt_time, greedy=True,
        hf=None, hf_assisted=None, hf_static=None, corrupt=False):
    ids = list(range(100, 100 + out))
    spec_ids = list(ids)
    if corrupt:
        spec_ids[-1] += 1
    return {
        "id": rid, "category": category, "prompt_tokens": 10, "greedy": greedy,
        "spec": {"output_tokens": out, "time_s": time_s, "drafted": drafted, "accepted": accepted,
                 "target_forwards": forwards, "per_depth_drafted": pd_d, "per_depth_accepted": pd_a,
                 "token_ids": spec_ids},
        "target_only": {"output_tokens": out, "time_s": tgt_time, "token_ids": ids},
        "hf": hf, "hf_assisted": hf_assisted, "hf_static": hf_static,
    }


def NO_DIVERGENCE(identical):
    return {"identical": identical, "numerical_tie": 0, "mismatch": 0, "unclassified": 0, "positions": {}}


@pytest.fixture
def records():
    return [
        # a: 40 drafted / 30 accepted over 3 depths, 40 tokens in 10 forwards
        rec("a", "math", out=40, time_s=1.0, drafted=40, accepted=30, forwards=10,
            pd_d=[10, 10, 10, 10], pd_a=[10, 9, 7, 4], tgt_time=2.0,
            hf={"output_tokens": 40, "time_s": 4.0}, hf_assisted={"output_tokens": 40, "time_s": 2.5},
            hf_static={"output_tokens": 40, "time_s": 1.0}),
        # b: 20 drafted / 10 accepted, 2 depths only, 20 tokens in 10 forwards
        rec("b", "math", out=20, time_s=1.0, drafted=20, accepted=10, forwards=10,
            pd_d=[10, 10], pd_a=[6, 4], tgt_time=1.0,
            hf={"output_tokens": 20, "time_s": 2.0}),
        # c: other category, sampled (not greedy), outputs differ but must not be checked
        rec("c", "writing", out=30, time_s=2.0, drafted=30, accepted=15, forwards=15,
            pd_d=[15, 15], pd_a=[10, 5], tgt_time=3.0, greedy=False, corrupt=True),
    ]


def test_report_keys_stable(records):
    report = build_report(records, env={"device": "cpu"}, config={"draft_depth": 4})
    assert tuple(report) == REPORT_KEYS
    assert tuple(report["overall"]) == SUMMARY_KEYS
    assert list(report["per_category"]) == ["math", "writing"]
    for summary in report["per_category"].values():
        assert tuple(summary) == SUMMARY_KEYS
    assert set(report["overall"]["lossless"]) == {"checked", "identical", "mismatches", "divergence"}
    assert report["sweep"] == []
    assert report["env"] == {"device": "cpu"} and report["config"] == {"draft_depth": 4}
    assert [r["id"] for r in report["records"]] == ["a", "b", "c"]
    json.dumps(report, allow_nan=False)  # JSON-serialisable as is


def test_report_values_by_hand(records):
    o = build_report(records, env={}, config={})["overall"]
    assert o["num_prompts"] == 3 and o["output_tokens"] == 90
    assert o["drafted"] == 90 and o["accepted"] == 55
    assert o["acceptance_rate"] == pytest.approx(55 / 90)
    assert o["mean_accepted_length"] == pytest.approx(90 / 35)
    assert o["target_forwards_per_token"] == pytest.approx(35 / 90)
    assert o["per_depth_acceptance"] == pytest.approx([26 / 35, 18 / 35, 7 / 10, 4 / 10])
    assert o["spec_tokens_per_s"] == pytest.approx(90 / 4.0)
    assert o["target_only_tokens_per_s"] == pytest.approx(90 / 6.0)
    assert o["speedup"] == pytest.approx((90 / 4.0) / (90 / 6.0))
    # HF measured on a and b only: compare spec on those same records (60 tok in 2 s) with HF (60 in 6 s)
    assert o["hf_tokens_per_s"] == pytest.approx(10.0)
    assert o["speedup_vs_hf"] == pytest.approx(30.0 / 10.0)
    assert o["hf_assisted_tokens_per_s"] == pytest.approx(16.0)
    assert o["speedup_vs_hf_assisted"] == pytest.approx(40.0 / 16.0)
    assert o["hf_static_tokens_per_s"] == pytest.approx(40.0)
    assert o["speedup_vs_hf_static"] == pytest.approx(40.0 / 40.0)
    assert o["lossless"] == {"checked": 2, "identical": 2, "mismatches": [], "divergence": NO_DIVERGENCE(2)}


def test_per_category_and_unmeasured_hf(records):
    report = build_report(records, env={}, config={})
    math, writing = report["per_category"]["math"], report["per_category"]["writing"]
    assert math["acceptance_rate"] == pytest.approx(40 / 60)
    assert math["per_depth_acceptance"] == pytest.approx([16 / 20, 13 / 20, 0.7, 0.4])
    assert writing["acceptance_rate"] == pytest.approx(0.5)
    assert writing["speedup"] == pytest.approx(15.0 / 10.0)
    assert writing["hf_tokens_per_s"] is None and writing["hf_assisted_tokens_per_s"] is None
    assert writing["speedup_vs_hf"] is None
    assert writing["lossless"] == {"checked": 0, "identical": 0, "mismatches": [], "divergence": NO_DIVERGENCE(0)}
    assert report["per_depth_acceptance"] == report["overall"]["per_depth_acceptance"]


def test_zero_denominators_give_none():
    r = rec("z", "x", out=0, time_s=0.0, drafted=0, accepted=0, forwards=0, pd_d=[], pd_a=[], tgt_time=0.0)
    o = build_report([r], env={}, config={})["overall"]
    for key in ("acceptance_rate", "mean_accepted_length", "target_forwards_per_token", "spec_tokens_per_s",
                "target_only_tokens_per_s", "speedup", "speedup_vs_hf"):
        assert o[key] is None, key
    assert o["per_depth_acceptance"] == []


def test_lossless_catches_corruption(records):
    bad = copy.deepcopy(records)
    bad[1]["spec"]["token_ids"][5] = 99999
    assert check_lossless(records) == (2, 2, [])
    assert check_lossless(bad) == (2, 1, ["b"])
    report = build_report(bad, env={}, config={})
    assert report["overall"]["lossless"] == {
        "checked": 2, "identical": 1, "mismatches": ["b"],
        "divergence": {"identical": 1, "numerical_tie": 0, "mismatch": 0, "unclassified": 1, "positions": {"b": None}}}
    assert "MISMATCH (unclassified) on: b" in format_table(report)
    assert not lossless_ok(report)


@pytest.mark.parametrize("cls", ["numerical_tie", "mismatch"])
def test_classified_divergence_counts_and_exit_rule(records, cls):
    bad = copy.deepcopy(records)
    bad[1]["spec"]["token_ids"][5] = 99999
    bad[1]["divergence"] = {"position": 5, "class": cls}
    report = build_report(bad, env={}, config={}, sweep=[(1, bad), (4, records)])
    dv = report["overall"]["lossless"]["divergence"]
    assert dv[cls] == 1 and dv["unclassified"] == 0 and dv["positions"] == {"b": 5}
    assert [e["batch_size"] for e in report["sweep"]] == [1, 4]
    assert report["sweep"][1]["lossless"]["divergence"] == NO_DIVERGENCE(2)
    assert lossless_ok(report) == (cls == "numerical_tie")
    label = "numerical_tie (bf16 rounding) on: b@5" if cls == "numerical_tie" else "lossless MISMATCH on: b@5"
    assert label in format_table(report)
    sweep_table = format_sweep(report).splitlines()
    assert sweep_table[0] == "batch-size sweep" and len(sweep_table) == 2 + 1 + 2
    assert sweep_table[3].split()[0] == "1" and sweep_table[4].split()[0] == "4"


def test_merge_sweeps_joins_batch_sizes(records):
    one = build_report(records, env={}, config={"batch_size": [8], "tree": "chain:8"}, sweep=[(8, records)])
    two = build_report(records, env={}, config={"batch_size": [1], "tree": "chain:8"}, sweep=[(1, records)])
    merged = merge_sweeps([one, two])
    assert [e["batch_size"] for e in merged["sweep"]] == [1, 8] and merged["config"]["batch_size"] == [1, 8]
    with pytest.raises(ValueError, match="repeat"):
        merge_sweeps([one, one])
    other = build_report(records, env={}, config={"batch_size": [1], "tree": "chain:4"}, sweep=[(1, records)])
    with pytest.raises(ValueError, match="tree"):
        merge_sweeps([one, other])


def test_sweep_plot_is_a_png(records, tmp_path):
    pytest.importorskip("matplotlib")
    report = build_report(records, env={}, config={}, sweep=[(1, records), (8, records)])
    path = plot_report(report, tmp_path / "sweep.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dataclass_records_and_missing_keys(records):
    @dataclass
    class Rec:
        id: str
        category: str
        prompt_tokens: int
        spec: dict
        target_only: dict
        greedy: bool
        hf: dict | None = None
        hf_assisted: dict | None = None

    r = records[0]
    dc = Rec(r["id"], r["category"], r["prompt_tokens"], r["spec"], r["target_only"], r["greedy"])
    assert build_report([dc], env={}, config={})["overall"]["acceptance_rate"] == pytest.approx(0.75)
    broken = copy.deepcopy(r)
    del broken["spec"]["drafted"]
    with pytest.raises(ValueError, match="record 'a'.*drafted"):
        build_report([broken], env={}, config={})


def test_format_table(records):
    text = format_table(build_report(records, env={"device": "TestGPU", "git_commit": "abc"}, config={}))
    lines = text.splitlines()
    assert "TestGPU" in lines[0] and "abc" in lines[0]
    for token in ("math", "writing", "overall", "0.611", "2.57", "1.50x", "3.00x", "2/2", "d0", "d3"):
        assert token in text, token
    assert "acceptance by draft depth" in text


def test_write_json_and_plot(tmp_path, records):
    report = build_report(records, env=environment_info(), config={"k": 1})
    jpath = write_json(report, tmp_path / "out" / "report.json")
    assert json.loads(jpath.read_text())["overall"]["accepted"] == 55
    png = plot_report(report, tmp_path / "out" / "report.png")
    data = png.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_json_that_fails_leaves_no_file(tmp_path, records):
    """A failed replace (the path a folder) left the whole report behind as ``<path>.tmp``."""
    report = build_report(records, env=environment_info(), config={"k": 1})
    (tmp_path / "out").mkdir()
    with pytest.raises(OSError):
        write_json(report, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_environment_info_keys():
    env = environment_info()
    for key in ("device", "torch", "triton", "transformers", "git_commit", "python"):
        assert key in env
    assert isinstance(env["device"], str) and env["device"]
    assert env["python"].count(".") == 2
    assert env["git_commit"] is None or len(env["git_commit"]) == 40


def test_environment_commit_outside_a_checkout(monkeypatch):
    from specdec.benchmark import report

    monkeypatch.setattr(report, "_git", lambda *args: None)
    monkeypatch.setenv("SPECDEC_GIT_COMMIT", "f13ad5e-dirty")
    assert environment_info()["git_commit"] == "f13ad5e-dirty"
    monkeypatch.delenv("SPECDEC_GIT_COMMIT")
    assert environment_info()["git_commit"] is None


def test_plot_title_names_the_setup_and_depth_lines_do_not_overlap(records):
    """The figure's title says target, draft, tree, device, dtype and date; several acceptance curves (equal ones
    too) are drawn at different depth offsets with different markers, so none hides another."""
    pytest.importorskip("matplotlib")
    from specdec.benchmark.plot import _depth_axis, _figure, setup_line

    report = build_report(records, env={"device": "TestGPU", "date": "2026-12-02"},
                          config={"model": "smollm2-135m", "draft": "ngram", "tree": "chain:8", "dtype": "bfloat16"})
    line = setup_line(report)
    for part in ("smollm2-135m", "ngram", "chain:8", "TestGPU", "bfloat16", "2026-12-02"):
        assert part in line, (part, line)
    ax = _figure(6).subplots()
    _depth_axis(ax, [("batch 1", [0.8, 0.5]), ("batch 4", [0.8, 0.5])])
    first, second = ax.lines
    assert list(first.get_ydata()) == list(second.get_ydata())
    assert all(a != b for a, b in zip(first.get_xdata(), second.get_xdata()))
    assert first.get_marker() != second.get_marker()
    assert "date" in environment_info()
