"""What ``lopt bench`` writes: the console table, Markdown, JSON (schema in docs/bench.md) and the plots."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import textwrap
from dataclasses import asdict

import torch

import lopt
from lopt.bench.contenders import CONTENDERS
from lopt.bench.curves import NUDGED_RUN, describe_difference
from lopt.bench.measure import Unavailable

SCHEMA_VERSION = 2
ZERO_FLOOR = 1e-12  # where the log-scale difference plot draws identical losses
UNIT = {"step": "ms/step", "iteration": "ms/iter"}


def environment(device: torch.device) -> dict:
    """Where the numbers come from: date, versions, device, commit."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lopt": lopt.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device_type": device.type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception:
        info["cupy"] = None
    # A copy of the tree whose .git is absent or stale (the GPU machine) is told its commit through LOPT_COMMIT.
    info["commit"] = os.environ.get("LOPT_COMMIT") or _git_commit()
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=here).stdout.strip()
        return commit or None
    except Exception:
        return None


def weights_status(weights_by_optimizer: dict) -> str:
    """One line: each optimizer's weights and whether they are pretrained."""
    parts = []
    for name, weights in weights_by_optimizer.items():
        parts.append(f"{name}: {weights.source}" + ("" if weights.pretrained else " (untrained, timing only)"))
    return "; ".join(parts)


def _contender(row) -> str:
    """The row's contender; rows made by scripts with BenchResult's positional fields name only the backend."""
    return row.contender or row.backend


def _row_key(row) -> tuple:
    """Rows (results or unavailable contenders) by parameter set (in first-seen order), AdamW first, then
    each optimizer's contenders in the order of CONTENDERS (other names, e.g. scripts' variants, last)."""
    contender = _contender(row)
    rank = CONTENDERS.index(contender) if contender in CONTENDERS else len(CONTENDERS)
    return (row.optimizer != "adamw", row.optimizer != "muon", row.optimizer, rank, contender)


def _order(rows: list) -> list:
    sets = list(dict.fromkeys(r.param_set for r in rows))
    return sorted(rows, key=lambda r: (sets.index(r.param_set),) + _row_key(r))


def spread(r) -> str:
    """The timed steps' range, ``min-max`` ms ("-" without per-step times)."""
    times = [t for t in (r.ms_all or []) if t is not None and math.isfinite(t)]
    return f"{min(times):.2f}-{max(times):.2f}" if times else "-"


def _cells(r) -> list:
    overhead = "-" if r.overhead_vs_adamw is None or r.optimizer == "adamw" else f"{r.overhead_vs_adamw:+.0f}%"
    return [r.optimizer, f"adamw ({r.backend})" if r.optimizer == "adamw" else _contender(r), r.param_set,
            f"{r.ms_per_step:.2f}", spread(r), overhead,
            "-" if r.launches_per_step is None else str(r.launches_per_step),
            "-" if r.peak_extra_mib is None else f"{r.peak_extra_mib:.0f}",
            "-" if r.max_rel_error_vs_naive is None else f"{r.max_rel_error_vs_naive:.2e}",
            "-" if r.compile_s is None else f"{r.compile_s:.1f}"]


def _header(mode: str) -> list:
    return ["optimizer", "contender", "params", f"{UNIT[mode]} (median)", "min-max", "vs adamw", "launches", "peak MiB",
            "rel.err vs naive", "compile s"]


def _rows_with_footnotes(results: list, unavailable: list, mode: str) -> tuple[list, list]:
    rows, notes = [], []
    for row in _order(list(results) + list(unavailable)):
        if isinstance(row, Unavailable):
            if row.reason not in notes:
                notes.append(row.reason)
            mark = f"not run [{notes.index(row.reason) + 1}]"
            rows.append([row.optimizer, row.contender, row.param_set, mark] + ["-"] * (len(_header(mode)) - 4))
        else:
            rows.append(_cells(row))
    return rows, [f"[{i + 1}] {note}" for i, note in enumerate(notes)]


def format_table(results: list, unavailable: list = (), mode: str = "step") -> str:
    """The console table: one row per contender run, then the ones that did not run and why."""
    rows, notes = _rows_with_footnotes(results, list(unavailable), mode)
    rows = [_header(mode)] + rows
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + notes)


NAIVE_NOTE = ("naive is lopt's readable reference backend (plain PyTorch, phase by phase as the docs define the "
              "math); its time is not what training with lopt costs. Training speed is the fused backend's: a CUDA "
              "GPU with CuPy (pip install -e '.[cuda12]' or '.[cuda13]'); README.md, Speed.")


