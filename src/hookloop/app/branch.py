"""``hookloop train --branch RUN@STEP --out NEW``: a new run from one checkpoint of another.

NEW starts from RUN's checkpoint at STEP (copied, never linked: NEW shares no file with
RUN), with RUN's config and the command line's overrides as ``--resume`` allows them
(:mod:`hookloop.app.resume_config`). What NEW holds before its first step:

* ``checkpoints/step-<STEP>/``: the copy, verified against its manifest, and ``latest``;
* ``changes.jsonl``, chained: first a ``branch`` record naming RUN, STEP and RUN's chain
  head at that point (the hash of its last record up to STEP, so a later edit of RUN's
  file is found out by :func:`parent_problem`); then RUN's records up to STEP (those in
  the checkpoint are passed over by id; one recorded at STEP after the save is applied at
  STEP, as a resume would); then the command line's live optimizer keys (``lr``,
  ``betas``...) as one record at STEP. RUN's records past STEP are not there;
* ``branch.json``: ``{"run", "step", "head", "records", "id"}`` (``config.yaml`` keeps only
  config keys, so that any hookloop reads it).

NEW then trains as a resume of that copy. Its ``changes.jsonl`` is the whole story of its
weights, so ``--replay NEW`` trains it again from scratch; the ``branch`` record changes
nothing and is never replayed (:func:`not_replayed`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookloop.errors import ConfigError
from hookloop.rundir import LATEST_FILE, RunDir, enclosing_run

#: What ``branch.json`` is called in a branched run's directory.
BRANCH_FILE = "branch.json"
#: The ``client`` of the ``branch`` record and of the command line's changes at STEP.
BRANCH_CLIENT = "branch"
BRANCH_OVERRIDE_CLIENT = "branch-override"
_SPEC = re.compile(r"(?P<run>.+)@(?P<step>\d+)")


@dataclass(frozen=True)
class Origin:
    """Where a branched run came from (its ``branch.json``)."""

    run: str  #: the parent run directory, absolute
    step: int  #: the parent's step the branch starts from
    head: str | None  #: the parent's ``changes.jsonl`` hash after its last record up to step
    records: int  #: how many lines of the parent's ``changes.jsonl`` that head covers
    id: str  #: the id of the ``branch`` record in this run's ``changes.jsonl``

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "head": self.head,
                "records": self.records, "id": self.id}  # fmt: skip


def read_origin(run_dir: str | Path) -> Origin | None:
    """The origin of a branched run; None for any other run (or an unreadable file)."""
    try:
        data = json.loads((Path(run_dir) / BRANCH_FILE).read_text(encoding="utf-8"))
        return Origin(str(data["run"]), int(data["step"]), data.get("head"),
                      int(data["records"]), str(data["id"]))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def parse_spec(spec: str) -> tuple[Path, int]:
    """``RUN@STEP`` as (run directory, step); anything else refused in one line."""
    found = _SPEC.fullmatch(spec)
    if found is None:
        raise ConfigError(
            f"--branch {spec}: give RUN@STEP, a run directory and one of its checkpoint "
            "steps (e.g. runs/a@200)"
        )
    return Path(found["run"]), int(found["step"])


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def resume_path(args: argparse.Namespace) -> str:
    """The copy NEW resumes from (the same path on every rank); refuses what cannot go with
    ``--branch``."""
    if args.resume is not None or args.replay is not None:
        raise ConfigError(
            "--branch starts a new run from a checkpoint: leave out --resume/--replay"
        )
    if args.out is None:
        raise ConfigError("--branch needs --out NEW, the directory of the new run")
    _, step = parse_spec(args.branch)
    return str(RunDir(args.out).checkpoints / checkpoint_name(step))


# -- choosing and checking --------------------------------------------------------------


def _saved_steps(run: RunDir) -> list[int]:
    """The steps of ``run``'s complete checkpoints (a manifest written), oldest first."""
    from hookloop.checkpoint.storage import CheckpointStorage, step_of

    return [step_of(path) for path in CheckpointStorage(run.checkpoints).complete()]


