"""Benchmark report: aggregate raw per-prompt records into stable JSON, a text table and a PNG.

Input record (one per prompt) is a plain dict (a dataclass instance is accepted and converted
with ``dataclasses.asdict``)::

    {
      "id": str, "category": str, "prompt_tokens": int, "greedy": bool,
      "spec": {"output_tokens": int, "time_s": float, "drafted": int, "accepted": int,
               "target_forwards": int, "per_depth_drafted": [int, ...],
               "per_depth_accepted": [int, ...], "token_ids": [int, ...]},
      "target_only": {"output_tokens": int, "time_s": float, "token_ids": [int, ...]},
      "hf": {"output_tokens": int, "time_s": float} | None,           # plain HF generate()
      "hf_assisted": {"output_tokens": int, "time_s": float} | None,  # HF assisted generation
      "hf_static": {"output_tokens": int, "time_s": float} | None,    # HF static cache + compile
      "divergence": {"position": int, "class": "numerical_tie" | "mismatch", ...} | None,
    }

``divergence`` (optional) is what :mod:`specdec.benchmark.divergence` found where a greedy record's spec and
target-only outputs part; a differing greedy record without it counts as ``unclassified``.

``per_depth_*[d]`` counts draft tokens proposed / accepted at draft depth ``d`` (0 = first draft
token after the last committed one).  Report layout (stable keys; ``<summary>`` below is the same
object for ``overall`` and every ``per_category`` entry)::

    schema_version, overall: <summary>, per_depth_acceptance, per_category: {cat: <summary>},
    records, env, config, sweep: [{batch_size, **<summary>}, ...]
    <summary> = num_prompts, prompt_tokens, output_tokens, drafted, accepted, target_forwards,
      acceptance_rate, mean_accepted_length, target_forwards_per_token, per_depth_acceptance,
      spec_tokens_per_s, target_only_tokens_per_s, hf_tokens_per_s, hf_assisted_tokens_per_s,
      speedup, speedup_vs_hf, speedup_vs_hf_assisted, hf_static_tokens_per_s, speedup_vs_hf_static,
      lossless: {checked, identical, mismatches, divergence: {identical, numerical_tie, mismatch,
                 unclassified, positions: {id: position}}}

``records`` and the summaries above are those of the first batch size run; ``sweep`` holds the
overall summary of every batch size run (the first included).

Ratios whose denominator is zero and HF rates that were not measured are ``None`` (JSON null).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
SUMMARY_KEYS = (
    "num_prompts", "prompt_tokens", "output_tokens", "drafted", "accepted", "target_forwards",
    "acceptance_rate", "mean_accepted_length", "target_forwards_per_token", "per_depth_acceptance",
    "spec_tokens_per_s", "target_only_tokens_per_s", "hf_tokens_per_s", "hf_assisted_tokens_per_s",
    "speedup", "speedup_vs_hf", "speedup_vs_hf_assisted", "hf_static_tokens_per_s", "speedup_vs_hf_static",
    "lossless",
)
REPORT_KEYS = ("schema_version", "overall", "per_depth_acceptance", "per_category", "records", "env",
               "config", "sweep")
HF_PARTS = ("hf", "hf_static", "hf_assisted")  # the transformers baselines, in the order bench runs them
_SPEC_KEYS = ("output_tokens", "time_s", "drafted", "accepted", "target_forwards", "per_depth_drafted",
              "per_depth_accepted", "token_ids")
_RUN_KEYS = ("output_tokens", "time_s")


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is None or den is zero."""
    return None if num is None or den is None or den == 0 else num / den


