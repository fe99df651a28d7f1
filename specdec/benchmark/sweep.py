"""The batch-size sweep of a ``specdec bench`` report: its table, and joining the sweeps of several runs."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.benchmark.report import format_cell, render_table


def format_sweep(report: dict) -> str:
    """Plain-text table of the batch-size sweep: one row per batch size (empty string without one)."""
    sweep = report.get("sweep") or []
    if len(sweep) < 2:
        return ""
    table = [("batch", "n", "mal", "spec t/s", "tgt t/s", "hf t/s", "hfs t/s", "hfa t/s", "speedup", "vs hf",
              "vs hfs", "identical", "tie", "mism")]
    for e in sweep:
        dv = e["lossless"]["divergence"]
        table.append((str(e["batch_size"]), str(e["num_prompts"]), format_cell(e["mean_accepted_length"]),
                      format_cell(e["spec_tokens_per_s"], ".1f"), format_cell(e["target_only_tokens_per_s"], ".1f"),
                      format_cell(e["hf_tokens_per_s"], ".1f"), format_cell(e["hf_static_tokens_per_s"], ".1f"),
                      format_cell(e["hf_assisted_tokens_per_s"], ".1f"), format_cell(e["speedup"], ".2f", "x"),
                      format_cell(e["speedup_vs_hf"], ".2f", "x"), format_cell(e["speedup_vs_hf_static"], ".2f", "x"),
                      f"{e['lossless']['identical']}/{e['lossless']['checked']}", str(dv["numerical_tie"]),
                      str(dv["mismatch"] + dv["unclassified"])))
    return "\n".join(["batch-size sweep", *render_table(table)]) + "\n"


def merge_sweeps(reports: Sequence[dict]) -> dict:
    """One report whose ``sweep`` joins the sweeps of ``reports`` (runs of the same prompts and options
    at different batch sizes), ordered by batch size; the other keys come from the first report.

    Raises ValueError when a batch size repeats or the runs' configs differ beyond the batch size.
    """
    if not reports:
        raise ValueError("merge_sweeps needs at least one report")
    ignore = {"batch_size", "json_out", "plot"}
    base = {k: v for k, v in reports[0]["config"].items() if k not in ignore}
    entries = []
    for i, rep in enumerate(reports):
        other = {k: v for k, v in rep["config"].items() if k not in ignore}
        if other != base:
            diff = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k))
            raise ValueError(f"report {i} differs from report 0 in config {diff}; only batch_size may differ")
        entries += rep["sweep"]
    sizes = [e["batch_size"] for e in entries]
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"batch sizes repeat across the reports: {sizes}")
    merged = dict(reports[0])
    merged["sweep"] = sorted(entries, key=lambda e: e["batch_size"])
    merged["config"] = {**reports[0]["config"], "batch_size": sorted(sizes)}
    return merged
