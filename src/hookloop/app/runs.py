"""Run directories, and ``hookloop runs``: a table of the runs under a directory.

A run directory is the one given as ``hookloop train --out DIR``, or else a
new ``runs/<recipe>-<YYYYmmdd-HHMMSS>/`` (``-2``, ``-3``, ... appended if that
name is taken); its layout is defined once, in :mod:`hookloop.rundir`.

Every logger rewinds on resume, so after a kill and ``--resume auto`` each step
appears once in metrics.jsonl, in TensorBoard and in W&B.

Run status, as ``hookloop runs`` reports it, comes from metrics.jsonl alone.
Each ``train()`` writes a ``start`` record (with its process id and host) and,
when it ends in an orderly way, an ``end`` record:

- ``finished``: the step or epoch budget was reached;
- ``stopped``: a stop request, a signal, ``exit_interval`` or ``exit_duration``
  ended it after saving (continue with ``--resume auto``);
- ``aborted`` / ``failed`` / ``interrupted``: an abort request, an exception,
  a second Ctrl-C;
- ``running``: no ``end`` record after the last ``start``, and the process
  named in it is alive on this host;
- ``killed``: no ``end`` record, and that process is gone (SIGKILL, out of
  memory, a lost machine). A run started on another host without an ``end``
  record shows as ``killed?`` (it cannot be checked from here); a process id
  reused by an unrelated process makes a dead run look ``running``.

A run made by ``hookloop train --branch RUN@STEP`` names its parent in ``branch.json``
(:mod:`hookloop.app.branch`): the table's ``FROM`` column says ``RUN@STEP``, the branch is
listed under its parent when both are, indented, and ``--json`` carries ``branched_from``
(with ``parent_altered``: what changed in the parent's ``changes.jsonl`` up to the branch
point since the branch was made, or null).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hookloop.app.branch import parent_problem, read_origin
from hookloop.errors import ConfigError
from hookloop.processes import process_alive
from hookloop.result import run_status
from hookloop.rundir import (  # noqa: F401  (re-exported: the layout's names)
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    PARAMS_FILE,
    PLOTS_DIR,
    PROFILE_DIR,
    SAMPLES_FILE,
    TB_DIR,
    WANDB_DIR,
    RunDir,
    read_jsonl,
)


@dataclass
class RunSummary:
    """One row of ``hookloop runs``."""

    name: str
    path: str
    status: str
    step: int
    max_steps: int | None
    best_eval_loss: float | None
    wall_time_s: float
    stop_reason: str | None
    started: float | None  # Unix time of the first start record
    params: dict[str, Any] | None = None  # a `hookloop tune` trial's values (params.yaml)
    #: Live ``set`` changes (metrics.jsonl's ``set`` records): step, key, old, new, client.
    changes: list[dict[str, Any]] | None = None
    #: A branch's parent: ``{run, step, head, records, id, parent_altered}`` (branch.json).
    branched_from: dict[str, Any] | None = None


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` looks like a run directory (it has a metrics log or a config)."""
    return RunDir(path).is_run()


def summarize_run(run_dir: str | Path) -> RunSummary:
    """Read ``<run_dir>/metrics.jsonl`` and say what became of the run."""
    run_dir = Path(run_dir)
    metrics = RunDir(run_dir).metrics
    try:
        records = read_jsonl(metrics) if metrics.is_file() else []
    except UnicodeDecodeError as err:
        raise ConfigError(f"{metrics} is not UTF-8 text (byte {err.start}): unreadable") from None
    segments = _segments(records)
    last = segments[-1] if segments else []
    start = last[0] if last and last[0].get("kind") == "start" else None
    end = next((r for r in reversed(last) if r.get("kind") == "end"), None)
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    eval_losses = [
        float(r["eval_loss"])
        for r in records
        if r.get("kind") == "eval" and isinstance(r.get("eval_loss"), (int, float))
    ]
    starts = [r for r in records if r.get("kind") == "start"]
    return RunSummary(
        name=run_dir.name,
        path=str(run_dir),
        status=_status(last, start, end),
        step=max(steps, default=0),
        max_steps=start.get("max_steps") if start else None,
        best_eval_loss=min(eval_losses, default=None),
        wall_time_s=sum(_duration(seg) for seg in segments),
        stop_reason=end.get("stop_reason") if end else None,
        started=_time(starts[0]) if starts else (_time(records[0]) if records else None),
        params=_params(run_dir),
        changes=[
            {k: r.get(k) for k in ("step", "key", "old", "new", "client")}
            for r in records
            if r.get("kind") == "set"
        ],
        branched_from=_branched_from(run_dir),
    )


def _branched_from(run_dir: Path) -> dict[str, Any] | None:
    origin = read_origin(run_dir)
    if origin is None:
        return None
    return {**origin.to_json(), "parent_altered": parent_problem(origin)}


