"""PNG figures of a ``specdec bench`` report (matplotlib's Agg canvas: no display, no pyplot state)."""

from __future__ import annotations

from pathlib import Path

SWEEP_SERIES = (("speculative", "spec_tokens_per_s", "tab:blue", "o"),
                ("target-only", "target_only_tokens_per_s", "tab:green", "s"),
                ("transformers", "hf_tokens_per_s", "tab:orange", "^"),
                ("transformers static+compile", "hf_static_tokens_per_s", "tab:red", "v"))


def _figure(width: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


MARKERS, LINESTYLES = ("o", "s", "^", "v", "D", "P"), ("-", "--", ":", "-.")


def setup_line(report: dict) -> str:
    """What a figure shows, for its title: target, draft, tree, device, dtype and date of the report's run."""
    cfg, env = report.get("config") or {}, report.get("env") or {}
    parts = [f"target {cfg.get('model') or cfg.get('target') or '?'}", f"draft {cfg.get('draft') or '?'}",
             f"tree {cfg.get('tree') or '?'}", f"{env.get('device') or cfg.get('device') or '?'}",
             f"{cfg.get('dtype') or '?'}", env.get("date") or "?"]
    return " | ".join(str(p) for p in parts)


def _depth_axis(ax, curves: list[tuple[str, list[float | None]]]) -> None:
    """Acceptance by draft depth: bars for one curve, lines for several (one per batch size), each with its own
    marker and dash and shifted a little along the depth axis, so equal curves do not hide each other."""
    if len(curves) == 1:
        accs = curves[0][1]
        ax.bar(range(len(accs)), [a or 0.0 for a in accs], color="tab:blue")
    else:
        shift = 0.3 / len(curves)
        for i, (label, accs) in enumerate(curves):
            xs = [d + (i - (len(curves) - 1) / 2) * shift for d in range(len(accs))]
            ax.plot(xs, [a if a is not None else float("nan") for a in accs], marker=MARKERS[i % len(MARKERS)],
                    linestyle=LINESTYLES[i % len(LINESTYLES)], markersize=5, label=label)
        ax.legend(fontsize=8)
    depth = max(len(a) for _, a in curves)
    ax.set_xticks(range(depth), [str(d) for d in range(depth)])
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate")
    ax.set_title("Acceptance by draft depth")


def plot_report(report: dict, path: str | Path) -> Path:
    """Save one PNG and return its path.

    With one batch size: acceptance by draft depth (left) and speedup per category (right).  With
    several (``report["sweep"]`` longer than 1): tokens/s against batch size for speculative,
    target-only and both transformers configurations (log-log; unmeasured series left out), next to
    acceptance by depth per batch size.  Missing values (None) are drawn as empty bars / gaps.
    """
    sweep = report.get("sweep") or []
    if len(sweep) > 1:
        return plot_sweep(sweep, path, setup_line(report))
    fig = _figure(11)
    fig.suptitle(setup_line(report), fontsize=9)
    ax_d, ax_s = fig.subplots(1, 2)
    _depth_axis(ax_d, [("overall", report["per_depth_acceptance"])])
    names = [*report["per_category"], "overall"]
    sums = [*report["per_category"].values(), report["overall"]]
    series = [("vs target-only", "speedup", "tab:green"), ("vs HF", "speedup_vs_hf", "tab:orange"),
              ("vs HF static+compile", "speedup_vs_hf_static", "tab:purple"),
              ("vs HF assisted", "speedup_vs_hf_assisted", "tab:red")]
    series = [s for s in series if any(x.get(s[1]) is not None for x in sums)] or series[:1]
    width = 0.8 / len(series)
    for i, (label, key, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        ax_s.bar(xs, [x.get(key) or 0.0 for x in sums], width=width, label=label, color=color)
    ax_s.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    ax_s.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax_s.set_ylabel("speedup (x)")
    ax_s.set_title("Speculative decoding speedup per category")
    ax_s.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(sweep: list[dict], path: str | Path, setup: str = "") -> Path:
    """Tokens/s against batch size (left) and acceptance by depth per batch size (right), titled ``setup``
    (``setup_line``); returns the path."""
    fig = _figure(12)
    if setup:
        fig.suptitle(setup, fontsize=9)
    ax_t, ax_d = fig.subplots(1, 2)
    sizes = [e["batch_size"] for e in sweep]
    for label, key, color, marker in SWEEP_SERIES:
        ys = [e.get(key) for e in sweep]
        if all(y is None for y in ys):
            continue
        ax_t.plot(sizes, [y if y is not None else float("nan") for y in ys], label=label, color=color, marker=marker)
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_minor_locator(LogLocator(base=10, subs=(2, 5)))
    for axis_formatter in (ax_t.yaxis.set_major_formatter, ax_t.yaxis.set_minor_formatter):
        axis_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_t.set_xticks(sizes, [str(b) for b in sizes])
    ax_t.set_xlabel("batch size")
    ax_t.set_ylabel("output tokens/s")
    ax_t.set_title("Throughput against batch size")
    ax_t.legend(fontsize=8)
    ax_t.grid(True, which="both", alpha=0.3)
    _depth_axis(ax_d, [(f"batch {e['batch_size']}", e["per_depth_acceptance"]) for e in sweep])
    return _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.benchmark.plot OUT.png REPORT.json [REPORT.json ...] [--json MERGED.json]``:
    plot one report, or join the sweeps of several runs (same prompts and options, other batch
    sizes) into one table, plot and, with ``--json``, one report."""
    import argparse
    import json

    from specdec.benchmark.report import write_json
    from specdec.benchmark.sweep import format_sweep, merge_sweeps

    ap = argparse.ArgumentParser(prog="python -m specdec.benchmark.plot", description=main.__doc__)
    ap.add_argument("png")
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)
    report = merge_sweeps([json.loads(open(p, encoding="utf-8").read()) for p in args.reports])
    print(format_sweep(report), end="")
    if args.json_out:
        write_json(report, args.json_out)
    plot_report(report, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
