"""The ``hookloop`` command.

hookloop train [--recipe NAME] [--config FILE] [--out DIR] [--resume auto|PATH] [--replay RUN]
               [--branch RUN@STEP] [--skip-change ID ...] [KEY=VALUE ...]
hookloop recipes
hookloop config [--recipe NAME]
hookloop plot RUN_DIR... [--out FILE] [--log-scale]
hookloop runs [DIR] [--json]
hookloop jobs [--json]
hookloop ctl JOB {status,stop,save,save-and-stop,abort,eval,token,url}
hookloop --version

Each command's module is imported when that command runs, so ``jobs``, ``ctl``, ``runs``,
``--help`` and ``--version`` start without importing torch.

Failures are told apart by type. hookloop refusing what it was asked (a
:class:`~hookloop.errors.ConfigError`, a missing optional package, a run directory another
process holds, argparse's own refusals) is one line on stderr and exit code 2. Anything else
is the user's code failing (the model, the loss, the data, a callback, a recipe) or a bug:
its traceback, exit code 1. What the machine could not do (a full disk, out of memory) is
one line and exit code 1. ``HOOKLOOP_DEBUG=1`` shows the traceback of a one-line error too.

A run directory that holds anything a user may want (a log line, a checkpoint, a recorded
change) is never removed: a failed run keeps it and says so. Only a directory this
command created and left with nothing but empty files (a refused start) is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hookloop import __version__
from hookloop.app.branch import is_fresh_branch, not_replayed, prepare_branch, resume_path
from hookloop.app.failures import error_line, is_refusal, one_line
from hookloop.callback import Callback
from hookloop.errors import ConfigError
from hookloop.result import ExitCode, TrainResult, reason_without_step
from hookloop.rundir import RunDir, enclosing_run, is_checkpoint, is_checkpoints_folder

if TYPE_CHECKING:
    from hookloop.config import Config
    from hookloop.state import CallbackContext

#: Set to 1 for the full traceback of an error otherwise reported in one line.
DEBUG_ENV = "HOOKLOOP_DEBUG"

#: Each command: its one-line help, and the module and function that add its parser.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("train a recipe (default: gpt-stdlib)", __name__, "add_train_command"),
    "recipes": ("list the available recipes", __name__, "add_recipes_command"),
    "config": ("print every config key with its value and doc", __name__, "add_config_command"),
    "summary": ("print a recipe's model per module", "hookloop.app.summary", "add_summary_command"),
    "plot": ("draw training curves of runs as a PNG", "hookloop.app.plot", "add_plot_command"),
    "runs": ("list runs: status, steps, best eval, time", "hookloop.app.runs", "add_runs_command"),
    "lr-find": (
        "sweep a recipe's learning rate, suggest one",
        "hookloop.app.lr_find",
        "add_lr_find_command",
    ),
    "tune": (
        "search hyper-parameters of a recipe with Optuna (restartable)",
        "hookloop.tune.cli",
        "add_tune_command",
    ),
    "diloco": (
        "DiLoCo across machines: the server workers sync with (Forgather's protocol)",
        "hookloop.diloco.cli",
        "add_diloco_command",
    ),
    "jobs": (
        "list the training jobs running on this machine",
        "hookloop.control.cli",
        "add_jobs_command",
    ),
    "ctl": (
        "show a running job's status or send it a command",
        "hookloop.control.cli",
        "add_ctl_command",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Run one ``hookloop`` command; returns its exit code.

    A reader that closes the pipe early (``hookloop runs --json | head -1``) ends the
    command quietly with exit code 141 (128 + SIGPIPE), as git and coreutils do.
    """
    try:
        code = _main(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's shutdown
        return code
    except BrokenPipeError:
        _discard_stdout()
        return 128 + signal.SIGPIPE


def _main(argv: list[str]) -> int:
    parser = build_parser([_command_of(argv)])
    args, extra = parser.parse_known_args(argv)
    if extra:  # KEY=VALUE overrides may come after options too: `train a=1 --out x b=2`
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    try:
        return args.run(args)
    except Exception as err:
        line, code = error_line(err)
        if line is None or os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"hookloop {args.command}: error: {line}", file=sys.stderr)
        return code


