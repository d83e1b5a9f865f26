"""Charts from a run's metrics.jsonl, or several runs overlaid.

    jrl plot RUN_DIR_OR_JSONL [--out DIR] [--per-panel]
    jrl plot RUN_A RUN_B ... [--out DIR]          # overlay: one line per run

Writes <out>/metrics.png, a grid with one panel per chart below whose metrics are present, and
with --per-panel also <out>/<panel>.png for each. Panels with none of their metrics in the file
are skipped with a note. Default <out>: <run dir>/plots (overlay: <first run's parent>/overlay).
With several runs, each panel draws every run (labelled by its directory name) in its own colour,
one line style per metric. Needs matplotlib (imported only here).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from typing import Any, NamedTuple, Sequence

from jrl.metrics import METRICS_FILENAME, names, read_metrics


class Panel(NamedTuple):
    slug: str  # file name of the per-panel PNG
    title: str
    metrics: tuple[str, ...]
    # "symlog" for quantities that are exactly 0 in a healthy run and span decades otherwise;
    # "log" (overlays) for times whose first step also compiles.
    scale: str = "linear"
    # "step", or "wall": training time in seconds, the sum of time/step_s after the first step
    # (the first step of a run also compiles; it is drawn at 0).
    x: str = "step"


PANELS = (
    Panel("reward", "Reward (mean)", (names.ROLLOUT_REWARD_MEAN,)),
    Panel(
        "eval_accuracy",
        "Eval accuracy",
        (names.EVAL_ACCURACY, names.EVAL_ACCURACY_GREEDY, names.EVAL_ACCURACY_SAMPLED,
         names.EVAL_ACCURACY_GREEDY_LAST_NUMBER),
    ),
    Panel("entropy", "Entropy (token mean)", (names.TRAIN_ENTROPY,)),
    Panel("ref_kl", "KL to reference", (names.TRAIN_REF_KL,)),
    Panel("response_len", "Response length (tokens)", (names.ROLLOUT_RESPONSE_LEN_MEAN,)),
    Panel("truncated", "Truncated fraction", (names.ROLLOUT_TRUNCATED_FRAC,)),
    Panel(
        "zero_spread_groups",
        "Zero-spread groups",
        (names.ROLLOUT_ZERO_STD_GROUPS_ALL_CORRECT, names.ROLLOUT_ZERO_STD_GROUPS_ALL_WRONG),
    ),
    Panel("grad_norm", "Gradient norm", (names.TRAIN_GRAD_NORM,)),
    Panel(
        "clip_fractions",
        "Clip fractions",
        (names.TRAIN_PG_CLIPFRAC_LOW, names.TRAIN_PG_CLIPFRAC_HIGH),
    ),
    Panel(
        "tools",
        "Tool use (multi-turn episodes)",
        (names.ROLLOUT_TOOL_CALLS_MEAN, names.EVAL_TOOL_CALLS_MEAN, names.ROLLOUT_TURNS_MEAN,
         names.ROLLOUT_OBSERVATION_TOKEN_FRAC),
    ),
    Panel(
        "mismatch",
        "Sampler/trainer mismatch",
        (
            names.MISMATCH_LOGPROB_ABS_DIFF_MAX,
            names.MISMATCH_NUMERICAL_ABS,
            names.MISMATCH_STALENESS_ABS,
        ),
        scale="symlog",
    ),
)


def metric_labels(metrics: Sequence[str]) -> dict[str, str]:
    """Legend label of each metric of a panel: its last part ("reward_mean"), or its full name
    where two of the panel's metrics share a last part (rollout/ and eval/tool_calls_mean)."""
    last = [name.split("/")[-1] for name in metrics]
    return {name: part if last.count(part) == 1 else name for name, part in zip(metrics, last)}


def resolve_metrics_path(run_dir_or_jsonl: str) -> str:
    """The jsonl file named, or <dir>/metrics.jsonl for a directory; FileNotFoundError if none."""
    path = run_dir_or_jsonl
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILENAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"jrl.cli.plot: no metrics file at {path!r}; pass a run directory containing "
            f"{METRICS_FILENAME} "
            "or the path of a .jsonl file."
        )
    return path


