"""The ``hookloop`` command.

hookloop train [--recipe NAME] [--config FILE] [--out DIR] [--resume auto|PATH] [--replay RUN]
               [KEY=VALUE ...]
hookloop recipes
hookloop config [--recipe NAME]
hookloop plot RUN_DIR... [--out FILE] [--log-scale]
hookloop runs [DIR] [--json]
hookloop jobs [--json]
hookloop ctl JOB {status,stop,save,save-and-stop,abort,eval,token,url}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from hookloop.app.resume_config import OptimizerOverrides, resume_config, saved_config
from hookloop.callback import Callback
from hookloop.config import Config, describe, dump_yaml
from hookloop.recipes import get_recipe, recipe_names, recipe_slug, resolve_config
from hookloop.result import ExitCode, TrainResult
from hookloop.rundir import RunDir, enclosing_run, is_checkpoint, is_checkpoints_folder
from hookloop.runlock import RunDirLocked
from hookloop.state import CallbackContext


class UsageError(Exception):
    """A bad command line or config: reported in one line, exit code 2."""


#: Errors in what the user asked for: one line on stderr, exit code 2.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UsageError,
    ValueError,  # bad config values, checkpoints that do not fit or are damaged
    ImportError,  # an integration whose extra is not installed
    RunDirLocked,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    yaml.YAMLError,
)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
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
    except USER_ERRORS as err:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"hookloop {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return ExitCode.USAGE
    except OSError as err:  # the machine, not the command: a full disk, a lost mount
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"hookloop {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return ExitCode.ERROR
    except (RuntimeError, MemoryError) as err:
        line = _machine_error(err)
        if line is None or os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"hookloop {args.command}: error: {line}", file=sys.stderr)
        return ExitCode.ERROR


#: Set to 1 for the full traceback of an error otherwise reported in one line.
DEBUG_ENV = "HOOKLOOP_DEBUG"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
        text = f"{text}: {err.filename}"
    return text


def _machine_error(err: BaseException) -> str | None:
    """One line for what the machine could not do (exit 1), or None for a bug (a traceback).

    A log write that failed for an OSError (a full disk) reaches the loop as a
    ``LogWriterError``; a model or batch too large for memory as a ``MemoryError`` or
    torch's allocation error.
    """
    from hookloop.callbacks._writer import LogWriterError

    if isinstance(err, LogWriterError) and isinstance(err.__cause__, OSError):
        return (
            f"could not write the run's logs ({_one_line(err.__cause__)}); the checkpoints "
            "already saved are intact: free space, then continue with --resume auto"
        )
    text = _one_line(err)
    if isinstance(err, MemoryError) or "out of memory" in text or "can't allocate" in text:
        return (
            f"out of memory ({text[:300]}); choose a smaller model (model.*), batch "
            "(data.batch_size) or precision (train.precision)"
        )
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hookloop", description="Train PyTorch models with a readable, hookable loop."
    )
    sub = parser.add_subparsers(dest="command")

    train = sub.add_parser("train", help="train a recipe (default: gpt-stdlib)")
    train.add_argument(
        "--recipe", help="recipe name (see `hookloop recipes`) or package.module:object"
    )
    train.add_argument("--config", help="YAML file with config values")
    train.add_argument("--out", help="run directory (default: runs/<recipe>-<time>)")
    train.add_argument("--resume", help="'auto' (newest valid checkpoint in --out) or a path")
    train.add_argument(
        "--replay",
        metavar="RUN",
        help="train again from scratch with RUN's config.yaml and its live `set` changes "
        "(changes.jsonl) applied at the steps they were applied at",
    )
    train.add_argument(
        "--allow-restart",
        action="store_true",
        help="with --resume auto: start over when every checkpoint is damaged (default: refuse)",
    )
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. train.max_steps=50")
    train.set_defaults(run=_train)

    recipes = sub.add_parser("recipes", help="list the available recipes")
    recipes.set_defaults(run=_recipes)

    config = sub.add_parser("config", help="print every config key with its value and doc")
    config.add_argument("--recipe", help="recipe whose defaults to show")
    config.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    config.set_defaults(run=_config)

    from hookloop.app.plot import add_plot_command
    from hookloop.app.runs import add_runs_command

    add_plot_command(sub)  # hookloop plot RUN_DIR... [--out FILE] [--log-scale]
    add_runs_command(sub)  # hookloop runs [DIR] [--json]

    from hookloop.tune.cli import add_tune_command

    add_tune_command(sub)  # hookloop tune --recipe R --space FILE --trials N [--workers K] ...

    from hookloop.diloco.cli import add_diloco_command

    add_diloco_command(sub)  # hookloop diloco serve --port P [--checkpoint-dir D] [--token T] ...

    from hookloop.control.cli import add_ctl_command, add_jobs_command

    add_jobs_command(sub)  # hookloop jobs [--json]
    add_ctl_command(sub)  # hookloop ctl JOB {status,stop,save,save-and-stop,abort,eval,token,url}
    return parser


def _run_dir(out: str | None, recipe: str, resume: str | None) -> Path:
    if out is None:
        if resume == "auto":
            raise UsageError("--resume auto needs --out DIR (the run directory to resume)")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"{recipe_slug(recipe)}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path("runs") / f"{recipe_slug(recipe)}-{stamp}-{suffix}"
        return path
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} is a file; give a directory for the run")
    _refuse_anothers(path)
    if resume is None and _holds_run(path):
        raise UsageError(
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
        raise UsageError(
            f"--out {path} lies inside {kind} {owner}, another run's; a run there would write "
            "into its files: choose a directory outside it"
        )
    if is_checkpoint(path) or is_checkpoints_folder(path):
        raise UsageError(
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
    whether this command created the directory."""
    changes: dict[str, Any] = {}
    if args.replay is not None:
        _check_replay(args)
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
    for key, (old, new) in changes.items():
        print(f"hookloop: resume: {key} changed: {old!r} -> {new!r}", file=sys.stderr)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, cfg, changes, created