def _last_step(run: RunDir, saved: list[int]) -> int:
    from hookloop.rundir import read_jsonl

    logged = read_jsonl(run.metrics) if run.metrics.is_file() else []
    steps = [r["step"] for r in logged if isinstance(r.get("step"), int)]
    return max([*steps, *saved], default=0)


def check_source(parent: Path, step: int) -> Path:
    """The parent's checkpoint at ``step``, verified against its manifest, or a one-line
    refusal listing the steps a branch can start from (only that one is read whole)."""
    from hookloop.checkpoint.storage import CheckpointError, CheckpointStorage

    run = RunDir(parent)
    if not run.config.is_file():
        raise ConfigError(f"--branch {parent}@{step}: {parent} holds no run (no config.yaml)")
    saved = _saved_steps(run)
    path = run.checkpoints / checkpoint_name(step)
    last = _last_step(run, saved)
    if step > last:
        why = f"step {step} is beyond the run, which reached step {last}"
    elif not path.is_dir():
        why = f"{parent} has no checkpoint at step {step}"
    else:
        try:
            CheckpointStorage(run.checkpoints).verify(path)
            return path
        except CheckpointError as err:
            why = f"its checkpoint at step {step} is damaged ({' '.join(str(err).split())})"
    usable = ", ".join(str(s) for s in saved if s != step) or "none"
    raise ConfigError(f"--branch {parent}@{step}: {why}; steps available: {usable}")


def check_target(out: Path) -> None:
    """NEW: absent or an empty directory (so never RUN), inside no run or checkpoint."""
    inside = enclosing_run(out)
    if inside is not None:
        raise ConfigError(
            f"--out {out} lies inside {inside[1]} {inside[0]}; a branch is a run of its own: "
            "choose a directory outside it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"--out {out} exists and is not an empty directory; a branch starts a new run: "
            "give a new directory"
        )


def parent_records(parent: Path, step: int, skip: list[str]) -> tuple[list[dict], str | None, int]:
    """RUN's records up to ``step`` (chain checked, ``skip`` left out), its chain head after
    the last of them, and how many lines of its file that head covers."""
    from hookloop.journal import chain_start
    from hookloop.loop.changes import CHAIN_SEED, read_changes, read_replayable

    path = RunDir(parent).changes
    try:
        kept = {r["id"] for r in read_replayable(path, skip, warn=False)}
    except (ValueError, OSError) as err:
        raise ConfigError(f"--branch {parent}@{step}: {' '.join(str(err).split())}") from None
    every = read_changes(path)
    upto = max((i + 1 for i, r in enumerate(every) if r["step"] <= step), default=0)
    head = every[upto - 1].get("hash") if upto else chain_start(CHAIN_SEED)
    copied = [r for r in every[:upto] if r["step"] <= step and r["id"] in kept]
    return copied, head, upto


def parent_problem(origin: Origin) -> str | None:
    """What changed in the parent's ``changes.jsonl`` up to the branch point since the
    branch was made (None: nothing; the parent may have gone on past it)."""
    from hookloop.journal import ChainError, check_chain
    from hookloop.loop.changes import CHAIN_SEED, read_changes

    path = RunDir(origin.run).changes
    if not RunDir(origin.run).config.is_file():
        return f"{origin.run} holds no run any more"
    try:
        records = read_changes(path)[: origin.records]
        check_chain(path, records, CHAIN_SEED)
    except (ChainError, ValueError, OSError) as err:
        return " ".join(str(err).split())
    head = records[-1].get("hash") if records else None
    if len(records) != origin.records or (records and head != origin.head):
        return f"{path} no longer holds the records the branch was made from"
    return None


# -- making NEW -------------------------------------------------------------------------


def copy_checkpoint(source: Path, out: Path) -> Path:
    """Copy ``source`` into ``out/checkpoints/`` (staged, verified, renamed; ``latest`` set).
    Every byte is copied: a hard link would let a change to one run's file change the
    other's."""
    from hookloop.checkpoint.storage import CheckpointStorage, write_synced

    root = RunDir(out).checkpoints
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{source.name}"
    shutil.copytree(source, staging, copy_function=shutil.copyfile)
    copied = staging.rename(root / source.name)
    CheckpointStorage(root).verify(copied)  # a copy that went wrong is found out here
    write_synced(root / LATEST_FILE, source.name.encode())
    return copied


