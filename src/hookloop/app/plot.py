"""``hookloop plot RUN_DIR... [--out FILE] [--log-scale]``: training curves as a PNG.

Reads each run's ``metrics.jsonl`` and draws, on one figure, the panels for
which some run has data:

- loss: train ``loss`` (solid) and evaluation ``eval_loss`` (dashed, dots);
  ``--log-scale`` puts it on a log axis;
- learning rate (``lr``), on a log axis when it spans more than a decade;
- gradient norm (``grad_norm``: the total norm before clipping, when clipping is on);
- throughput: tokens/s or samples/s when a callback logged them
  (``tok_per_sec``, ``samples_per_sec``, ...), otherwise optimizer steps/s
  worked out from the records' timestamps;
- model FLOPs utilisation (``mfu``) and peak memory (``peak_mem_mib``) when logged;
- one heatmap per family of per-parameter norms (``grad_norm/<param>``,
  ``param_norm/<param>``, ``spectral_norm/<param>``, ``weight_norm/<param>``;
  a ``<family>/total`` key is left out): parameter by step, colour is log10 of
  the norm (from the first run that has them).

Several runs are overlaid, one colour each, with the run directory's name in
the legend. A run made by ``hookloop train --branch RUN@STEP`` has a dash-dot line at
STEP in its colour on every panel (:func:`branch_marks`); when its parent is plotted
too, its loss and learning-rate curves start at the parent's record of that step, so the
branch visibly leaves the parent's whole curve there. Noisy curves (many points) are
drawn faint with a centred moving average on top (not the learning rate, which is
exact). The default output is ``<first run>/plots/metrics.png``.

matplotlib is used through its object API with the Agg canvas, so plotting
never changes the backend of an interactive session.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.app.branch import read_origin
from hookloop.callbacks.jsonlog import numeric_metrics, read_jsonl
from hookloop.errors import ConfigError
from hookloop.rundir import METRICS_FILE, RunDir

#: Key families drawn as parameter-by-step heatmaps.
NORM_FAMILIES = ("grad_norm/", "param_norm/", "spectral_norm/", "weight_norm/")

_TOKENS = re.compile(r"^(tok|tokens?)(_per_|/|_)(s|sec|second)$|^tokens?_?per_?s(ec)?$|^tps$")
_SAMPLES = re.compile(r"^(samples?)(_per_|/|_)(s|sec|second)$|^samples?_?per_?s(ec)?$")


@dataclass
class RunData:
    """One run's records, split by kind, each sorted by step with one record per step."""

    name: str
    path: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    eval: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    #: Live ``set`` changes (one record per key), in order.
    changes: list[dict[str, Any]] = field(default_factory=list)
    #: For a branch: (the parent's run directory, resolved; the step it branched at).
    branched_from: tuple[str, int] | None = None

    def series(self, key: str, kind: str = "train") -> tuple[list[int], list[float]]:
        steps, values = [], []
        for record in self.train if kind == "train" else self.eval:
            value = numeric_metrics({key: record.get(key)}).get(key)
            if value is not None and math.isfinite(value):
                steps.append(record["step"])
                values.append(value)
        return steps, values

    def metric_keys(self) -> list[str]:
        """Every key of the train records, in the order they first appear."""
        return list(dict.fromkeys(k for r in self.train for k in r))


def load_run(path: str | Path) -> RunData:
    """Read a run directory (or a metrics.jsonl file) for plotting."""
    path = Path(path)
    metrics = path if path.is_file() else RunDir(path).metrics
    if not metrics.is_file():
        raise ConfigError(f"{path} has no {METRICS_FILE}: is it a hookloop run directory?")
    run = RunData(name=(metrics.parent if path.is_file() else path).resolve().name, path=path)
    by_kind: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "eval": {}}
    try:
        records = read_jsonl(metrics)
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{metrics} is not UTF-8 text (byte {err.start}: {err.reason}); a hookloop metrics "
            "log is JSON Lines in UTF-8"
        ) from None
    for record in records:
        kind, step = record.get("kind"), record.get("step")
        if kind == "start":
            run.starts.append(record)
        elif kind == "set" and isinstance(step, int):
            run.changes.append(record)
        elif kind in by_kind and isinstance(step, int):
            by_kind[kind][step] = record  # the later record of a step wins
    run.train = [by_kind["train"][s] for s in sorted(by_kind["train"])]
    run.eval = [by_kind["eval"][s] for s in sorted(by_kind["eval"])]
    origin = None if path.is_file() else read_origin(path)
    if origin is not None:
        run.branched_from = (str(Path(origin.run).resolve()), origin.step)
    return run