def normalize_record(record: Any) -> dict:
    """Return ``record`` as a plain dict, raising ValueError (naming the record) if a key is missing."""
    rec = dataclasses.asdict(record) if dataclasses.is_dataclass(record) else dict(record)
    rid = rec.get("id", "?")
    for key in ("id", "category", "prompt_tokens", "spec", "target_only", "greedy"):
        if key not in rec:
            raise ValueError(f"record {rid!r}: missing key {key!r}")
    for part, keys in (("spec", _SPEC_KEYS), ("target_only", (*_RUN_KEYS, "token_ids"))):
        missing = [k for k in keys if k not in (rec[part] or {})]
        if missing:
            raise ValueError(f"record {rid!r}: {part} is missing {missing}")
    if len(rec["spec"]["per_depth_drafted"]) != len(rec["spec"]["per_depth_accepted"]):
        raise ValueError(f"record {rid!r}: per_depth_drafted and per_depth_accepted differ in length")
    rec.setdefault("divergence", None)
    for part in HF_PARTS:
        rec.setdefault(part, None)
        if rec[part] is not None and any(k not in rec[part] for k in _RUN_KEYS):
            raise ValueError(f"record {rid!r}: {part} needs {_RUN_KEYS}")
    return rec


def check_lossless(records: Iterable[Any]) -> tuple[int, int, list[str]]:
    """Compare spec vs target-only token ids on greedy records only.

    Returns ``(checked, identical, mismatches)``: number of greedy records, how many produced
    identical token ids, and the ids of the ones that did not (in input order).
    """
    checked, identical, mismatches = 0, 0, []
    for rec in map(normalize_record, records):
        if not rec["greedy"]:
            continue
        checked += 1
        if list(rec["spec"]["token_ids"]) == list(rec["target_only"]["token_ids"]):
            identical += 1
        else:
            mismatches.append(str(rec["id"]))
    return checked, identical, mismatches


def divergence_counts(records: Iterable[dict]) -> dict:
    """Greedy records by outcome: ``{identical, numerical_tie, mismatch, unclassified, positions}``.

    ``positions`` maps each differing record's id to its first differing output position (None when
    the record carries no divergence analysis, which counts it as ``unclassified``).
    """
    counts = {"identical": 0, "numerical_tie": 0, "mismatch": 0, "unclassified": 0, "positions": {}}
    for rec in records:
        if not rec["greedy"]:
            continue
        if list(rec["spec"]["token_ids"]) == list(rec["target_only"]["token_ids"]):
            counts["identical"] += 1
            continue
        div = rec.get("divergence")
        cls = div.get("class") if div else None
        counts[cls if cls in ("numerical_tie", "mismatch") else "unclassified"] += 1
        counts["positions"][str(rec["id"])] = div.get("position") if div else None
    return counts


def lossless_ok(report: dict) -> bool:
    """True when no greedy divergence of any batch size run is a mismatch or unclassified."""
    summaries = [report["overall"], *report.get("sweep", [])]
    return all(s["lossless"]["divergence"]["mismatch"] == 0 and s["lossless"]["divergence"]["unclassified"] == 0
               for s in summaries)


def _per_depth(records: Sequence[dict]) -> list[float | None]:
    drafted: list[int] = []
    accepted: list[int] = []
    for rec in records:
        pairs = zip(rec["spec"]["per_depth_drafted"], rec["spec"]["per_depth_accepted"], strict=True)
        for d, (n_d, n_a) in enumerate(pairs):
            if d >= len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[d] += n_d
            accepted[d] += n_a
    return [_ratio(a, n) for a, n in zip(accepted, drafted, strict=True)]


def _rate(records: Sequence[dict], part: str) -> tuple[float | None, float | None]:
    """(tokens/s of ``part`` over the records that measured it, spec tokens/s over those same records)."""
    measured = [r for r in records if r.get(part) is not None]
    if not measured:
        return None, None

    def tps(key: str) -> float | None:
        return _ratio(sum(r[key]["output_tokens"] for r in measured), sum(r[key]["time_s"] for r in measured))

    return tps(part), tps("spec")