def _params(run_dir: Path) -> dict[str, Any] | None:
    """The searched values of a ``hookloop tune`` trial, or None for any other run."""
    import yaml

    path = RunDir(run_dir).params
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    params = data.get("params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


def _segments(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split the log into one list per ``train()`` session (each begins with ``start``)."""
    segments: list[list[dict[str, Any]]] = []
    for record in records:
        if record.get("kind") == "start" or not segments:
            segments.append([])
        segments[-1].append(record)
    return segments


def _time(record: dict[str, Any]) -> float | None:
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) else None


def _duration(segment: list[dict[str, Any]]) -> float:
    times = [t for t in map(_time, segment) if t is not None]
    return max(times) - min(times) if times else 0.0


def _status(
    segment: list[dict[str, Any]], start: dict[str, Any] | None, end: dict[str, Any] | None
) -> str:
    if not segment:
        return "empty"
    if end is not None:
        return str(end.get("status") or run_status(end.get("stop_reason")))
    if start is None:
        return "unknown"  # a log without start records: no process to ask
    pid, host = start.get("pid"), start.get("host")
    if host != socket.gethostname() or not isinstance(pid, int):
        return "killed?"
    return "running" if process_alive(pid) else "killed"


def list_runs(root: str | Path = "runs") -> list[RunSummary]:
    """Summaries of ``root`` itself if it is a run directory, else of the runs inside it."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    if is_run_dir(root):
        return [summarize_run(root)]
    runs = []
    for path in root.iterdir():
        if not (path.is_dir() and is_run_dir(path)):
            continue
        try:
            runs.append(summarize_run(path))
        except (OSError, ValueError) as err:  # one damaged run must not hide the others
            print(f"hookloop runs: skipping {path}: {' '.join(str(err).split())}", file=sys.stderr)
    return sorted(runs, key=lambda r: (r.started is None, r.started or 0.0, r.name))


# -- the table ---------------------------------------------------------------------


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_wall_time(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_table(runs: list[RunSummary]) -> str:
    """An aligned text table: run, status, steps, best eval loss, wall time (and the
    searched values, when the runs are ``hookloop tune`` trials)."""
    with_params = any(run.params for run in runs)
    with_changes = any(run.changes for run in runs)
    with_from = any(run.branched_from for run in runs)
    header = ("RUN", "STATUS", "STEPS", "BEST EVAL LOSS", "WALL TIME")
    header += ("FROM",) if with_from else ()
    header += ("PARAMS",) if with_params else ()
    header += ("LIVE CHANGES",) if with_changes else ()
    rows = [header]
    for run, depth in as_tree(runs):
        status = run.status
        if run.status == "stopped" and run.stop_reason:
            status = f"stopped ({run.stop_reason})"
        steps = f"{run.step}/{run.max_steps}" if run.max_steps else str(run.step)
        best = f"{run.best_eval_loss:.4g}" if run.best_eval_loss is not None else "-"
        name = "  " * (depth - 1) + "└ " + run.name if depth else run.name
        row = (name, status, steps, best, format_wall_time(run.wall_time_s))
        if with_from:
            row += (format_origin(run.branched_from),)
        if with_params:
            row += (" ".join(f"{k}={_short(v)}" for k, v in (run.params or {}).items()),)
        if with_changes:
            row += (format_changes(run.changes or []),)
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {2, 3, 4}  # numbers align right
    lines = [
        "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def format_origin(origin: dict[str, Any] | None) -> str:
    """``base@200`` (the parent's directory name and the step), ``-`` for no branch."""
    if origin is None:
        return "-"
    altered = " (parent altered since)" if origin.get("parent_altered") else ""
    return f"{Path(origin['run']).name}@{origin['step']}{altered}"


def as_tree(runs: list[RunSummary]) -> list[tuple[RunSummary, int]]:
    """``runs`` in their order, each branch moved under its parent when the parent is
    listed too, with its depth (0: not under another listed run)."""
    by_path = {str(Path(run.path).resolve()): run for run in runs}
    children: dict[str, list[RunSummary]] = {}
    roots = []
    for run in runs:
        parent = (run.branched_from or {}).get("run")
        if parent in by_path and by_path[parent] is not run:
            children.setdefault(parent, []).append(run)
        else:
            roots.append(run)
    ordered: list[tuple[RunSummary, int]] = []

    def visit(run: RunSummary, depth: int) -> None:
        if any(seen is run for seen, _ in ordered):
            return  # a cycle (hand-edited branch.json files): each run once
        ordered.append((run, depth))
        for child in children.get(str(Path(run.path).resolve()), []):
            visit(child, depth + 1)

    for run in [*roots, *runs]:  # then any run of a cycle, at the top level
        visit(run, 0)
    return ordered


def format_changes(changes: list[dict[str, Any]], shown: int = 3) -> str:
    """``step 40: lr=0.0003; step 90: clip_grad_norm=0.5`` (the last ``shown``, and a count)."""
    if not changes:
        return "-"
    text = "; ".join(f"step {c['step']}: {c['key']}={_short(c['new'])}" for c in changes[-shown:])
    return text if len(changes) <= shown else f"{len(changes) - shown} more; {text}"


# -- the command -----------------------------------------------------------------


def add_runs_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop runs [DIR] [--json]`` to an argparse sub-parser set."""
    parser = subparsers.add_parser("runs", help="list runs: status, steps, best eval, time")
    parser.add_argument(
        "dir", nargs="?", default="runs", help="directory of runs, or one run (default: runs)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument(
        "--verify-ledger",
        action="store_true",
        help="check the run's sample ledger (data.ledger=true): nothing lost, nothing repeated",
    )
    parser.set_defaults(run=main_runs)
    return parser


def main_runs(args: argparse.Namespace) -> int:
    """Print the runs under ``args.dir``; raises ValueError if it is not a directory."""
    if getattr(args, "verify_ledger", False):
        from hookloop.ledger import verify_ledger

        report = verify_ledger(args.dir)
        print(report.summary(), file=sys.stdout if report.ok else sys.stderr)
        return 0 if report.ok else 1
    runs = list_runs(args.dir)
    if getattr(args, "json", False):
        for run in runs:
            print(json.dumps(asdict(run)))
        return 0
    if not runs:
        print(f"no runs under {args.dir}", file=sys.stderr)
        return 0
    print(format_table(runs))
    return 0