@dataclass(frozen=True)
class BranchMark:
    """Where a plotted branch left its parent: drawn as a dash-dot line at ``step``."""

    run: str  #: the branch's name in the legend
    parent: str  #: the parent's directory name
    step: int
    parent_plotted: bool  #: whether the parent's curve is on the figure too

    @property
    def label(self) -> str:
        return f"{self.run}: branch of {self.parent} at step {self.step}"


def branch_marks(runs: list[RunData]) -> list[BranchMark | None]:
    """For each run (in order), where it branched from its parent; None for a run that is
    no branch. Each branch plotted with its parent starts its train curves at the
    parent's record of the branch step (the weights are the same there)."""
    plotted = {str(run.path.resolve()): run for run in runs}
    marks: list[BranchMark | None] = []
    for run in runs:
        if run.branched_from is None:
            marks.append(None)
            continue
        parent_path, step = run.branched_from
        parent = plotted.get(parent_path)
        marks.append(BranchMark(run.name, Path(parent_path).name, step, parent is not None))
        at_step = [r for r in parent.train if r["step"] == step] if parent else []
        if at_step and not any(r["step"] <= step for r in run.train):
            run.train.insert(0, at_step[0])
    return marks


def _mark_branches(ax: Any, marks: list[BranchMark | None], colors: list[Any]) -> None:
    """A dash-dot vertical line at each branch's step, in the branch's colour; its gid is
    the mark's label."""
    for mark, color in zip(marks, colors, strict=True):
        if mark is not None:
            line = ax.axvline(mark.step, color=color, linestyle="-.", linewidth=1.2, alpha=0.9)
            line.set_gid(mark.label)


