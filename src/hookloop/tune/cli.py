"""``hookloop tune``: the driver of a study.

It writes (or, on a restart, checks) the study's ``tune.yaml``, runs the
trials — in this process, or in K worker processes on the same storage — and
then prints the best trials and writes the best config and the plots.
Running the same command again continues the study where it stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hookloop.distributed import (
    broadcast_object,
    init_from_env,
    is_distributed,
    leave_process_group,
    rank_info,
)
from hookloop.result import ExitCode
from hookloop.tune import credentials
from hookloop.tune.claims import counts, recover_interrupted, study_lock
from hookloop.tune.console import (
    VERBOSITY_ENV,
    echo_new,
    optuna_verbosity,
    trial_line,
    trial_output_to_log,
    verbosity_for_workers,
    worker_log,
)
from hookloop.tune.driver import work
from hookloop.tune.interrupts import Interrupts, StudyInterrupted
from hookloop.tune.spec import DIRECTIONS, PRUNERS, SAMPLERS, TuneError, TuneSpec, is_study_dir
from hookloop.tune.storage import open_study, open_study_on_storage


def add_tune_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop tune`` to an argparse sub-parser set."""
    parser = subparsers.add_parser(
        "tune", help="search hyper-parameters of a recipe with Optuna (restartable)"
    )
    parser.add_argument(
        "--recipe", help="recipe to tune: a name or package.module:object (default: gpt-stdlib)"
    )
    parser.add_argument("--space", required=True, help="YAML search space over config keys")
    parser.add_argument(
        "--trials", type=int, required=True, help="COMPLETE or PRUNED trials wanted"
    )
    parser.add_argument("--workers", type=int, default=1, help="trial processes in parallel")
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        help="CPU threads of each worker (default: cores // workers, or $OMP_NUM_THREADS)",
    )
    parser.add_argument("--out", help="study directory (default: runs/tune-<recipe>-<space>)")
    parser.add_argument(
        "--metric",
        action="append",
        help="objective: the best value of this evaluation metric (default: eval_loss), or "
        "param_count; several (--metric a,b or repeated) make a multi-objective study",
    )
    parser.add_argument(
        "--direction",
        action="append",
        help=f"{' or '.join(DIRECTIONS)} (default: minimize): one for all metrics, or one per "
        "--metric (--direction minimize,maximize)",
    )
    parser.add_argument(
        "--constraint",
        action="append",
        metavar="'METRIC <= NUMBER'",
        help="a trial breaking it is infeasible, never best, and the sampler steers away "
        "(repeatable; METRIC: an evaluation metric or param_count; also >=)",
    )
    parser.add_argument("--storage", help="Optuna storage URL (default: sqlite study.db in --out)")
    parser.add_argument("--study-name", default="hookloop", help="study name in the storage")
    parser.add_argument("--seed", type=int, default=0, help="sampler seed")
    _add_search_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="fixed for every trial")
    parser.set_defaults(run=main_tune)
    return parser


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """How the study searches and runs: pruner, sampler, heartbeat, timeout, output."""
    parser.add_argument(
        "--pruner",
        choices=PRUNERS,
        help="default: median (one --metric), none (several: Optuna cannot prune those)",
    )
    parser.add_argument(
        "--pruner-args", help="YAML mapping of the pruner's arguments, e.g. '{n_warmup_steps: 2}'"
    )
    parser.add_argument(
        "--sampler", default="tpe", help=f"Optuna sampler: {', '.join(SAMPLERS)} (default: tpe)"
    )
    parser.add_argument(
        "--sampler-args",
        help="YAML mapping of the sampler's arguments, e.g. '{n_startup_trials: 4}'",
    )
    parser.add_argument(
        "--heartbeat",
        type=int,
        help="seconds between a trial's heartbeats; a trial silent for twice that is failed "
        "and retried by another driver (default: 30 with --storage, else off; 0: off)",
    )
    parser.add_argument(
        "--timeout", type=float, help="start no trial after this many seconds (running ones end)"
    )
    parser.add_argument(
        "--enqueue", help="YAML list of parameter sets ({key: value}) to try first, once each"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the plots at the end")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show each trial's output and Optuna's log lines (default: one line per trial; "
        "the output is in each trial's console.log and workers/worker-N.log)",
    )