def _discard_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush finds no closed pipe."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: a stdout with no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _command_of(argv: list[str]) -> str | None:
    """The command named on the command line (its first word that is no option), if any."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(commands: list[str | None] | None = None) -> argparse.ArgumentParser:
    """The ``hookloop`` parser. Only the sub-parsers of ``commands`` (None: all) are built
    by their modules; the others are placeholders that carry their help line, so that
    building the parser imports nothing a command does not need."""
    parser = argparse.ArgumentParser(
        prog="hookloop", description="Train PyTorch models with a readable, hookable loop."
    )
    parser.add_argument("--version", action="version", version=f"hookloop {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name, (help_line, module, adder) in COMMANDS.items():
        if commands is None or name in commands:
            getattr(importlib.import_module(module), adder)(sub)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def add_train_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop train``; the parser's ``run`` default runs it."""
    train = subparsers.add_parser("train", help=COMMANDS["train"][0])
    train.add_argument("--recipe", help="a recipe (`hookloop recipes`) or package.module:object")
    train.add_argument("--config", help="YAML file with config values")
    train.add_argument("--out", help="run directory (default: runs/<recipe>-<time>)")
    train.add_argument("--resume", help="'auto' (newest valid checkpoint in --out) or a path")
    train.add_argument(
        "--replay",
        metavar="RUN",
        help="train again from scratch with RUN's config.yaml and its live `set` changes "
        "(changes.jsonl) applied at the steps they were applied at",
    )
    branch = "a new run in --out from RUN's checkpoint at STEP and its changes up to it"
    train.add_argument("--branch", metavar="RUN@STEP", help=branch)
    train.add_argument(
        "--skip-change",
        metavar="ID",
        action="append",
        default=[],
        help="with --resume or --replay: leave out the changes.jsonl record ID (repeatable); "
        "for a record the run cannot apply or that was not written by hookloop",
    )
    train.add_argument(
        "--allow-restart",
        action="store_true",
        help="with --resume auto: start over when every checkpoint is damaged (default: refuse)",
    )
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=50")
    train.set_defaults(run=_train)
    return train


def add_recipes_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop recipes``."""
    recipes = subparsers.add_parser("recipes", help=COMMANDS["recipes"][0])
    recipes.set_defaults(run=_recipes)
    return recipes


def add_config_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop config [--recipe NAME] [KEY=VALUE ...]``."""
    config = subparsers.add_parser("config", help=COMMANDS["config"][0])
    config.add_argument("--recipe", help="recipe whose defaults to show")
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    config.set_defaults(run=_config)
    return config


def _run_dir(out: str | None, recipe: str, resume: str | None) -> Path:
    from hookloop.recipes import recipe_slug

    if out is None:
        if resume == "auto":
            raise ConfigError("--resume auto needs --out DIR (the run directory to resume)")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{recipe_slug(recipe)}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path("runs") / f"{recipe_slug(recipe)}-{stamp}-{suffix}"
        return path
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; give a directory for the run")
    _refuse_anothers(path)
    if resume is None and _holds_run(path):
        raise ConfigError(
            f"{path} already holds a run; continue it with `--resume auto`, "
            "or choose another --out directory (nothing there is overwritten)"
        )
    return path


def _refuse_anothers(path: Path) -> None:
    """``--out`` must not lie inside another run's directory or checkpoints, nor be a
    checkpoint: the run would write its lock, logs and checkpoints into them."""
    inside = enclosing_run(path)
    if inside is not None:
        owner, kind = inside
        raise ConfigError(
            f"--out {path} lies inside {kind} {owner}, another run's; a run there would write "
            "into its files: choose a directory outside it"
        )
    if is_checkpoint(path) or is_checkpoints_folder(path):
        raise ConfigError(
            f"--out {path} is a checkpoint or a checkpoints folder, not a run directory; "
            "resume from it with --resume and give --out a directory of its own"
        )


def _holds_run(path: Path) -> bool:
    """Whether ``path`` holds a run's results (a config.yaml alone is a start that failed)."""
    run = RunDir(path)
    metrics = run.metrics
    return (metrics.is_file() and metrics.stat().st_size > 0) or (
        run.checkpoints.is_dir() and any(run.checkpoints.iterdir())
    )