def summarize(records: Sequence[dict]) -> dict:
    """Aggregate normalized records into one ``<summary>`` object (see the module docstring).

    Rates are total output tokens / total seconds.  ``speedup_vs_hf*`` compares spec and HF on the
    records where HF was measured, so partial HF coverage still compares like with like.
    """
    spec = [r["spec"] for r in records]
    out_tok = sum(s["output_tokens"] for s in spec)
    drafted = sum(s["drafted"] for s in spec)
    accepted = sum(s["accepted"] for s in spec)
    forwards = sum(s["target_forwards"] for s in spec)
    spec_tps = _ratio(out_tok, sum(s["time_s"] for s in spec))
    target_tps, _ = _rate(records, "target_only")
    hf_tps, spec_on_hf = _rate(records, "hf")
    hfa_tps, spec_on_hfa = _rate(records, "hf_assisted")
    hfs_tps, spec_on_hfs = _rate(records, "hf_static")
    checked, identical, mismatches = check_lossless(records)
    return {
        "num_prompts": len(records),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "output_tokens": out_tok,
        "drafted": drafted,
        "accepted": accepted,
        "target_forwards": forwards,
        "acceptance_rate": _ratio(accepted, drafted),
        "mean_accepted_length": _ratio(out_tok, forwards),
        "target_forwards_per_token": _ratio(forwards, out_tok),
        "per_depth_acceptance": _per_depth(records),
        "spec_tokens_per_s": spec_tps,
        "target_only_tokens_per_s": target_tps,
        "hf_tokens_per_s": hf_tps,
        "hf_assisted_tokens_per_s": hfa_tps,
        "speedup": _ratio(spec_tps, target_tps),
        "speedup_vs_hf": _ratio(spec_on_hf, hf_tps),
        "speedup_vs_hf_assisted": _ratio(spec_on_hfa, hfa_tps),
        "hf_static_tokens_per_s": hfs_tps,
        "speedup_vs_hf_static": _ratio(spec_on_hfs, hfs_tps),
        "lossless": {"checked": checked, "identical": identical, "mismatches": mismatches,
                     "divergence": divergence_counts(records)},
    }


def build_report(records: Iterable[Any], env: dict, config: dict,
                 sweep: Sequence[tuple[int, Iterable[Any]]] = ()) -> dict:
    """Build the full report dict (keys: :data:`REPORT_KEYS`; summaries: :data:`SUMMARY_KEYS`).

    ``per_depth_acceptance`` at top level equals ``overall.per_depth_acceptance``;
    ``per_category`` is ordered by category name; ``records`` holds the normalized input records.
    ``sweep`` gives ``(batch_size, records)`` per batch size run; the report's ``sweep`` is
    ``[{"batch_size": b, **summary}]`` in that order (empty when not given).
    """
    recs = [normalize_record(r) for r in records]
    by_cat: dict[str, list[dict]] = {}
    for rec in recs:
        by_cat.setdefault(str(rec["category"]), []).append(rec)
    overall = summarize(recs)
    return {
        "schema_version": SCHEMA_VERSION,
        "overall": overall,
        "per_depth_acceptance": list(overall["per_depth_acceptance"]),
        "per_category": {cat: summarize(by_cat[cat]) for cat in sorted(by_cat)},
        "records": recs,
        "env": dict(env),
        "config": dict(config),
        "sweep": [{"batch_size": int(b), **summarize([normalize_record(r) for r in recs_b])} for b, recs_b in sweep],
    }


# ---------------------------------------------------------------------------------------- output