def main_tune(args: argparse.Namespace) -> int:
    """Run the study the command describes; under torchrun every rank calls this.

    SIGINT and SIGTERM are caught first thing, before the imports and checks that take
    seconds on a busy machine: from then on the command ends with 130 or 143 and a word,
    and never leaves a trial RUNNING.
    """
    interrupts = Interrupts()
    with interrupts.installed():
        try:
            with interrupts.allowed():  # nothing is written yet: stop at once
                spec, study_dir, enqueued = _command(args)
            joined = not is_distributed() and init_from_env()  # under torchrun: one worker
            try:
                with optuna_verbosity(getattr(args, "verbose", False)):
                    return _drive(spec, study_dir, args, enqueued, interrupts)
            finally:
                if joined:
                    leave_process_group()
        except StudyInterrupted as stop:
            if rank_info()[0] == 0:
                print(
                    f"hookloop tune: {stop}; the same command continues the study "
                    "(an interrupted trial resumes from its checkpoint)",
                    file=sys.stderr,
                )
            return stop.exit_code


def _command(args: argparse.Namespace) -> tuple[TuneSpec, Path, list[dict[str, Any]]]:
    """The checked spec, study directory and enqueued parameter sets of the command line."""
    if isinstance(args.workers, bool) or args.workers < 1:
        raise ValueError(f"--workers must be an int >= 1, got {args.workers!r}")
    threads = getattr(args, "threads_per_worker", None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads-per-worker must be an int >= 1, got {threads!r}")
    space = read_space(args.space)
    metric = objectives(args.metric, "eval_loss")
    spec = TuneSpec(
        recipe=args.recipe or _recipe_from(args.overrides),
        space=space,
        trials=args.trials,
        overrides=[o for o in args.overrides if not o.startswith("recipe=")],
        metric=metric,
        direction=objectives(args.direction, "minimize"),
        storage=args.storage,
        study_name=args.study_name,
        seed=args.seed,
        pruner=args.pruner or default_pruner(metric),
        constraints=list(args.constraint or []),
        sampler=args.sampler,
        heartbeat=args.heartbeat,
        sampler_args=_yaml_mapping("--sampler-args", args.sampler_args),
        pruner_args=_yaml_mapping("--pruner-args", args.pruner_args),
    )
    if args.heartbeat is not None and args.heartbeat < 0:
        raise ValueError(f"--heartbeat must be an int >= 0 (0: off), got {args.heartbeat}")
    if args.timeout is not None and not (args.timeout > 0):
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout!r}")
    spec.validate(space_file=args.space)
    enqueued = read_enqueue(args.enqueue, spec) if args.enqueue else []
    from hookloop.recipes import recipe_slug

    study_dir = Path(args.out or f"runs/tune-{recipe_slug(spec.recipe)}-{Path(args.space).stem}")
    return spec, study_dir, enqueued


def _drive(
    spec: TuneSpec,
    study_dir: Path,
    args: argparse.Namespace,
    enqueued: list[dict[str, Any]],
    interrupts: Interrupts,
) -> int:
    from hookloop.tune.report import finish

    rank, _, world = rank_info()
    if world > 1 and args.workers != 1:
        raise ValueError(
            "--workers must be 1 under torchrun (each torchrun job is one worker; start "
            "several jobs on the same --storage to run trials in parallel)"
        )
    error = None
    if rank == 0:  # rank 0 creates (or checks) the study; every rank hears the outcome
        try:
            prepare(spec, study_dir)  # a signal meanwhile is held: the study is written whole
            if enqueued:
                study = open_study(spec, study_dir)
                for params in enqueued:  # a restart does not add them twice
                    study.enqueue_trial(params, skip_if_exists=True)
        except ValueError as err:
            error = str(err)
    error = broadcast_object(error)
    if error is not None:
        raise ValueError(error)
    interrupts.check()
    if rank == 0:
        print(f"hookloop tune: study {spec.study_name} in {study_dir}", file=sys.stderr)
    deadline = None if args.timeout is None else time.time() + args.timeout
    verbose = getattr(args, "verbose", False)
    try:
        if args.workers == 1:
            run_here(study_dir, deadline=deadline, verbose=verbose or rank != 0)
        else:
            run_workers(study_dir, args.workers, threads=args.threads_per_worker, deadline=deadline)
        interrupts.check()  # a signal the trials' own handlers held for the command
    except TuneError as err:
        print(f"hookloop tune: {err}", file=sys.stderr)
        if rank == 0:
            with interrupts.allowed():
                finish(study_dir, plots=not args.no_plots)
        return ExitCode.ERROR
    if rank == 0:
        done = counts(open_study(spec, study_dir)).done
        if deadline is not None and done < spec.trials:
            print(
                f"hookloop tune: --timeout {args.timeout:g} s reached with {done} of "
                f"{spec.trials} trials done; the same command continues the study",
                file=sys.stderr,
            )
        with interrupts.allowed():  # the results are written again by the same command
            finish(study_dir, plots=not args.no_plots)
    return ExitCode.OK