def naive_note(results: list) -> str | None:
    """What a naive row's overhead means, when the table has naive rows and no fused one (e.g. on a CPU)."""
    contenders = {_contender(r) for r in results if r.optimizer != "adamw"}
    if "naive" in contenders and not contenders & {"fused", "fused-fast"}:
        return "\n".join(textwrap.wrap("Note: " + NAIVE_NOTE, width=110))
    return None


def describe_options(curves: dict) -> str:
    """', lr 0.05, weight_decay 0.01' for the curves' hyperparameters ('' for the optimizers' defaults)."""
    return "".join(f", {name} {value:g}" for name, value in curves.get("options", {}).items())


def format_curves_summary(curves: dict) -> str:
    lines = [f"loss curves: {curves['model']} ({curves['description']}), {curves['steps']} steps{describe_options(curves)}, "
             f"contender {curves['contender']} ({curves['why']})"]
    for name, record in curves["optimizers"].items():
        parts = [f"{label} {describe_difference(value)}" for label, value in record["max_rel_diff_vs_naive"].items()]
        if record["contender_unavailable"]:
            parts.append(f"{curves['contender']} not run: {record['contender_unavailable']}")
        lines.append(f"  {name}: largest relative loss difference vs naive: " + "; ".join(parts))
    return "\n".join(lines)


