"""``hookloop jobs`` and ``hookloop ctl``: find and steer running jobs from a terminal.

::

    hookloop jobs [--json]
    hookloop ctl JOB {status,stop,save,save-and-stop,abort,eval,token,url} [--json] [--wait S]

``JOB`` is a job id, a unique prefix of one, or the job's pid. The hookloop
command adds these with :func:`add_jobs_command` / :func:`add_ctl_command`;
``python -m hookloop.control.cli jobs|ctl ...`` runs them stand-alone.

Exit codes: 0 done; 1 the job could not be reached or refused the command;
2 bad usage or no such job.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

from hookloop.control.client import ALIASES, ControlError, JobClient
from hookloop.control.registry import (
    RegistryError,
    find_job,
    jobs_dir,
    list_jobs,
    registries,
)
from hookloop.control.server import COMMANDS
from hookloop.errors import ConfigError
from hookloop.processes import process_alive

ACTIONS = ("status", *ALIASES, "token", "url")
OK, FAILED, USAGE = 0, 1, 2


def add_jobs_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``jobs`` to an ``add_subparsers()`` object; the parser's ``run`` default runs it."""
    parser = subparsers.add_parser(
        "jobs",
        help="list the training jobs running on this machine",
        description=(
            "List live hookloop and Forgather jobs of this user, from hookloop's registry and "
            "Forgather's (stale hookloop entries are removed)."
        ),
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list of objects")
    _common(parser)
    parser.set_defaults(run=run_jobs)
    return parser


def add_ctl_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``ctl`` to an ``add_subparsers()`` object; the parser's ``run`` default runs it."""
    parser = subparsers.add_parser(
        "ctl",
        help="show a running job's status or send it a command",
        description=(
            "status: progress and metrics; stop: finish the step, save, exit; save: write a "
            "checkpoint; save-and-stop; abort: exit without saving; eval: evaluate now; "
            "set KEY=VALUE ...: change live settings (lr, lr_scale, weight_decay, "
            "clip_grad_norm, log_every, max_steps, ...; also `hookloop ctl set JOB KEY=VALUE`; "
            "--at-step N: at the end of step N); unset ID: cancel a scheduled change; "
            "pause / resume: hold the job at the step's end on every rank, then go on; "
            "token: print the bearer token (for the dashboard); url: print the dashboard URL."
        ),
    )
    parser.add_argument("job", metavar="JOB", help="job id, unique id prefix, or pid")
    parser.add_argument(
        "action",
        metavar="ACTION",
        help=" | ".join(ACTIONS) + " | any command the server takes (e.g. evaluate_now)",
    )
    parser.add_argument(
        "values",
        nargs="*",
        metavar="KEY=VALUE",
        help="values for a command that takes them (each VALUE read as YAML: 3e-4, true, ...)",
    )
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer")
    parser.add_argument(
        "--at-step",
        type=int,
        metavar="N",
        help="set: apply the change at the end of step N (a later step), not now",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="after stop/save-and-stop/abort, wait up to S seconds for the process to exit",
    )
    _common(parser)
    parser.set_defaults(run=run_ctl)
    return parser


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs-dir",
        help=f"the one registry to use (default: {jobs_dir()} and Forgather's; env "
        "HOOKLOOP_JOBS_DIR)",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="HTTP timeout in seconds"
    )


# -- jobs -------------------------------------------------------------------------