def run_here(study_dir: Path, *, deadline: float | None = None, verbose: bool = False) -> int:
    """Run trials in this process (one worker), printing one line as each ends.

    What the trials print goes to their ``console.log`` and to ``workers/worker-0.log``,
    as a worker process's does (with ``verbose``, to the terminal as well). Returns the
    number of trials run.
    """
    with trial_output_to_log(worker_log(study_dir, 0), keep=verbose) as terminal:

        def echo(trial: Any) -> None:
            line = trial_line(trial)
            if line is not None:
                print(line, file=terminal, flush=True)

        return work(study_dir, deadline=deadline, on_trial_end=echo)


def objectives(given: list[str] | None, default: str) -> str | list[str]:
    """``--metric`` or ``--direction`` as given (repeated, or comma-separated): one name
    as a string, several as a list."""
    names = [n.strip() for item in given or [default] for n in item.split(",")]
    return names[0] if len(names) == 1 else names


def default_pruner(metric: str | list[str]) -> str:
    """``median``, or ``none`` for several metrics (Optuna cannot prune those)."""
    return "median" if isinstance(metric, str) else "none"


def _yaml_mapping(flag: str, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a YAML mapping such as '{{name: value}}', got {text!r}")
    return value


def read_enqueue(path: str, spec: TuneSpec) -> list[dict[str, Any]]:
    """The parameter sets of an ``--enqueue`` file: a YAML list of ``{config.key: value}``
    over the space's keys, each checked against the recipe's config."""
    import copy

    from hookloop.tune.space import apply_params

    try:
        entries = yaml.safe_load(Path(path).read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"--enqueue: file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--enqueue: {path} is not valid YAML: {err}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(
            f"--enqueue: {path} must be a YAML list of mappings, e.g. "
            "[{optimizer.lr: 0.01, model.hidden: 32}]"
        )
    space = spec.search_space()
    base = spec.base_config()
    for i, entry in enumerate(entries):
        unknown = [k for k in entry if k not in space.keys]
        if unknown:
            raise ValueError(
                f"--enqueue: {path} entry {i}: {unknown[0]!r} is not a searched key; "
                f"allowed: {', '.join(space.keys)}"
            )
        try:
            apply_params(copy.deepcopy(base), entry).validate()
        except ValueError as err:
            raise ValueError(f"--enqueue: {path} entry {i}: {err}") from None
    return [dict(e) for e in entries]


def read_space(path: str) -> Any:
    try:
        space = yaml.safe_load(Path(path).read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise ValueError(f"--space: search space file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--space: {path} is not valid YAML: {err}") from None
    if space is None:
        raise ValueError(f"--space: search space file {path} is empty")
    return space


def _recipe_from(overrides: list[str]) -> str:
    from hookloop.config import Config

    for item in overrides:
        if item.startswith("recipe="):
            return item.split("=", 1)[1]
    return Config().recipe


def prepare(spec: TuneSpec, study_dir: Path) -> None:
    """Create the study directory with its spec, or check that a restart repeats the command."""
    credentials.remember(spec.storage)  # tune.yaml keeps it masked; the study's reads need it
    if is_study_dir(study_dir):
        saved = TuneSpec.load(study_dir)
        changed = spec.differences(saved)
        if changed:
            raise ValueError(
                f"{study_dir} holds a study started with different {', '.join(changed)}; "
                "continue it with the same command, or choose another --out"
            )
        if (spec.trials, spec.storage, spec.heartbeat) != (
            saved.trials,
            saved.storage,
            saved.heartbeat,
        ):
            spec.save(study_dir)  # more trials (or a moved database) for the same study
        return
    if study_dir.is_dir() and any(study_dir.iterdir()):
        raise ValueError(f"{study_dir} is not empty and holds no study; choose another --out")
    created = not study_dir.exists()
    study_dir.mkdir(parents=True, exist_ok=True)
    try:
        if spec.storage is not None:  # checked before tune.yaml records it
            open_study(spec, study_dir)
    except ValueError:
        if created:
            shutil.rmtree(study_dir, ignore_errors=True)
        raise
    spec.save(study_dir)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_env(
    index: int,
    workers: int,
    *,
    threads: int | None = None,
    gpus: int = 0,
    environ: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of worker ``index`` of ``workers``.

    CPU threads (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, and torch's, which the worker
    sets from ``HOOKLOOP_TUNE_THREADS``): ``threads`` when given, else
    ``$OMP_NUM_THREADS`` when the caller set it, else ``cores // workers`` (at least 1), so
    that K workers share the machine instead of each spinning on every core. GPUs: with
    ``gpus`` > 0 the worker sees one, ``CUDA_VISIBLE_DEVICES`` = the ``index % gpus``-th of
    those visible to the driver.
    """
    env = dict(os.environ if environ is None else environ)
    if threads is None:
        given = env.get("OMP_NUM_THREADS", "")
        threads = int(given) if given.isdigit() and int(given) > 0 else None
    if threads is None:
        threads = max(1, cpu_cores() // workers)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HOOKLOOP_TUNE_THREADS"):
        env[name] = str(threads)
    if gpus:
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        devices = visible if visible else [str(i) for i in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = devices[index % len(devices)].strip()
    return env


def run_workers(
    study_dir: Path, workers: int, *, threads: int | None = None, deadline: float | None = None
) -> None:
    """Start ``workers`` trial processes and wait, printing each trial as it ends.

    Each worker gets ``cores // workers`` CPU threads unless ``threads`` says otherwise,
    and on a machine with GPUs worker i sees only GPU ``i % count`` (see
    :func:`worker_env`). Raises
    :class:`TuneError` if the workers exit before the study has its trials. Workers run
    in their own session: SIGINT or SIGTERM reaches the driver, which passes it on once to
    every worker, waits for them to record their trials, and raises
    :class:`StudyInterrupted`.
    """
    spec = TuneSpec.load(study_dir)
    logs = worker_log(study_dir, 0).parent
    logs.mkdir(exist_ok=True)
    procs = _start_workers(spec, study_dir, workers, threads, deadline)
    study = open_study(spec, study_dir)
    seen: set[int] = set()
    interrupts = Interrupts()
    passed_on = False
    try:
        with interrupts.installed():
            while any(p.poll() is None for p, _ in procs):
                if interrupts.pending is not None and not passed_on:
                    for proc, _ in procs:
                        if proc.poll() is None:
                            proc.send_signal(interrupts.pending)
                    passed_on = True
                echo_new(study, seen)
                time.sleep(0.1 if passed_on else 0.5)
            echo_new(study, seen)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
    if interrupts.pending is not None:
        _recover_workers_trials(spec, study_dir)
        raise StudyInterrupted(interrupts.pending)
    if counts(study).done < spec.trials and not (deadline and time.time() >= deadline):
        codes = [p.returncode for p, _ in procs]
        raise TuneError(
            f"the workers exited (codes {codes}) with {counts(study).done} of {spec.trials} "
            f"trials done; see {logs}/worker-*.log"
        )


def _recover_workers_trials(spec: TuneSpec, study_dir: Path) -> None:
    """Every worker has exited: a trial one of them left RUNNING (it died before it could
    record the signal's cut, e.g. killed by it mid set-up) is failed and queued again now,
    as the next start would, so the study never shows a trial running that nobody runs."""
    study, storage = open_study_on_storage(spec, study_dir)
    with study_lock(study_dir):
        recover_interrupted(study, storage)


def _start_workers(
    spec: TuneSpec, study_dir: Path, workers: int, threads: int | None, deadline: float | None
) -> list[tuple[subprocess.Popen[bytes], Any]]:
    """Start the worker processes, each writing to its ``workers/worker-N.log``."""
    gpus = _gpu_count()
    procs = []
    for index in range(workers):
        env = worker_env(index, workers, threads=threads, gpus=gpus)
        if deadline is not None:
            env["HOOKLOOP_TUNE_DEADLINE"] = repr(deadline)
        if credentials.passwords(spec.storage):  # tune.yaml holds it masked
            env[credentials.STORAGE_ENV] = spec.storage or ""
        env[VERBOSITY_ENV] = verbosity_for_workers()
        log = open(worker_log(study_dir, index), "ab")  # noqa: SIM115 (closed by the caller)
        cmd = [sys.executable, "-m", "hookloop.tune.worker", str(study_dir), str(index)]
        proc = subprocess.Popen(
            [*cmd, str(os.getpid())],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,  # a terminal's Ctrl-C reaches them once, from here
        )
        procs.append((proc, log))
    return procs


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no usable CUDA: CPU workers
        return 0