def _throughput(run: RunData) -> tuple[str, list[int], list[float]] | None:
    """(label, steps, values): logged tokens/s or samples/s, else steps/s from timestamps."""
    keys = run.metric_keys()
    for pattern, label in ((_TOKENS, "tokens/s"), (_SAMPLES, "samples/s")):
        found = sorted(k for k in keys if pattern.match(k.lower()))
        if found:
            steps, values = run.series(found[0])
            if steps:
                return label, steps, values
    # Between consecutive records of one session only: a resume restarts the clock.
    starts = sorted(s["time"] for s in run.starts if isinstance(s.get("time"), (int, float)))
    steps, values = [], []
    for prev, cur in itertools.pairwise(run.train):
        t0, t1 = prev.get("time"), cur.get("time")
        if not isinstance(t0, (int, float)) or not isinstance(t1, (int, float)) or t1 <= t0:
            continue
        if any(t0 < s <= t1 for s in starts):
            continue
        steps.append(cur["step"])
        values.append((cur["step"] - prev["step"]) / (t1 - t0))
    return ("steps/s", steps, values) if steps else None


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Centred moving average (the window shrinks at the ends), so the curve does not lag."""
    half = window // 2
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def _draw(
    ax: Any, steps: list[int], values: list[float], color: Any, label: str, smooth: bool = True
) -> None:
    """A line; many noisy points are drawn faint, with a centred moving average on top."""
    if smooth and len(values) > 40:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        window = max(3, len(values) // 30) | 1
        ax.plot(steps, _rolling_mean(values, window), color=color, label=label)
    else:
        ax.plot(steps, values, color=color, label=label, marker="." if len(values) < 15 else "")


def _style(ax: Any, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=11, fontweight="bold", loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.spines[["top", "right"]].set_visible(False)


def _panels(runs: list[RunData], log_scale: bool) -> list[tuple[str, Any]]:
    """(title, draw(ax, colors)) for each panel that has data, in display order."""
    panels: list[tuple[str, Any]] = []
    many = len(runs) > 1

    def label(run: RunData, what: str) -> str:
        return f"{run.name} {what}" if many else what

    if any(r.series("loss")[0] or r.series("eval_loss", "eval")[0] for r in runs):

        def loss(ax: Any, colors: list[Any]) -> None:
            for run, color in zip(runs, colors, strict=True):
                steps, values = run.series("loss")
                if steps:
                    _draw(ax, steps, values, color, label(run, "train"))
                steps, values = run.series("eval_loss", "eval")
                if steps:
                    ax.plot(steps, values, color=color, linestyle="--", marker="o",
                            markersize=4, label=label(run, "eval"))  # fmt: skip
            if log_scale:
                ax.set_yscale("log")
            _style(ax, "Loss" + (" (log scale)" if log_scale else ""), "loss")
            ax.legend(fontsize=8, frameon=False)

        panels.append(("loss", loss))

    panels += _simple_panels(runs, (("lr", "Learning rate", "lr"),
                                    ("grad_norm", "Gradient norm", "total L2 norm")))  # fmt: skip
    throughput = [(run, _throughput(run)) for run in runs]
    if any(t for _, t in throughput):
        units = {t[0] for _, t in throughput if t}

        def speed(ax: Any, colors: list[Any]) -> None:
            for (run, found), color in zip(throughput, colors, strict=True):
                if found:
                    unit, steps, values = found
                    _draw(ax, steps, values, color, f"{run.name} ({unit})" if many else unit)
            ax.set_ylim(bottom=0)
            _style(ax, "Throughput", " / ".join(sorted(units)))
            if many or len(units) > 1:
                ax.legend(fontsize=8, frameon=False)

        panels.append(("throughput", speed))
    panels += _simple_panels(runs, (("mfu", "Model FLOPs utilisation", "fraction of peak"),
                                    ("peak_mem_mib", "Peak memory", "MiB")))  # fmt: skip
    return panels


def _simple_panels(runs: list[RunData], specs: tuple[tuple[str, str, str], ...]) -> list:
    """One line per run for each train-log ``key`` that some run has."""
    panels = []
    for key, title, ylabel in specs:
        if not any(r.series(key)[0] for r in runs):
            continue

        def simple(ax: Any, colors: list[Any], key: str = key, title: str = title,
                   ylabel: str = ylabel) -> None:  # fmt: skip
            top = bottom = None
            for run, color in zip(runs, colors, strict=True):
                steps, values = run.series(key)
                if steps:
                    _draw(ax, steps, values, color, run.name, smooth=key != "lr")
                    positive = [v for v in values if v > 0]
                    if positive:
                        top = max(top or 0.0, max(positive))
                        bottom = min(bottom or math.inf, min(positive))
            if key == "lr" and top and bottom and top / bottom > 10:
                ax.set_yscale("log")
            elif key in ("mfu", "peak_mem_mib") and top:
                ax.set_ylim(0, top * 1.08)  # a fraction or a size: show it against zero
            _style(ax, title, ylabel)
            if len(runs) > 1:
                ax.legend(fontsize=8, frameon=False)

        panels.append((key, simple))
    return panels


def _mark_changes(ax: Any, runs: list[RunData], colors: list[Any], *, label: bool) -> None:
    """A dotted vertical line at each step a live ``set`` changed something (its keys and
    new values written at the top of the first panel); the line's gid says what changed."""
    for run, color in zip(runs, colors, strict=True):
        by_step: dict[int, list[str]] = {}
        for change in run.changes:
            by_step.setdefault(change["step"], []).append(
                f"{change.get('key')}={change.get('new')}"
            )
        for step, what in by_step.items():
            text = ", ".join(what)
            line = ax.axvline(step, color=color, linestyle=":", linewidth=1.2, alpha=0.8)
            line.set_gid(f"live change at step {step}: {text}")
            if label:
                ax.annotate(text, (step, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                            rotation=90, va="top", ha="right", color=color)  # fmt: skip


def _heatmaps(runs: list[RunData]) -> list[tuple[RunData, str, list[str]]]:
    """(run, family, parameter keys) for each norm family, from the first run that has it."""
    found = []
    for family in NORM_FAMILIES:
        for run in runs:
            keys = [k for k in run.metric_keys() if k.startswith(family) and k != family + "total"]
            if keys:
                found.append((run, family, keys))
                break
    return found


def _draw_heatmap(fig: Any, ax: Any, run: RunData, family: str, keys: list[str]) -> None:
    np = require("numpy", extra="plot", feature="hookloop plot")
    rows = [r for r in run.train if any(k in r for k in keys)]
    grid = np.full((len(keys), len(rows)), np.nan)
    for j, record in enumerate(rows):
        values = numeric_metrics({k: record.get(k) for k in keys})
        for i, key in enumerate(keys):
            value = values.get(key)
            if value is not None and value > 0 and math.isfinite(value):
                grid[i, j] = math.log10(value)
    steps = [r["step"] for r in rows]
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(keys) - 0.5, -0.5))  # fmt: skip
    names = [k[len(family) :] for k in keys]
    if len(names) > 40:  # label every n-th parameter so the names stay legible
        every = math.ceil(len(names) / 40)
        ax.set_yticks(range(0, len(names), every), names[::every], fontsize=7)
    else:
        ax.set_yticks(range(len(names)), names, fontsize=7)
    bar = fig.colorbar(image, ax=ax, pad=0.01)
    bar.set_label("log10 norm")
    title = family.rstrip("/").replace("_", " ")
    ax.set_title(f"Per-parameter {title} ({run.name})", fontsize=11, fontweight="bold", loc="left")
    ax.set_xlabel("step")