def collect_series(records: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric name: (steps, values)} over the records, numeric values only (None/strings skipped).

    NaN and inf stay in the series (matplotlib leaves a gap); if a step has several values for a
    metric (a resumed run that was not truncated), the last one written wins.
    """
    by_name: dict[str, dict[int, float]] = {}
    for record in records:
        step = int(record["step"])
        for name, value in record.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            by_name.setdefault(name, {})[step] = float(value)
    return {
        name: (sorted(values), [values[s] for s in sorted(values)])
        for name, values in by_name.items()
    }


def plan_panels(series: dict[str, Any]) -> tuple[list[Panel], list[str]]:
    """(panels with at least one metric present, notes on skipped panels and missing metrics)."""
    present, notes = [], []
    for panel in PANELS:
        found = [name for name in panel.metrics if name in series]
        if not found:
            notes.append(
                f"skipped panel {panel.slug!r}: none of {list(panel.metrics)} is in the file"
            )
            continue
        missing = [name for name in panel.metrics if name not in series]
        if missing:
            notes.append(f"panel {panel.slug!r}: missing {missing}")
        present.append(panel)
    return present, notes


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "jrl.cli.plot needs matplotlib, which is not installed; "
            "install it with `pip install matplotlib`."
        ) from error
    matplotlib.use("Agg")  # files only; no display needed (headless machines, CI)
    import matplotlib.pyplot as plt

    return plt


def _draw(axis: Any, panel: Panel, series: dict[str, tuple[list[int], list[float]]]) -> None:
    # Distinct line styles keep equal series visible (mismatch metrics are often all exactly 0).
    for name, linestyle in zip(panel.metrics, itertools.cycle(("-", "--", ":"))):
        if name in series:
            steps, values = series[name]
            axis.plot(
                steps,
                values,
                label=name,
                linestyle=linestyle,
                marker="." if len(steps) < 50 else None,
            )
    axis.set_title(panel.title)
    axis.set_xlabel("step")
    if panel.scale == "symlog":
        axis.set_yscale("symlog", linthresh=1e-8)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize="small")


def plot_metrics(
    records: Sequence[dict[str, Any]],
    out_dir: str,
    *,
    per_panel: bool = False,
    title: str | None = None,
) -> tuple[list[str], list[str]]:
    """Writes the PNGs for `records` into out_dir; returns (paths written, notes on skipped ones).

    Raises ImportError if matplotlib is missing and ValueError if no panel has any metric.
    """
    series = collect_series(records)
    panels, notes = plan_panels(series)
    if not panels:
        raise ValueError(
            f"jrl.cli.plot: none of the plotted metrics is in the records "
            f"(found: {sorted(series)}); "
            f"plotted metrics: {[name for panel in PANELS for name in panel.metrics]}."
        )
    plt = _import_pyplot()
    os.makedirs(out_dir, exist_ok=True)
    written = []
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
    for axis, panel in zip(axes.flat, panels, strict=False):
        _draw(axis, panel, series)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    grid_path = os.path.join(out_dir, "metrics.png")
    figure.savefig(grid_path, dpi=100)
    plt.close(figure)
    written.append(grid_path)
    if per_panel:
        for panel in panels:
            figure, axis = plt.subplots(figsize=(6, 4))
            _draw(axis, panel, series)
            figure.tight_layout()
            path = os.path.join(out_dir, f"{panel.slug}.png")
            figure.savefig(path, dpi=100)
            plt.close(figure)
            written.append(path)
    return written, notes


def wall_clock(series: dict[str, tuple[list[int], list[float]]]) -> dict[int, float]:
    """step -> seconds of training from the end of the first logged step to the end of this one
    (cumulative time/step_s). The first step, which also compiles, counts as 0."""
    steps, seconds = series.get(names.TIME_STEP_S, ([], []))
    total, out = 0.0, {}
    for i, (step, value) in enumerate(zip(steps, seconds)):
        total += value if i else 0.0
        out[step] = total
    return out


def plot_overlay(
    runs: dict[str, Sequence[dict[str, Any]]],
    out_path: str,
    panels: Sequence[Panel] = PANELS,
    *,
    title: str | None = None,
) -> tuple[str, list[str]]:
    """One grid overlaying several runs ({label: records}); returns (path written, notes).

    A panel is drawn when any run has any of its metrics; a run without one is noted.
    """
    by_run = {label: collect_series(records) for label, records in runs.items()}
    drawn, notes = [], []
    for panel in panels:
        having = [label for label, series in by_run.items()
                  if any(name in series for name in panel.metrics)]
        if not having:
            notes.append(f"skipped panel {panel.slug!r}: no run has {list(panel.metrics)}")
            continue
        for label in by_run:
            if label not in having:
                notes.append(f"panel {panel.slug!r}: run {label!r} has none of its metrics")
        drawn.append(panel)
    if not drawn:
        raise ValueError("jrl.cli.plot: no panel has a metric in any of the runs")
    plt = _import_pyplot()
    columns = min(3, len(drawn))
    rows = math.ceil(len(drawn) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, panel in zip(axes.flat, drawn, strict=False):
        for (label, series), colour in zip(by_run.items(), itertools.cycle(colours)):
            clock = wall_clock(series) if panel.x == "wall" else None
            suffixes = metric_labels(panel.metrics)
            for name, linestyle in zip(panel.metrics, itertools.cycle(("-", "--", ":", "-."))):
                if name not in series:
                    continue
                steps, values = series[name]
                xs = [clock.get(step, math.nan) for step in steps] if clock else steps
                suffix = f" {suffixes[name]}" if len(panel.metrics) > 1 else ""
                axis.plot(xs, values, color=colour, linestyle=linestyle, label=label + suffix,
                          marker="." if len(steps) < 30 else None)
        axis.set_title(panel.title)
        axis.set_xlabel("training time (s)" if panel.x == "wall" else "step")
        if panel.scale in ("symlog", "log"):
            axis.set_yscale(panel.scale, **({"linthresh": 1e-8} if panel.scale == "symlog"
                                            else {}))
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="x-small")
    for axis in list(axes.flat)[len(drawn):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    figure.savefig(out_path, dpi=90)
    plt.close(figure)
    return out_path, notes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jrl plot", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument(
        "run", nargs="+",
        help=f"a run directory (containing {METRICS_FILENAME}) or a metrics .jsonl file; "
             "several: overlaid"
    )
    parser.add_argument("--out", default=None, help="output directory (default: <run dir>/plots)")
    parser.add_argument("--per-panel", action="store_true", help="also write one PNG per panel")
    args = parser.parse_args(argv)
    if len(args.run) > 1:
        paths = [resolve_metrics_path(run) for run in args.run]
        labels = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
        out_dir = args.out or os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(paths[0]))), "overlay")
        written, notes = plot_overlay({label: read_metrics(p) for label, p in zip(labels, paths)},
                                      os.path.join(out_dir, "metrics.png"))
        for note in notes:
            print(f"note: {note}")
        print(f"wrote {written}")
        return 0
    path = resolve_metrics_path(args.run[0])
    out_dir = args.out or os.path.join(os.path.dirname(os.path.abspath(path)), "plots")
    written, notes = plot_metrics(read_metrics(path), out_dir, per_panel=args.per_panel, title=path)
    for note in notes:
        print(f"note: {note}")
    for written_path in written:
        print(f"wrote {written_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
