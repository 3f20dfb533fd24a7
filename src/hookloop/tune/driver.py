"""A driver: the loop that claims trials of a study and runs them until it has its N.

``hookloop tune`` runs one driver per worker process (:func:`work`); under ``torchrun``
rank 0 leads (claims each trial and records it) and every other rank follows, training
the same trial beside it (:func:`follow`). Drivers on one storage may run on several
machines; :mod:`hookloop.tune.claims` keeps them from losing or repeating a trial.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hookloop.tune.claims import (
    Counts,
    beat_once,
    counts,
    driver_salt,
    heartbeat,
    host_name,
    recover_interrupted,
    study_lock,
    surplus,
)
from hookloop.tune.interrupts import Interrupts, StudyInterrupted
from hookloop.tune.space import SearchSpace
from hookloop.tune.spec import TuneError, TuneSpec, optuna, trial_dir
from hookloop.tune.storage import open_study, open_study_on_storage, retry_locked
from hookloop.tune.trial import run_trial, train_trial


def work(
    study_dir: str | Path,
    worker: int = 0,
    *,
    deadline: float | None = None,
    on_trial_end: Callable[[Any], None] | None = None,
) -> int:
    """Claim and run trials until the study has its N COMPLETE or PRUNED trials.

    Returns the number of trials this worker ran. Raises :class:`TuneError`
    when more trials failed than ``max_failures`` allows. After ``deadline`` (a
    ``time.time()``) it starts no more trials. ``on_trial_end`` is called with each
    trial this worker ran (an ``optuna.trial.FrozenTrial``) once it is recorded. Under
    ``torchrun`` (a process group is up) rank 0 claims each trial and every other rank
    trains the same trial beside it (:func:`follow`).
    """
    from hookloop.distributed import broadcast_object, rank_info

    rank, _, world = rank_info()
    if world > 1 and rank != 0:
        return follow(study_dir)
    try:
        with Interrupts().installed() as interrupts:
            return _lead(
                Path(study_dir),
                worker,
                announce=world > 1,
                interrupts=interrupts,
                deadline=deadline,
                on_trial_end=on_trial_end,
            )
    finally:
        if world > 1:
            broadcast_object(None)  # the followers' signal to stop


def follow(study_dir: str | Path) -> int:
    """On ranks other than 0: train each trial rank 0 announces, until it announces None."""
    from hookloop.distributed import broadcast_object

    study_dir = Path(study_dir)
    spec = TuneSpec.load(study_dir)
    ran = 0
    while (claimed := broadcast_object(None)) is not None:
        number, values = claimed
        try:
            train_trial(spec, study_dir, number, values)
        except Exception as err:  # rank 0 records the failure; this rank waits for the next
            print(f"hookloop tune: trial {number} failed on this rank: {err}", file=sys.stderr)
        ran += 1
    return ran


def _lead(
    study_dir: Path,
    worker: int,
    *,
    announce: bool,
    interrupts: Interrupts,
    deadline: float | None = None,
    on_trial_end: Callable[[Any], None] | None = None,
) -> int:
    """Claim trials and run them here until the study has its N (rank 0, or the only
    rank), announcing each claimed trial to the followers when ``announce``."""
    from hookloop.distributed import broadcast_object

    spec = TuneSpec.load(study_dir)
    study, storage = _open_for_driver(spec, study_dir, worker)
    space = spec.search_space()
    ran = 0
    while True:
        interrupts.check()
        if deadline is not None and time.time() >= deadline:
            return ran
        claimed = None
        with study_lock(study_dir):
            now = _recount(study, storage)
            if now.done >= spec.trials:
                return ran
            _check_failures(spec, study_dir, now)
            if now.done + now.running < spec.trials:
                claimed = _claim(spec, study_dir, study, storage, space)
        if claimed is None:  # N trials are under way: wait in case one of them fails
            with interrupts.allowed():
                time.sleep(0.2)
            continue
        trial, values = claimed
        if announce:
            broadcast_object((trial.number, values))
        try:
            with heartbeat(study, storage, trial, spec.heartbeat_seconds()):
                run_trial(spec, study_dir, trial, values, interrupts)
        except optuna().exceptions.UpdateFinishedTrialError:
            finished_elsewhere(study.trials[trial.number], on_trial_end)
            continue
        except StudyInterrupted:
            if on_trial_end is not None:
                on_trial_end(study.trials[trial.number])
            raise
        if on_trial_end is not None:
            on_trial_end(study.trials[trial.number])
        ran += 1


def _open_for_driver(spec: TuneSpec, study_dir: Path, worker: int) -> tuple[Any, Any]:
    """The study and its storage, with a sampler seeded for this driver: the seed differs
    per worker, per restart and (on a shared ``--storage``) per driver, so that no two
    draw the same values."""
    with study_lock(study_dir):
        start = len(open_study(spec, study_dir).get_trials(deepcopy=False))
    salt = driver_salt(study_dir) if spec.storage is not None else 0
    seed = (spec.seed + 1000 * worker + 7919 * start + salt) % 2**31
    return open_study_on_storage(spec, study_dir, sampler_seed=seed)


def _recount(study: Any, storage: Any) -> Counts:
    """The study's counts once the trials of lost machines and dead processes are failed
    and queued again (call it holding :func:`study_lock`)."""
    with warnings.catch_warnings():  # Optuna marks it experimental
        warnings.simplefilter("ignore", optuna().exceptions.ExperimentalWarning)
        optuna().storages.fail_stale_trials(study)  # a lost machine's trials, retried
    recover_interrupted(study, storage)
    return counts(study)


def _check_failures(spec: TuneSpec, study_dir: Path, now: Counts) -> None:
    """Stop the study (:class:`TuneError`) once more trials failed than it allows."""
    max_failures = spec.max_failures if spec.max_failures is not None else spec.trials
    if now.failed >= max_failures:
        raise TuneError(
            f"{now.failed} trials failed (the limit is {max_failures}); see their "
            f"fail_reason in `hookloop tune` output or {study_dir}/trial-*/"
        )


def _claim(
    spec: TuneSpec, study_dir: Path, study: Any, storage: Any, space: SearchSpace
) -> tuple[Any, dict[str, Any]] | None:
    """Ask the study for a trial, mark it as this process's and draw its values; None
    when other drivers claimed the last trials at the same moment (see :func:`surplus`)."""
    with warnings.catch_warnings():  # hookloop records the heartbeats itself
        warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
        # A lock error after Optuna made the trial leaves it RUNNING with no claimer: it is
        # failed and queued again once UNCLAIMED_AFTER_S have passed (recover_interrupted).
        trial = retry_locked(study.ask)
    if spec.heartbeat_seconds():  # at once: a trial never heard from is never stale
        retry_locked(lambda: beat_once(study, storage, trial))
    claimed_by = {"pid": os.getpid(), "host": host_name(),
                  "run_dir": str(trial_dir(study_dir, trial.number))}  # fmt: skip
    for key, value in claimed_by.items():
        retry_locked(functools.partial(trial.set_user_attr, key, value))
    if surplus(study, trial, spec.trials):
        return None
    return trial, space.suggest(trial)


def finished_elsewhere(trial: Any, on_trial_end: Callable[[Any], None] | None) -> None:
    """Another driver finished ``trial`` while this one ran it: it missed the trial's
    heartbeats (this machine was too busy to send them), failed it and queued it again.
    Its retry counts; this run of it is dropped, and the study goes on."""
    line = (
        f"hookloop tune: trial {trial.number} was ended ({trial.state.name}) by another "
        "driver while it ran here (a missed heartbeat); its retry counts, this run is dropped"
    )
    print(line, file=sys.stderr, flush=True)
    if on_trial_end is not None:
        on_trial_end(trial)