def make_figure(run_dirs: list[str | Path], *, log_scale: bool = False) -> Any:
    """The matplotlib ``Figure`` for ``run_dirs`` (not saved; see :func:`plot_runs`)."""
    if not run_dirs:
        raise ConfigError("give at least one run directory")
    require("matplotlib", extra="plot", feature="hookloop plot")
    from matplotlib.figure import Figure

    runs = [load_run(p) for p in run_dirs]
    marks = branch_marks(runs)
    panels = _panels(runs, log_scale)
    heatmaps = _heatmaps(runs)
    if not panels and not heatmaps:
        raise ConfigError(
            "nothing to plot: no train or eval records with numbers in "
            + ", ".join(str(p) for p in run_dirs)
        )
    cols = 2 if len(panels) > 1 else 1
    panel_rows = math.ceil(len(panels) / cols)
    heights = [3.4] * panel_rows + [max(2.6, 0.22 * len(k) + 1.2) for _, _, k in heatmaps]
    fig = Figure(figsize=(13 if cols == 2 else 8, sum(heights) + 0.8), layout="constrained")
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for n, (_, draw) in enumerate(panels):
        row, col = divmod(n, cols)
        ax = fig.add_subplot(grid[row, col])
        draw(ax, colors)
        _mark_changes(ax, runs, colors, label=n == 0)
        _mark_branches(ax, marks, colors)
    for n, (run, family, keys) in enumerate(heatmaps):
        _draw_heatmap(fig, fig.add_subplot(grid[panel_rows + n, :]), run, family, keys)
    names = ", ".join(r.name for r in runs)
    fig.suptitle(names if len(names) < 120 else f"{len(runs)} runs", fontsize=13)
    return fig


def plot_runs(
    run_dirs: list[str | Path], out: str | Path | None = None, *, log_scale: bool = False
) -> Path:
    """Draw the figure for ``run_dirs`` and save it as a PNG; return its path.

    ``out`` defaults to ``<first run>/plots/metrics.png``; a directory gets ``metrics.png``.
    """
    fig = make_figure(run_dirs, log_scale=log_scale)
    target = Path(out) if out is not None else RunDir(run_dirs[0]).plots / "metrics.png"
    if target.is_dir():
        target = target / "metrics.png"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=110, format="png")
    except (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
        raise ConfigError(f"cannot write {target}: {err.strerror}; choose another --out") from None
    return target


# -- the command -----------------------------------------------------------------


def add_plot_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop plot RUN_DIR... [--out FILE] [--log-scale]`` to argparse sub-parsers."""
    parser = subparsers.add_parser("plot", help="draw training curves of runs as a PNG")
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="run directories to overlay, or one `hookloop tune` study directory",
    )
    parser.add_argument("--out", help="PNG file to write (default: <first run>/plots/metrics.png)")
    parser.add_argument("--log-scale", action="store_true", help="loss on a log axis")
    parser.set_defaults(run=main_plot)
    return parser


def main_plot(args: argparse.Namespace) -> int:
    """Write the figure and print its path; bad input raises ValueError."""
    from hookloop.tune.study import is_study_dir

    if len(args.runs) == 1 and is_study_dir(args.runs[0]):  # a `hookloop tune` study
        from hookloop.tune.report import plot_study

        for written in plot_study(args.runs[0], args.out):
            print(written)
        return 0
    try:
        path = plot_runs(args.runs, args.out, log_scale=args.log_scale)
    except ImportError as err:  # matplotlib missing: a one-line error naming the extra
        raise ConfigError(str(err)) from err
    print(path)
    return 0