def _prepare(args: argparse.Namespace) -> tuple[Path, Config, dict[str, Any], bool]:
    """Rank 0's part: the run directory, the config it runs with, what a resume changed, and
    whether this command created the directory. Raises :class:`NothingToDo` for a resume of
    a run that already reached its budget."""
    from hookloop.app.resume_config import resume_config, saved_config
    from hookloop.recipes import resolve_config

    if args.branch is not None:
        return prepare_branch(args)
    changes: dict[str, Any] = {}
    if args.skip_change and args.resume is None and args.replay is None:
        raise ConfigError("--skip-change leaves out a recorded change: give --resume or --replay")
    if args.replay is not None:
        _check_replay(args)
    if args.config is not None and not Path(args.config).is_file():
        what = "is a directory" if Path(args.config).is_dir() else "does not exist"
        raise ConfigError(f"--config {args.config} {what}; give a YAML file")
    saved = saved_config(Path(args.out)) if args.resume and args.out else None
    if saved is not None:
        cfg, changes = resume_config(
            Path(args.out), args.recipe, args.config, args.overrides, saved
        )
    else:
        cfg = resolve_config(args.recipe, args.config, args.overrides)
    run_dir = _run_dir(args.out, cfg.recipe, args.resume)
    if args.resume == "auto" and not _holds_run(run_dir):
        print(f"hookloop: no run in {run_dir} yet; starting a new run in it", file=sys.stderr)
    elif args.resume == "auto":
        _refuse_finished(run_dir, cfg)
    for key, (old, new) in changes.items():
        print(f"hookloop: resume: {key} changed: {old!r} -> {new!r}", file=sys.stderr)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {run_dir}: cannot create it: {one_line(err)}") from None
    return run_dir, cfg, changes, created


class NothingToDo(Exception):
    """``--resume auto`` of a run that already reached its step or epoch budget."""


def _refuse_finished(run_dir: Path, cfg: Config) -> None:
    """Raise :class:`NothingToDo` when the run's log ends with it reaching the budget that
    ``cfg`` still sets (its ``end`` record: ``max_steps`` or ``max_epochs``) and its latest
    checkpoint, intact, is that step's."""
    from hookloop.rundir import read_jsonl

    metrics = RunDir(run_dir).metrics
    try:
        records = read_jsonl(metrics) if metrics.is_file() else []
    except (OSError, UnicodeDecodeError):
        return  # resuming reports a damaged log its own way
    end = records[-1] if records and records[-1].get("kind") == "end" else {}
    step, epoch, reason = end.get("step"), end.get("epoch"), end.get("stop_reason")
    budget: tuple[str, int, str, int] | None = None
    max_steps, max_epochs = cfg.train.max_steps, cfg.train.max_epochs
    if reason == "max_steps" and isinstance(step, int) and max_steps and step >= max_steps:
        budget = ("step", step, "max_steps", max_steps)
    elif reason == "max_epochs" and not max_steps and max_epochs and isinstance(epoch, int):
        budget = ("epoch", epoch, "max_epochs", max_epochs) if epoch >= max_epochs else None
    if budget is not None and _latest_intact_step(run_dir) == step:
        unit, reached, key, value = budget
        raise NothingToDo(
            f"{run_dir} already finished at {unit} {reached} (train.{key}={value}); to train "
            f"on, raise it: hookloop train --out {run_dir} --resume auto train.{key}={2 * value}"
        )


def _latest_intact_step(run_dir: Path) -> int | None:
    """The step of the checkpoint ``latest`` names if it is intact (what a resume loads),
    else None (a resume passes over it, or restarts with --allow-restart)."""
    from hookloop.checkpoint.storage import CheckpointError, CheckpointStorage, step_of

    storage = CheckpointStorage(RunDir(run_dir).checkpoints)
    name = storage.latest_name()
    if name is None:
        return None
    try:
        storage.verify(storage.root / name)
    except CheckpointError:
        return None
    return step_of(storage.root / name)


def _check_replay(args: argparse.Namespace) -> None:
    """``--replay RUN``: a run directory with a config.yaml (the config to train with unless
    --config names another) and a readable changes.jsonl; never combined with --resume."""
    from hookloop.loop.changes import read_replayable

    if args.resume is not None:
        raise ConfigError("--replay trains from scratch; it cannot be combined with --resume")
    source = RunDir(args.replay)
    if not source.config.is_file():
        raise ConfigError(
            f"--replay {args.replay}: no {source.config.name} there (a run directory)"
        )
    if args.out is not None and Path(args.out).resolve() == source.root.resolve():
        raise ConfigError("--replay writes a new run: give --out a directory other than RUN")
    try:
        skip = not_replayed(source.root, args.skip_change)
        records = read_replayable(source.changes, skip, warn=False)
    except (ValueError, OSError) as err:
        raise ConfigError(f"--replay {args.replay}: {err}") from None
    if args.config is None:
        args.config = str(source.config)
    print(
        f"hookloop: replaying {args.replay}: {len(records)} live change(s) at steps "
        f"{', '.join(str(r['step']) for r in records) or '-'}",
        file=sys.stderr,
    )