def markdown(results: list, unavailable: list, mode: str, env: dict, weights_line: str, curves: dict | None) -> str:
    header = _header(mode)
    rows, notes = _rows_with_footnotes(results, list(unavailable), mode)
    lines = [f"# lopt bench ({mode} mode)", "",
             f"{env['device']} · torch {env['torch']} · CuPy {env['cupy'] or '-'} · commit {env['commit'] or '-'} · "
             f"{env['date']}", "", f"Weights: {weights_line}", "",
             "| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    if notes:
        lines += [""] + [f"{note}  " for note in notes]
    if naive_note(results):
        lines += ["", "Note: " + NAIVE_NOTE]
    lines += ["", f"{UNIT[mode]}: the median of the timed steps; min-max: their range (every step's time: the JSON's "
                  f"ms_all)."]
    if curves:
        lines += ["", "## Loss curves", "", format_curves_summary(curves).replace("\n  ", "\n- ")]
    return "\n".join(lines) + "\n"


def _finite_or_none(value):
    """JSON has no NaN or infinity: non-finite floats become null (documented in docs/bench.md)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


def results_json(results: list, unavailable: list, *, mode: str, env: dict, settings: dict, weights: dict,
                 curves: dict | None) -> str:
    payload = {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "environment": env,
        "settings": settings,
        "weights": {name: {"source": w.source, "pretrained": w.pretrained} for name, w in weights.items()},
        "results": [asdict(r) for r in _order(results)],
        "unavailable": [asdict(u) for u in unavailable],
        "curves": curves,
    }
    return json.dumps(_finite_or_none(payload), indent=2, allow_nan=False)


# ---------------------------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    """A matplotlib figure drawn by the Agg canvas (headless; pyplot's global state is not touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def _subtitle(env: dict, weights_line: str) -> str:
    return f"{env['device']} · commit {env['commit'] or '?'} · {env['date'][:16]} UTC\nweights: {weights_line}"


def plot_times(path, results: list, unavailable: list, *, mode: str, env: dict, weights_line: str) -> None:
    """Bars of ms per step (or iteration) per contender and parameter set, log scale; n/a where one did not run."""
    rows = _order(list(results) + list(unavailable))
    param_sets = list(dict.fromkeys(r.param_set for r in rows))
    series = sorted({(r.optimizer, _contender(r)): r for r in rows}.values(), key=_row_key)
    series = [(r.optimizer, _contender(r)) for r in series]
    times = {(r.param_set, r.optimizer, _contender(r)): r.ms_per_step for r in results}
    figure = _figure(max(7.5, 2.0 + 0.5 * len(series) * len(param_sets)), 5.5)
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(len(series), 1)
    colours = {"adamw": "#7f7f7f", "muon": "#8c564b", "naive": "#1f77b4", "naive+compile": "#ff7f0e", "fused": "#2ca02c",
               "fused-fast": "#98df8a"}
    optimizers = list(dict.fromkeys(o for o, _ in series if o not in ("adamw", "muon")))
    lowest = min(times.values(), default=1.0)
    for s, (optimizer, contender) in enumerate(series):
        hatch = "" if optimizer in ("adamw", "muon") else ["", "//", "..", "xx"][optimizers.index(optimizer) % 4]
        label = optimizer if optimizer in ("adamw", "muon") else f"{optimizer} {contender}"
        for x, param_set in enumerate(param_sets):
            position = x - 0.4 + width * (s + 0.5)
            value = times.get((param_set, optimizer, contender))
            if value is None:
                axes.text(position, lowest / 3, f"{label}: n/a", rotation=90, ha="center", va="bottom", fontsize=7,
                          color="#555555")
                continue
            axes.bar(position, value, width * 0.9, color=colours.get(contender, "#9467bd"), hatch=hatch, edgecolor="black",
                     linewidth=0.5, label=label if x == param_sets.index(param_set) and label not in
                     axes.get_legend_handles_labels()[1] else None)
            axes.text(position, value * 1.08, f"{value:.3g}", ha="center", va="bottom", fontsize=7, rotation=90)
    axes.set_yscale("log")
    axes.set_ylim(lowest / 4, max(times.values(), default=10.0) * 8)
    axes.set_xlim(-0.5, len(param_sets) - 0.5)
    axes.set_xticks(range(len(param_sets)), param_sets)
    axes.set_ylabel("ms per optimizer step" if mode == "step"
                    else "ms per iteration (zero_grad + forward + backward + step)")
    axes.set_title(f"lopt bench --mode {mode}", fontsize=11)
    axes.legend(fontsize=7, loc="upper left", ncol=2)
    axes.grid(axis="y", which="both", alpha=0.3)
    figure.text(0.01, 0.005, _subtitle(env, weights_line), fontsize=7, va="bottom")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path)


def plot_curves(path, curves: dict, *, env: dict, weights_line: str) -> None:
    """Per optimizer: the loss curves (top) and each run's relative difference from naive per step (bottom)."""
    names = list(curves["optimizers"])
    figure = _figure(6.0 * len(names), 7.5)
    styles = {"naive": dict(color="#1f77b4", linewidth=2.2), NUDGED_RUN: dict(color="#7f7f7f", linestyle=":"),
              curves["contender"]: dict(color="#d62728", linestyle="--")}
    for column, name in enumerate(names):
        record = curves["optimizers"][name]
        top = figure.add_subplot(2, len(names), column + 1)
        bottom = figure.add_subplot(2, len(names), len(names) + column + 1)
        naive = torch.tensor(record["losses"]["naive"], dtype=torch.float64)
        for label, values in record["losses"].items():
            difference = record["max_rel_diff_vs_naive"].get(label)
            legend = label if label == "naive" else f"{label} (max rel. diff {describe_difference(difference)})"
            top.plot(range(1, len(values) + 1), values, label=legend, **styles.get(label, {}))
            if label != "naive":
                relative = ((torch.tensor(values, dtype=torch.float64) - naive).abs() / naive.abs()).tolist()
                bottom.plot(range(1, len(values) + 1), [max(v, ZERO_FLOOR) if math.isfinite(v) else float("nan")
                                                        for v in relative], label=label, **styles.get(label, {}))
        title = f"{name}: {curves['model']}{describe_options(curves)}, naive vs {curves['contender']}"
        if record["contender_unavailable"]:
            title += f"\n({curves['contender']} not run: {record['contender_unavailable'][:70]})"
        top.set_title(title, fontsize=9)
        top.set_xlabel("step")
        top.set_ylabel("training loss")
        top.legend(fontsize=7)
        top.grid(alpha=0.3)
        bottom.set_yscale("log")
        bottom.set_xlabel("step")
        bottom.set_ylabel(f"|loss − naive loss| / naive loss\n(equal losses drawn at {ZERO_FLOOR:g})")
        bottom.legend(fontsize=7)
        bottom.grid(alpha=0.3, which="both")
    note = (f"contender: {curves['contender']} ({curves['why']}); yardstick: naive with every meta-weight "
            f"× (1 + {curves['nudge']['relative']:g}·N(0,1)), same initialisation and data")
    note = textwrap.fill(note, width=int(105 * len(names)))
    figure.text(0.01, 0.005, _subtitle(env, weights_line) + "\n" + note, fontsize=7, va="bottom")
    figure.tight_layout(rect=(0, 0.11, 1, 1))
    figure.savefig(path)