def _check_replay(args: argparse.Namespace) -> None:
    """``--replay RUN``: a run directory with a config.yaml (the config to train with unless
    --config names another) and a readable changes.jsonl; never combined with --resume."""
    from hookloop.loop.live import read_changes

    if args.resume is not None:
        raise UsageError("--replay trains from scratch; it cannot be combined with --resume")
    source = RunDir(args.replay)
    if not source.config.is_file():
        raise UsageError(f"--replay {args.replay}: no {source.config.name} there (a run directory)")
    if args.out is not None and Path(args.out).resolve() == source.root.resolve():
        raise UsageError("--replay writes a new run: give --out a directory other than RUN")
    try:
        records = read_changes(source.changes)
    except (ValueError, OSError) as err:
        raise UsageError(f"--replay {args.replay}: {err}") from None
    if args.config is None:
        args.config = str(source.config)
    print(
        f"hookloop: replaying {args.replay}: {len(records)} live change(s) at steps "
        f"{', '.join(str(r['step']) for r in records) or '-'}",
        file=sys.stderr,
    )


class _RecordConfig(Callback):
    """Writes config.yaml, what the run runs with, once training has started (so a start
    that fails changes nothing) and atomically (so a crash leaves the old one whole)."""

    priority = 0

    def __init__(self, path: Path, cfg: Config, *, replace: bool) -> None:
        self.path, self.cfg, self.replace = path, cfg, replace

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not ctx.state.is_rank_zero or (self.path.exists() and not self.replace):
            return
        staging = self.path.with_name(f".{self.path.name}.tmp")
        staging.write_text(dump_yaml(self.cfg.to_dict()))
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


def _remove_failed_start(run_dir: Path) -> None:
    """A run directory this command created, left with no checkpoint: remove it all."""
    run = RunDir(run_dir)
    if not (run.checkpoints.is_dir() and any(run.checkpoints.iterdir())):
        shutil.rmtree(run_dir, ignore_errors=True)