def write_changes(out: Path, origin: Origin, inherited: list[dict], live: dict[str, Any]) -> None:
    """NEW's ``changes.jsonl``: the branch record, RUN's records, the command line's."""
    from hookloop.loop.changes import append_change

    path = RunDir(out).changes
    now = time.time()
    first = {"id": origin.id, "step": origin.step, "values": {}, "changes": []}
    append_change(path, {**first, "client": BRANCH_CLIENT, "time": now, "branch": origin.to_json()})
    for record in inherited:
        append_change(path, {k: v for k, v in record.items() if k not in ("prev", "hash")})
    if live:
        append_change(path, {"id": f"{time.time_ns():020d}", "step": origin.step, "values": live,
                             "client": BRANCH_OVERRIDE_CLIENT, "time": now})  # fmt: skip


def prepare_branch(args: argparse.Namespace) -> tuple[Path, Any, dict[str, Any], bool]:
    """Rank 0's part of ``--branch``: check everything, then make NEW (see the module doc).
    Returns what :func:`hookloop.app.cli._prepare` does: the run directory, the config it
    trains with, the config changes to announce, and True (NEW was created here)."""
    from hookloop.app.resume_config import (
        LIVE_ON_RESUME,
        live_overrides,
        recorded_config,
        resume_config,
        saved_config,
    )
    from hookloop.config import dump_yaml

    parent, step = parse_spec(args.branch)
    out = Path(args.out)
    check_target(out)
    source = check_source(parent, step)
    saved = saved_config(parent)
    cfg, changes = resume_config(parent, args.recipe, args.config, args.overrides, saved,
                                 what="on a branch")  # fmt: skip
    inherited, head, covered = parent_records(parent, step, args.skip_change)
    live = live_overrides(changes)
    _check_live(live)
    origin = Origin(str(parent.resolve()), step, head, covered, f"branch-{time.time_ns()}")
    created, recorded = not out.exists(), recorded_config(cfg, changes)
    try:  # branch.json before changes.jsonl: a resume then always knows the branch record
        copy_checkpoint(source, out)
        (out / BRANCH_FILE).write_text(json.dumps(origin.to_json(), indent=1) + "\n")
        write_changes(out, origin, inherited, live)
        RunDir(out).config.write_text(dump_yaml(recorded.to_dict()))
    except BaseException:
        _undo(out, created)
        raise
    for key, (old, new) in changes.items():
        when = f"a recorded change at step {step}" if key in LIVE_ON_RESUME else "config"
        print(f"hookloop: branch: {key} changed: {old!r} -> {new!r} ({when})", file=sys.stderr)
    print(f"hookloop: branch of {parent} at step {step}: {len(inherited)} recorded change(s) "
          f"up to it carried over", file=sys.stderr)  # fmt: skip
    args.skip_change = []  # they named RUN's records, left out above
    kept = {k: v for k, v in changes.items() if k not in LIVE_ON_RESUME}
    return out, recorded, kept, True


def _check_live(live: dict[str, Any]) -> None:
    """The command line's live optimizer values within their ranges, before NEW is made."""
    from hookloop.loop.live_values import OPTIMIZER_CHECKS, SettingError

    for key, value in live.items():
        try:
            OPTIMIZER_CHECKS[key](key, value)
        except SettingError as err:
            raise ConfigError(f"optimizer.{key} on the command line: {err}") from None


def _undo(out: Path, created: bool) -> None:
    """Remove what a branch that failed half-way wrote (NEW was absent or empty)."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def not_replayed(run_dir: str | Path | None, skip: list[str]) -> set[str]:
    """The record ids a resume or replay of ``run_dir`` leaves out: ``skip`` and, for a
    branched run, its ``branch`` record (it changes nothing)."""
    origin = read_origin(run_dir) if run_dir is not None else None
    return set(skip) | ({origin.id} if origin is not None else set())


def is_fresh_branch(run_dir: Path, step: int) -> bool:
    """Whether ``run_dir`` is a branch that has trained nothing of its own (at ``step``,
    the branch step, or before it was restored), so a failed start may remove it whole."""
    origin = read_origin(run_dir)
    return origin is not None and step <= origin.step