class _RecordConfig(Callback):
    """Writes config.yaml, what the run runs with, once training has started (so a start
    that fails changes nothing) and atomically (so a crash leaves the old one whole).

    A resume that restored a checkpoint writes ``resumed`` instead (when ``replace_resumed``):
    the command line's live optimizer keys are then recorded changes, not config (see
    :func:`hookloop.app.resume_config.recorded_config`)."""

    priority = 0

    def __init__(
        self, path: Path, cfg: Config, *, replace: bool, resumed: Config, replace_resumed: bool
    ) -> None:
        self.path, self.cfg, self.replace = path, cfg, replace
        self.resumed, self.replace_resumed = resumed, replace_resumed

    def on_train_start(self, ctx: CallbackContext) -> None:
        restored = ctx.run.resumed_from is not None
        replace, cfg = (
            (self.replace_resumed, self.resumed) if restored else (self.replace, self.cfg)
        )
        if not ctx.state.is_rank_zero or (self.path.exists() and not replace):
            return
        staging = self.path.with_name(f".{self.path.name}.tmp")
        from hookloop.config import dump_yaml

        staging.write_text(dump_yaml(cfg.to_dict()))
        os.replace(staging, self.path)


class _StartupSignal(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_during_startup() -> Iterator[None]:
    """SIGTERM/SIGINT before training begins end the command with a word, not silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise _StartupSignal(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _remove_failed_start(run_dir: Path, steps: int) -> None:
    """A run directory this command created: removed when the run trained no step and
    recorded no change (what is there is what the command wrote as it started: its
    config, a start record, a branch's copies); otherwise kept, and said where on stderr."""
    changes = RunDir(run_dir).changes
    recorded = changes.is_file() and changes.stat().st_size
    if is_fresh_branch(run_dir, steps) or (steps == 0 and not recorded):
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    print(
        f"hookloop train: the run failed at step {steps}; what it wrote is kept in {run_dir} "
        "(metrics.jsonl, progress.txt, changes.jsonl, tb/)",
        file=sys.stderr,
    )


def _train(args: argparse.Namespace) -> int:
    from hookloop.distributed import init_from_env, is_distributed, leave_process_group, rank_info
    from hookloop.entry import build_trainer

    if args.allow_restart:
        args.overrides = [*args.overrides, "checkpoint.allow_restart=true"]
    if args.branch is not None:  # every rank resumes from the copy rank 0 makes
        args.resume = resume_path(args)
    joined = not is_distributed() and init_from_env()  # under torchrun: gloo on CPU, nccl on GPU
    prepared, done = _decide_on_rank_zero(args)
    rank = rank_info()[0]
    if done is not None:
        if joined:
            leave_process_group()
        if rank == 0:
            print(f"hookloop: nothing to do: {done}")
        return ExitCode.OK
    run_dir, cfg, changes, created = prepared
    if rank == 0:
        print(f"hookloop: recipe {cfg.recipe}, run directory {run_dir}", file=sys.stderr)
    trainer = None
    try:
        callbacks = _callbacks(cfg, run_dir, changes)
        with _signals_during_startup():  # train() installs its own handlers as it starts
            trainer = build_trainer(cfg, callbacks=callbacks, out_dir=run_dir, resume=args.resume)
        if args.replay is not None:
            trainer.parts.live.replay_from = RunDir(args.replay)
        trainer.parts.live.skip_changes = not_replayed(args.replay or run_dir, args.skip_change)
        if cfg.callbacks.profile:  # callbacks.profile=true: time every handler of this run
            trainer.callbacks.profile()
        result = trainer.train()
    except _StartupSignal as stop:
        if created and rank == 0:
            _remove_failed_start(run_dir, 0)
        print(
            f"hookloop train: {signal.Signals(stop.signum).name} during start-up, before "
            "training began: nothing to save, nothing saved",
            file=sys.stderr,
        )
        return 128 + stop.signum
    except BaseException:
        if created and rank == 0:
            _remove_failed_start(run_dir, trainer.state.step if trainer is not None else 0)
        if joined:
            leave_process_group(wait=False)
        raise
    if joined:
        leave_process_group()  # every rank ended at the same step: a clean torchrun exit
    profile = trainer.callbacks.profile(False)
    if profile is not None and rank == 0:
        print(profile.table(), file=sys.stderr)
    if rank == 0:
        print(closing_line(result, run_dir, best_eval_loss=_best_eval_loss(run_dir)))
    return result.exit_code


def _decide_on_rank_zero(args: argparse.Namespace) -> tuple[Any, str | None]:
    """Rank 0 decides the run directory and config (and refuses a used one); every rank
    gets its answer: ``(prepared, None)``, or ``(None, why)`` when there is nothing to do.
    A refusal is a :class:`ConfigError` on every rank; a bug shows its traceback."""
    from hookloop.distributed import broadcast_object, rank_info

    decision: tuple[Any, str | None, str | None] = (None, None, None)
    if rank_info()[0] == 0:
        try:
            decision = (_prepare(args), None, None)
        except NothingToDo as done:
            decision = (None, None, str(done))
        except Exception as err:
            if not is_refusal(err):
                raise
            decision = (None, one_line(err), None)
    prepared, error, done = broadcast_object(decision)
    if error is not None:
        raise ConfigError(error)
    return prepared, done


def _callbacks(cfg: Config, run_dir: Path, changes: dict[str, Any]) -> list[Callback]:
    """The command's callbacks: the config's defaults, recording config.yaml, the resumed
    run's optimizer overrides, the control server."""
    from hookloop.app.resume_config import LIVE_ON_RESUME, OptimizerOverrides, recorded_config
    from hookloop.callbacks.defaults import default_callbacks

    callbacks = default_callbacks(cfg, run_dir)
    rewritten = any(k not in LIVE_ON_RESUME for k in changes)  # live keys: changes.jsonl
    resumed = recorded_config(cfg, changes)
    path = RunDir(run_dir).config
    callbacks.append(
        _RecordConfig(path, cfg, replace=bool(changes), resumed=resumed, replace_resumed=rewritten)
    )
    optimizer_changes = {k: new for k, (_, new) in changes.items() if k.startswith("optimizer.")}
    if optimizer_changes:
        callbacks.append(OptimizerOverrides(optimizer_changes))
    if cfg.control.enabled:  # prints its URL and where the token is once training starts
        from hookloop.control import ControlServer

        callbacks.append(
            ControlServer(
                host=cfg.control.host,
                port=cfg.control.port,
                disable_auth=cfg.control.disable_auth,
                allow_remote_without_auth=cfg.control.allow_remote_without_auth,
            )
        )
    return callbacks


def closing_line(result: TrainResult, run_dir: Any, *, best_eval_loss: float | None = None) -> str:
    """The run's result, one line on stdout (progress goes to stderr)::

        hookloop: REASON at step N (exit CODE)[, LATE SIGNAL][, best eval_loss X], run directory DIR

    REASON is why the run ended (``max_steps``, ``signal SIGTERM``, a detector's reason, which
    then names its step once, here). A signal that came once the last step was done (during
    the final save or the shutdown) did not stop the run, but it still sets the exit code
    (128 + N): the line says so, so that the code does not contradict the reason.
    """
    reason = reason_without_step(result.stop_reason, result.step)
    fields = [f"hookloop: {reason} at step {result.step} (exit {int(result.exit_code)})"]
    if result.signal is not None and not result.stop_reason.startswith("signal"):
        name = signal.Signals(result.signal).name
        fields.append(f"{name} came after the last step")
    if best_eval_loss is not None:
        fields.append(f"best eval_loss {best_eval_loss:.4g}")
    fields.append(f"run directory {run_dir}")
    return ", ".join(fields)


def _best_eval_loss(run_dir: Path) -> float | None:
    """The lowest ``eval_loss`` in the run's metrics.jsonl (every session), if any."""
    from hookloop.app.runs import summarize_run

    try:
        return summarize_run(run_dir).best_eval_loss
    except (OSError, ValueError):  # the result line goes out without it
        return None


def _recipes(args: argparse.Namespace) -> int:
    from hookloop.recipes import get_recipe, recipe_names

    for name in recipe_names():
        print(f"{name:<18} {get_recipe(name).description}")
    return ExitCode.OK


def _config(args: argparse.Namespace) -> int:
    from hookloop.config import describe
    from hookloop.recipes import resolve_config

    cfg = resolve_config(args.recipe, None, args.overrides)
    for key, value, doc in describe(cfg):
        print(f"{key:<32} {value!s:<14} {doc}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