def run_jobs(args: argparse.Namespace) -> int:
    rows = []
    for record in list_jobs(args.jobs_dir):
        row: dict[str, Any] = {
            "job_id": record.job_id,
            "pid": record.pid,
            "url": record.url,
            "step": None,
            "max_steps": None,
            "phase": None,
            "steps_per_s": None,
            "started": record.started,
            "out_dir": record.out_dir,
            "recipe": record.recipe,
        }
        try:
            status = JobClient.from_record(record, timeout=args.timeout).status()
            row["step"] = status_step(status)
            row["phase"] = status_phase(status)
            for key in ("max_steps", "steps_per_s"):
                row[key] = status.get(key)
        except (ControlError, RegistryError) as err:
            row["error"] = str(err)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return OK
    if not rows:
        where = " or ".join(str(p) for p in registries(args.jobs_dir))
        print(f"no running hookloop or Forgather jobs (in {where})")
        return OK
    table = [("JOB", "PID", "STEP", "PHASE", "URL", "OUT")]
    for r in rows:
        step = "?" if r["step"] is None else str(r["step"])
        if r["max_steps"]:
            step += f"/{r['max_steps']}"
        table.append(
            (r["job_id"], str(r["pid"]), step, r["phase"] or "?", r["url"], r["out_dir"] or "-")
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return OK


# -- ctl --------------------------------------------------------------------------


def run_ctl(args: argparse.Namespace) -> int:
    if args.job == "set" and args.action != "set":  # `hookloop ctl set JOB KEY=VALUE ...`
        args.job, args.action = args.action, "set"
    if not args.action.isidentifier() and args.action not in ACTIONS:
        return _error(_unknown(args.action, list(COMMANDS)), USAGE)
    try:
        if args.action == "unset" and len(args.values) == 1:  # `unset ID`: the id is text
            values = {"id": args.values[0].removeprefix("id=")}
        else:
            values = _parse_values(args.values)
    except ValueError as err:
        return _error(str(err), USAGE)
    if args.at_step is not None:
        if args.action != "set":
            return _error(f"--at-step is for set, not {args.action}", USAGE)
        values["at_step"] = args.at_step
    if values and args.action in ("status", "token", "url"):
        return _error(f"{args.action} takes no KEY=VALUE arguments", USAGE)
    try:
        record = find_job(args.job, args.jobs_dir)
    except LookupError as err:
        return _error(str(err).strip("'\""), USAGE)
    if args.action == "url":
        print(record.url)
        return OK
    try:
        token = record.read_token()
    except RegistryError as err:
        return _error(str(err), FAILED)
    if args.action == "token":
        if not token:
            print(f"job {record.job_id} serves without authentication (no token)", file=sys.stderr)
            return OK
        print(token)
        return OK
    client = JobClient(record.url, record.job_id, token, timeout=args.timeout)
    try:
        if args.action == "status":
            answer = client.status()
            shown = format_status(answer, record.url, pid=record.pid)
            print(json.dumps(answer, indent=2) if args.json else shown)
            return OK
        known = None
        if args.action not in ACTIONS and args.action not in COMMANDS:
            known = list(client.status().get("commands") or [])  # one the job registered
            if args.action not in known:
                return _error(_unknown(args.action, known), USAGE)
        answer = client.command(args.action, values, known=known)
    except ControlError as err:
        return _error(str(err), USAGE if err.status == 400 else FAILED)
    print(json.dumps(answer, indent=2) if args.json else f"{record.job_id}: {answer['message']}")
    ending = ("graceful_stop", "save_and_stop", "abort")
    if args.wait > 0 and ALIASES.get(args.action, args.action) in ending:
        deadline = time.monotonic() + args.wait
        while process_alive(record.pid, record.pid_start):
            if time.monotonic() > deadline:
                return _error(f"job {record.job_id} still running after {args.wait:g} s", FAILED)
            time.sleep(0.1)
        print(f"{record.job_id}: process {record.pid} has exited")
    return OK


def _unknown(action: str, commands: list[str]) -> str:
    valid = [
        *ACTIONS,
        *(
            c
            for c in dict.fromkeys([*COMMANDS, *commands])
            if c not in ALIASES.values() and c not in ACTIONS
        ),
    ]
    return f"unknown action {action!r}; valid: {', '.join(valid)}"


def _scalar(raw: str) -> Any:
    """A command-line value: a number as Python reads it (YAML takes ``3e-4`` for a
    string), anything else as YAML (``true``, ``null``, ``[0.9, 0.95]``)."""
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return yaml.safe_load(raw) if raw else ""


_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?(@\w+)?")


def _parse_values(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` arguments as a dict, each value read as YAML (``3e-4``, ``true``, ...)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not _KEY.fullmatch(key):
            raise ConfigError(
                f"values are KEY=VALUE with KEY a name (lr, lr@1, EarlyStopping.patience), "
                f"got {pair!r}"
            )
        try:
            values[key] = _scalar(raw)
        except yaml.YAMLError:
            raise ConfigError(f"the value of {key} is not a YAML scalar: {raw!r}") from None
    return values


#: Keys of a Forgather job's status that are not logged metrics.
_STATUS_FIELDS = frozenset({"job_id", "status", "timestamp", "global_step", "epoch", "max_steps"})


def status_step(st: dict[str, Any]) -> Any:
    """The step a status reports: hookloop's ``step`` or Forgather's ``global_step``."""
    return st.get("step", st.get("global_step"))


def status_phase(st: dict[str, Any]) -> Any:
    """hookloop's ``phase``, else Forgather's ``status`` (``running``)."""
    return st.get("phase") or st.get("status")


def format_status(st: dict[str, Any], url: str | None = None, *, pid: int | None = None) -> str:
    """A few human lines for ``hookloop ctl JOB status``, from hookloop's keys or from a
    Forgather job's (``global_step``, ``status`` and the latest log's keys at the top level);
    ``pid``: the registry's, for a status that does not carry one."""
    hookloop = "phase" in st
    if not hookloop:  # a Forgather job: its flat log keys are the metrics
        st = {
            **st,
            "step": status_step(st),
            "phase": status_phase(st) or "?",
            "pid": st.get("pid", pid),
            "metrics": {k: v for k, v in st.items() if k not in _STATUS_FIELDS},
            "metrics_step": status_step(st),
        }

    def num(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    step = num(st.get("step")) + (f" / {st['max_steps']}" if st.get("max_steps") else "")
    progress = f"step {step}   epoch {num(st.get('epoch'))}"
    if st.get("steps_per_s") is not None:
        progress += f"   {st['steps_per_s']:.1f} steps/s"
    if st.get("eta_s") is not None:
        progress += f"   ETA {_duration(st['eta_s'])}"
    phase = str(st.get("phase") or "?")
    phase += f" ({st['stopping']} filed)" if st.get("stopping") else ""
    lines = [
        f"job         {st.get('job_id')} (pid {st.get('pid')}), {phase}",
        f"progress    {progress}",
    ]
    metrics = st.get("metrics") or {}
    if metrics:
        shown = "   ".join(f"{k} {num(v)}" for k, v in metrics.items())
        lines.append(f"logged      {shown}   (step {st.get('metrics_step')})")
    evals = st.get("eval") or {}
    if evals:
        shown = "   ".join(f"{k} {num(v)}" for k, v in evals.items())
        lines.append(f"evaluation  {shown}   (step {st.get('eval_step')})")
    ckpt = st.get("checkpoint")
    if ckpt:
        lines.append(f"checkpoint  step {ckpt.get('step')}: {ckpt.get('path')}")
    lines += _steering_lines(st, num)
    if url:
        lines.append(f"{'dashboard' if hookloop else 'url':<11} {url}")
    return "\n".join(lines)


def _steering_lines(st: dict[str, Any], num: Callable[[Any], str]) -> list[str]:
    """The status lines of what steers the job: settings, the latest changes, a pause,
    scheduled changes, and each rank's last heartbeat."""
    lines = []
    settings = st.get("settings") or {}
    if settings:
        lines.append("settings    " + "   ".join(f"{k} {num(v)}" for k, v in settings.items()))
    for record in (st.get("changes") or [])[-3:]:  # the latest live changes
        what = ", ".join(
            f"{c['key']} {num(c['old'])} -> {num(c['new'])}" for c in record["changes"]
        )
        lines.append(f"changed     step {record['step']}: {what} ({record['client']})")
    if st.get("paused"):
        since = time.strftime("%H:%M:%S", time.localtime(st["paused_since"]))
        lines.append(f"paused      true, since {since}, at step {st.get('paused_at_step')}")
    for entry in st.get("scheduled") or []:  # changes filed for a later step
        shown = ", ".join(f"{k}={num(v)}" for k, v in entry["values"].items())
        lines.append(f"scheduled   step {entry['step']}: {shown}   (id {entry['id']})")
    for row in st.get("ranks") or []:  # the watchdog's last heartbeat of each rank
        age = "never" if row.get("age_s") is None else f"{row['age_s']:.1f} s ago"
        where = f"step {row['step']}, {row['where']}" if "step" in row else ""
        lines.append(f"rank {row['rank']:<6} {row['state']}, {age}   {where}".rstrip())
        if row.get("refused"):  # its latest value from the store was no beat
            lines.append(f"            latest beat refused: {row['refused']}")
    return lines


def _duration(seconds: float) -> str:
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _error(message: str, code: int) -> int:
    print(f"hookloop ctl: error: {message}", file=sys.stderr)
    return code


# -- stand-alone entry points -----------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookloop", description="Find and steer hookloop jobs.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_jobs_command(sub)
    add_ctl_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m hookloop.control.cli {jobs,ctl} ...``"""
    args = _parser().parse_args(argv)
    return args.run(args)


def main_jobs(argv: list[str] | None = None) -> int:
    return main(["jobs", *(sys.argv[1:] if argv is None else argv)])


def main_ctl(argv: list[str] | None = None) -> int:
    return main(["ctl", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