def format_cell(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(report: dict) -> str:
    """Plain-text table: one row per category plus ``overall``, then acceptance by depth, then how
    greedy outputs compared (identical / numerical_tie / mismatch, with divergence positions)."""
    rows = [(cat, s) for cat, s in report["per_category"].items()] + [("overall", report["overall"])]
    header = ("category", "n", "accept", "mal", "fwd/tok", "spec t/s", "tgt t/s", "hf t/s", "hfs t/s", "hfa t/s",
              "speedup", "vs hf", "vs hfs", "vs hfa", "identical", "tie", "mism")
    table = [header]
    for name, s in rows:
        ll, dv = s["lossless"], s["lossless"]["divergence"]
        table.append((
            name, str(s["num_prompts"]), format_cell(s["acceptance_rate"], ".3f"),
            format_cell(s["mean_accepted_length"]), format_cell(s["target_forwards_per_token"], ".3f"),
            format_cell(s["spec_tokens_per_s"], ".1f"), format_cell(s["target_only_tokens_per_s"], ".1f"),
            format_cell(s["hf_tokens_per_s"], ".1f"), format_cell(s["hf_static_tokens_per_s"], ".1f"),
            format_cell(s["hf_assisted_tokens_per_s"], ".1f"), format_cell(s["speedup"], ".2f", "x"),
            format_cell(s["speedup_vs_hf"], ".2f", "x"), format_cell(s["speedup_vs_hf_static"], ".2f", "x"),
            format_cell(s["speedup_vs_hf_assisted"], ".2f", "x"), f"{ll['identical']}/{ll['checked']}",
            str(dv["numerical_tie"]), str(dv["mismatch"] + dv["unclassified"]),
        ))
    depth = max((len(s["per_depth_acceptance"]) for _, s in rows), default=0)
    dtable = [("category", *[f"d{d}" for d in range(depth)])]
    for name, s in rows:
        accs = s["per_depth_acceptance"]
        dtable.append((name, *[format_cell(accs[d], ".3f") if d < len(accs) else "-" for d in range(depth)]))
    env = report.get("env") or {}
    head = [f"device: {env.get('device', '?')}  commit: {env.get('git_commit') or '?'}"]
    legend = ("mal = mean accepted length (tokens per target forward); rates are tokens/s; hfs = transformers "
              "static cache + compile; tie/mism = greedy divergences classified numerical_tie / mismatch")
    return "\n".join(head + render_table(table) + ["", "acceptance by draft depth"] + render_table(dtable)
                     + ["", legend] + divergence_lines(report["records"])) + "\n"


def budget_line(report: dict) -> str:
    """One line with the adaptive engine's mean tree budget (nodes per step) per batch size ("" without one)."""
    parts = [f"batch {e['batch_size']}: {e['mean_budget']:.2f}" for e in report.get("sweep", [])
             if e.get("mean_budget") is not None]
    return f"adaptive tree budget (mean nodes per step): {', '.join(parts)}\n" if parts else ""


def render_table(t: list[tuple[str, ...]]) -> list[str]:
    """Rows of strings as aligned lines (first column left-aligned), a rule under the header."""
    widths = [max(len(r[i]) for r in t) for i in range(len(t[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in t]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def divergence_lines(records: Iterable[dict]) -> list[str]:
    """One line per greedy divergence class: ``numerical_tie on: id@position, ...`` (empty if none)."""
    by_class: dict[str, list[str]] = {}
    for rec in records:
        if not rec["greedy"] or list(rec["spec"]["token_ids"]) == list(rec["target_only"]["token_ids"]):
            continue
        div = rec.get("divergence")
        cls = div["class"] if div else "unclassified"
        pos = f"@{div['position']}" if div else ""
        by_class.setdefault(cls, []).append(f"{rec['id']}{pos}")
    label = {"numerical_tie": "numerical_tie (bf16 rounding) on", "mismatch": "lossless MISMATCH on",
             "unclassified": "lossless MISMATCH (unclassified) on"}
    return [f"{label[c]}: {', '.join(ids)}" for c, ids in sorted(by_class.items())]


def write_json(report: dict, path: str | Path, allow_nan: bool = False) -> Path:
    """Write ``report`` as indented JSON (creating parent dirs, replacing atomically: a failed write leaves neither
    a partial file nor its temporary one); returns the path. ``allow_nan``: inf and nan written as JavaScript's
    Infinity and NaN (ValueError otherwise)."""
    path = Path(path)
    text = json.dumps(report, indent=2, allow_nan=allow_nan) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_file():
            tmp.unlink()
        raise
    return path


# ----------------------------------------------------------------------------------- environment


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fp:
            for line in fp:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def environment_info() -> dict:
    """Describe where the benchmark ran; never raises.

    Keys: ``device`` (CUDA device name, else CPU model), ``cuda`` (CUDA version or None),
    ``torch``/``triton``/``transformers`` (installed versions or None), ``git_commit`` (HEAD of the
    checkout holding this package; outside a checkout, e.g. an installed wheel, the ``SPECDEC_GIT_COMMIT``
    environment variable, else None), ``git_dirty`` (bool or None),
    ``python``, ``platform``, ``date`` (UTC, ISO).
    """
    device, cuda = None, None
    try:
        import torch

        cuda = torch.version.cuda
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except Exception:  # environment probing must never fail the benchmark
        pass
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    commit = commit or os.environ.get("SPECDEC_GIT_COMMIT") or None
    return {
        "device": device or _cpu_name(),
        "cuda": cuda,
        "torch": _version("torch"),
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
