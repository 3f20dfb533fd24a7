"""How drivers share one study's trials: N COMPLETE or PRUNED, none lost, none run twice.

Claiming a trial happens under a file lock (``.tune.lock``, :func:`study_lock`), so that
K local workers never start more than N trials between them. Under the same lock a
driver looks for RUNNING trials whose process is gone (a SIGKILLed driver takes its
workers with it): each is marked FAIL with the reason and its parameters are enqueued
again (:func:`recover_interrupted`, :func:`requeue`). Drivers on other machines, which
no file lock orders, give back a trial asked for past the N (:func:`surplus`), and keep
their trials alive with Optuna's heartbeat (:func:`heartbeat`).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hookloop.processes import process_alive
from hookloop.tune.spec import LOCK_FILE, optuna

#: A RUNNING trial with no process recorded this long after it started lost its claimer.
UNCLAIMED_AFTER_S = 60
#: Environment variable naming this machine in the study (default: the host name). Two
#: drivers on one machine with different values stand for two machines.
HOST_ENV = "HOOKLOOP_TUNE_HOST"


def host_name() -> str:
    """This machine's name in the study: ``$HOOKLOOP_TUNE_HOST``, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


@contextlib.contextmanager
def study_lock(study_dir: Path) -> Iterator[None]:
    """An exclusive lock for claiming trials (released by the OS if the holder dies)."""
    with open(study_dir / LOCK_FILE, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class Counts:
    done: int  # COMPLETE or PRUNED
    running: int
    failed: int  # FAIL for a reason other than an interrupted process


def counts(study: Any) -> Counts:
    state = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return Counts(
        done=sum(t.state in (state.COMPLETE, state.PRUNED) for t in trials),
        running=sum(t.state == state.RUNNING for t in trials),
        failed=sum(
            t.state == state.FAIL
            and not t.user_attrs.get("interrupted", False)
            and not t.user_attrs.get("surplus", False)
            and t.number not in retried
            for t in trials
        ),
    )


def recover_interrupted(study: Any, storage: Any) -> list[int]:
    """Mark RUNNING trials whose process is gone FAIL, and enqueue their parameters again.

    Call it holding :func:`study_lock`, with the Optuna storage ``study`` was opened on
    (:func:`~hookloop.tune.storage.open_study_on_storage`). A trial is interrupted when
    its process ran on this host and is no longer alive, or when it has no process
    recorded at all (its claimer died holding the lock). Returns their numbers.
    """
    opt = optuna()
    study_id = storage.get_study_id_from_name(study.study_name)
    host = host_name()
    recovered = []
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(opt.trial.TrialState.RUNNING,)):
        pid, trial_host = trial.user_attrs.get("pid"), trial.user_attrs.get("host")
        if pid is not None and (trial_host != host or process_alive(int(pid))):
            continue  # alive, or another machine's: only its own host (or heartbeat) fails it
        started = trial.datetime_start or now
        if pid is None and (now - started).total_seconds() < UNCLAIMED_AFTER_S:
            continue  # just asked for, by this machine or another: its claimer is writing
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        reason = f"interrupted: process {pid} on {trial_host} died while the trial ran"
        try:
            storage.set_trial_user_attr(trial_id, "fail_reason", reason)
            storage.set_trial_user_attr(trial_id, "interrupted", True)
            storage.set_trial_state_values(trial_id, opt.trial.TrialState.FAIL)
        except opt.exceptions.UpdateFinishedTrialError:
            continue  # another driver on this machine recovered it first
        requeue(study, trial)
        recovered.append(trial.number)
    return recovered


def requeue(study: Any, trial: Any, reason: str | None = None) -> None:
    """Enqueue an interrupted trial's parameters again, with where its run directory is (the
    retry resumes from its newest checkpoint when that is on this machine)."""
    attrs: dict[str, Any] = {"retry_of": trial.number}
    if reason:
        attrs["retry_reason"] = reason
    if trial.user_attrs.get("run_dir"):
        attrs["resume_from"] = trial.user_attrs["run_dir"]
        attrs["resume_host"] = trial.user_attrs.get("host")
    if trial.intermediate_values:
        attrs["reported"] = {str(k): v for k, v in trial.intermediate_values.items()}
    params = dict(trial.params) or dict(trial.system_attrs.get("fixed_params", {}))
    study.enqueue_trial(params, user_attrs=attrs)


def driver_salt(study_dir: Path) -> int:
    """A number that tells this driver's sampler seed from other drivers' on the same
    storage: from its host (``$HOOKLOOP_TUNE_HOST``) and its study directory."""
    return zlib.crc32(f"{host_name()}:{Path(study_dir).resolve()}".encode()) % 1_000_003


def surplus(study: Any, trial: Any, wanted: int) -> bool:
    """Whether ``trial``, just asked for, is one more than the study wants: drivers on
    other machines (whose claims no file lock orders) asked at the same moment. It is
    then recorded FAIL with ``surplus: true`` (not counted), its queued parameters go
    back to the queue, and the caller waits."""
    state = optuna().trial.TrialState
    trials = study.get_trials(deepcopy=False)
    done = sum(t.state in (state.COMPLETE, state.PRUNED) for t in trials)
    running = sorted(t.number for t in trials if t.state == state.RUNNING)
    if trial.number not in running or running.index(trial.number) < wanted - done:
        return False
    trial.set_user_attr("surplus", True)
    trial.set_user_attr("fail_reason", "surplus: the study's trials were all claimed")
    study.tell(trial, state=state.FAIL)
    frozen = study.trials[trial.number]
    if "retry_of" in frozen.user_attrs or frozen.system_attrs.get("fixed_params"):
        requeue(study, frozen)
    return True


def beat_once(study: Any, storage: Any, trial: Any) -> None:
    """Record one heartbeat of ``trial`` (on a storage that keeps them)."""
    if hasattr(storage, "record_heartbeat"):
        study_id = storage.get_study_id_from_name(study.study_name)
        storage.record_heartbeat(
            storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        )


@contextlib.contextmanager
def heartbeat(study: Any, storage: Any, trial: Any, interval: int | None) -> Iterator[None]:
    """Record Optuna's heartbeat for ``trial`` every ``interval`` seconds while it runs
    (``study.optimize`` does this itself; ask-and-tell must), so that when this machine is
    lost, another driver's ``fail_stale_trials`` fails the trial and it is retried."""
    if not interval or not hasattr(storage, "record_heartbeat"):
        yield
        return
    study_id = storage.get_study_id_from_name(study.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a missed beat is retried next time
                storage.record_heartbeat(trial_id)
            stop.wait(interval)

    thread = threading.Thread(target=beat, name="hookloop-tune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