def _train(args: argparse.Namespace) -> int:
    from hookloop.distributed import (
        broadcast_object,
        init_from_env,
        is_distributed,
        leave_process_group,
        rank_info,
    )
    from hookloop.entry import build_trainer

    if args.allow_restart:
        args.overrides = [*args.overrides, "checkpoint.allow_restart=true"]
    joined = not is_distributed() and init_from_env()  # under torchrun: gloo on CPU, nccl on GPU
    # Rank 0 decides the run directory and config (and refuses a used one); every rank
    # gets its answer.
    decision: tuple[Any, str | None] = (None, None)
    if rank_info()[0] == 0:
        try:
            decision = (_prepare(args), None)
        except USER_ERRORS as err:
            decision = (None, _one_line(err))
    prepared, error = broadcast_object(decision)
    if error is not None:
        raise UsageError(error)
    run_dir, cfg, changes, created = prepared
    rank = rank_info()[0]
    if rank == 0:
        print(f"hookloop: recipe {cfg.recipe}, run directory {run_dir}", file=sys.stderr)
    try:
        callbacks = _callbacks(cfg, run_dir, changes)
        with _signals_during_startup():  # train() installs its own handlers as it starts
            trainer = build_trainer(cfg, callbacks=callbacks, out_dir=run_dir, resume=args.resume)
        if args.replay is not None:
            trainer.parts.live.replay_from = RunDir(args.replay)
        if cfg.callbacks.profile:  # callbacks.profile=true: time every handler of this run
            trainer.callbacks.profile()
        result = trainer.train()
    except _StartupSignal as stop:
        if created and rank == 0:
            _remove_failed_start(run_dir)
        print(
            f"hookloop train: {signal.Signals(stop.signum).name} during start-up, before "
            "training began: nothing to save, nothing saved",
            file=sys.stderr,
        )
        return 128 + stop.signum
    except BaseException:
        if created and rank == 0:
            _remove_failed_start(run_dir)
        if joined:
            leave_process_group(wait=False)
        raise
    if joined:
        leave_process_group()  # every rank ended at the same step: a clean torchrun exit
    profile = trainer.callbacks.profile(False)
    if profile is not None and rank == 0:
        print(profile.table(), file=sys.stderr)
    if rank == 0:
        print(closing_line(result, run_dir), file=sys.stderr)
    return result.exit_code


def _callbacks(cfg: Config, run_dir: Path, changes: dict[str, Any]) -> list[Callback]:
    """The command's callbacks: the config's defaults, recording config.yaml, the resumed
    run's optimizer overrides, the control server."""
    from hookloop.callbacks.defaults import default_callbacks

    callbacks = default_callbacks(cfg, run_dir)
    callbacks.append(_RecordConfig(RunDir(run_dir).config, cfg, replace=bool(changes)))
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


def closing_line(result: TrainResult, run_dir: Any) -> str:
    """The run's last line on stderr: why it ended, its metrics, where its files are.

    A signal that came once the last step was done (during the final save or the
    shutdown) did not stop the run, but it still sets the exit code (128 + N): the
    line says so, so that the code does not contradict the reason.
    """
    summary = ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    late_signal = ""
    if result.signal is not None and not result.stop_reason.startswith("signal"):
        name = signal.Signals(result.signal).name
        late_signal = f" ({name} came after the last step: exit code {result.exit_code})"
    return (
        f"hookloop: {result.stop_reason} at step {result.step}{late_signal}"
        + (f"; {summary}" if summary else "")
        + f"; outputs in {run_dir}"
    )


def _recipes(args: argparse.Namespace) -> int:
    for name in recipe_names():
        print(f"{name:<18} {get_recipe(name).description}")
    return ExitCode.OK


def _config(args: argparse.Namespace) -> int:
    cfg = resolve_config(args.recipe, None, args.overrides)
    for key, value, doc in describe(cfg):
        print(f"{key:<32} {value!s:<14} {doc}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
