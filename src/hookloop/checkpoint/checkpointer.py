"""The loop's one handle on checkpoints: the :class:`Checkpointer`.

It is built once with what it needs (the run's checkpoint managers, the contents a
checkpoint holds, the run's event channel, the run's counters) and the loop asks it,
at defined points, to save (on the loop's thread or in the background), to resume,
and to roll back a divergence. It fires ``on_checkpoint_save`` once a save is committed and
``on_checkpoint_load`` once a state is restored, and never sees the Trainer.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from hookloop.checkpoint.background import BackgroundSaves, HostCopy, PendingSave
from hookloop.checkpoint.local import find_resume, restore
from hookloop.checkpoint.manager import CheckpointManager
from hookloop.checkpoint.rewind import Rewinder, discard_after, say_rewound
from hookloop.checkpoint.state import RNGState
from hookloop.distributed import is_sharded
from hookloop.requests import RewindRequest
from hookloop.state import CallbackContext, Progress, SaveTiming


class SaveLog(Protocol):
    """What the checkpointer tells the log: tokens are folded in before a save, each
    committed save is counted, and a rewind restarts the counts."""

    def sync_tokens(self) -> None: ...

    def add_save(self, timing: SaveTiming) -> None: ...

    def restart_at(self, step: int) -> None: ...


class Contents(Protocol):
    """What a checkpoint holds (the loop's
    :class:`~hookloop.loop.contents.CheckpointContents`): ``named(strict=)``, every state
    by name (the names are the file format); the model it saves, and the run's rewinds
    (the state named ``rewind``), which a rollback consults."""

    @property
    def model(self) -> Any: ...

    @property
    def rewind(self) -> Rewinder: ...

    @property
    def rng(self) -> RNGState: ...

    def named(self, *, strict: bool) -> dict[str, Any]: ...


class EventChannel(Protocol):
    """The run's events as the checkpointer fires them (the loop's
    :class:`~hookloop.loop.records.Events`)."""

    @property
    def ctx(self) -> CallbackContext: ...

    def emit(self, event: str) -> None: ...


class CheckpointStores(NamedTuple):
    """A run's checkpoint managers: ``persistent`` (None: the run writes no checkpoints)
    and ``local`` (``checkpoint.local_every``; None: none)."""

    persistent: CheckpointManager | None
    local: CheckpointManager | None


class Checkpointer:
    """Saves, resumes and rewinds one run (see the module doc).

    ``stores`` are the run's checkpoint managers; ``contents`` is what a checkpoint
    holds, and ``config`` the run's config, written beside it. ``announce_repeats``: a
    save asked for at a step already saved fires ``on_checkpoint_save`` again for that
    checkpoint (transformers' Trainer saves a step twice when a step save and an epoch
    save fall on it).
    """

    def __init__(
        self,
        stores: CheckpointStores,
        *,
        contents: Contents,
        config: Any,
        events: EventChannel,
        progress: Progress,
        log: SaveLog,
        timer: Any,
        announce_repeats: bool = False,
    ) -> None:
        self.persistent, self.local = stores
        self.contents, self.config = contents, config
        self.ctx, self.fire = events.ctx, events.emit
        self.progress, self.rewinder, self.log = progress, contents.rewind, log
        self.model, self.timer = contents.model, timer
        self.announce_repeats = announce_repeats
        self.last_path: Path | None = None  # the newest checkpoint announced
        self._saves, self._host_copy = BackgroundSaves(), HostCopy()

    def named_state(self) -> dict[str, Any]:
        """Everything a checkpoint of this run holds, by name (strict about callbacks'
        states when the persistent manager is: ``checkpoint.strict``)."""
        persistent = self.persistent
        return self.contents.named(strict=persistent.strict if persistent is not None else False)

    def attach(self, persistent: CheckpointManager | None, local: CheckpointManager | None) -> None:
        """Checkpoint managers for a run that had none (a resume asked for later)."""
        self.persistent, self.local = persistent, local

    @property
    def busy(self) -> bool:
        """A background save is in flight or waits to be announced (read after every step)."""
        return self._saves.busy

    # -- when -------------------------------------------------------------------
    def due(self, step: int, *, requested: bool = False) -> bool:
        """A persistent save is due at this step boundary (its interval, or a request)."""
        return self.persistent is not None and self.persistent.due(step, requested=requested)

    def local_due(self, step: int) -> bool:
        return self.local is not None and self.local.due(step)

    def due_at_end(self, stop_reason: str | None) -> bool:
        """A save at the end of training: never after an abort (see ``SavePolicy``)."""
        return self.persistent is not None and self.persistent.due_at_end(stop_reason)

    def intervals(self) -> list[int]:
        """The save intervals in force (persistent and local), for the loop's schedule."""
        managers = (self.persistent, self.local)
        return [m.policy.every for m in managers if m is not None and m.policy.every]

    # -- saving -----------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint of this exact state (every rank calls it) and fire
        ``on_checkpoint_save`` once it is committed. None if this step is already saved.

        With ``checkpoint.async_save`` (in training, one process, unsharded) the state
        is copied to host memory here and committed by a writer thread: the path
        returned is where it is being committed, and the event fires at a later step
        boundary with ``ctx.state`` as it was at this step (:mod:`.background`).
        """
        if self.persistent is None:
            raise ValueError("save_checkpoint() needs a run directory: pass out_dir to Trainer")
        # Asked inside a step before its update (from on_train_step_start, say), a save
        # records the state it holds: the counters as of the step before, so a resume
        # runs this step again.
        with self.progress.as_of_last_update():
            return self._save(self.persistent)

    def _save(self, persistent: CheckpointManager) -> Path | None:
        st = self.progress
        self.log.sync_tokens()
        self.timer.start()
        self.collect(wait=True)  # at most one save in flight: the previous one commits first
        started = time.perf_counter()
        background = self._in_background()
        job = persistent.capture(
            self.named_state(),
            step=st.step,
            epoch=st.epoch,
            config=self.config.to_dict(),
            metrics=st.last_eval,
            copy=self._host_copy if background else None,
        )
        if job is None:
            self.timer.stop()
            if self.announce_repeats and self.last_path is not None:
                self._fire_with_path("on_checkpoint_save", self.last_path)
            return None
        snapshot = self.ctx.state.snapshot() if background else None
        pending = PendingSave(job.path, snapshot, started, 0.0)
        if background:
            pending.blocked = time.perf_counter() - started
            self._saves.start(job.run, pending)
            self.timer.stop()
            return job.path
        path = job.run()
        self.timer.stop()
        pending.finished = time.perf_counter()
        pending.blocked = pending.seconds
        self._announce(pending)
        return path

    def save_local(self) -> None:
        """A local checkpoint: the same state, kept only until the next (no event fired)."""
        assert self.local is not None, "save_local() without checkpoint.local_every"
        st = self.progress
        self.log.sync_tokens()
        self.local.save(
            self.named_state(),
            step=st.step,
            epoch=st.epoch,
            config=self.config.to_dict(),
            metrics=st.last_eval,
        )

    def _in_background(self) -> bool:
        """checkpoint.async_save applies in training, in one process, to an unsharded model
        (several ranks save together: their collectives stay on the loop's thread)."""
        st = self.progress
        return (
            self.config.checkpoint.async_save
            and st.in_training
            and st.world_size == 1
            and not is_sharded(self.model)
        )

    def collect(self, *, wait: bool) -> None:
        """Fire ``on_checkpoint_save`` for a background save that has committed (raising
        its error if it failed); with ``wait``, wait for the one in flight first."""
        pending = self._saves.take(wait=wait)
        if pending is not None:
            self._announce(pending)

    def finish_quietly(self) -> None:
        """While another error ends the run: wait for the save being written, log its failure."""
        self._saves.finish_quietly()

    def close(self) -> None:
        """End the background writer (a save still in flight is then to be collected)."""
        self._saves.close()

    def _announce(self, pending: PendingSave) -> None:
        """``on_checkpoint_save`` with the save's timing, handlers seeing the saved step's state."""
        timing = SaveTiming(seconds=pending.seconds, blocked_seconds=pending.blocked)
        ctx = self.ctx
        ctx.checkpoint_timing = timing
        self.log.add_save(timing)
        live = ctx.state
        if pending.state is not None:
            ctx.state = pending.state
        try:
            self._fire_with_path("on_checkpoint_save", pending.path)
        finally:
            ctx.state = live

    def _fire_with_path(self, event: str, path: Path) -> None:
        ctx = self.ctx
        ctx.checkpoint_path = path
        if event == "on_checkpoint_save":
            self.last_path = path
        self.fire(event)
        ctx.checkpoint_path = ctx.checkpoint_timing = None

    # -- resuming ---------------------------------------------------------------
    def resume(self, target: str) -> Path | None:
        """Restore from ``"auto"`` (the newest intact checkpoint) or a path, and fire
        ``on_checkpoint_load``. None when ``"auto"`` finds nothing to resume."""
        if self.persistent is None:
            raise ValueError("load_checkpoint() needs out_dir or resume: pass one to Trainer")
        state = self.named_state()
        path, owner = find_resume(target, self.persistent, self.local, state)
        if path is not None:
            restore(path, owner, state, self.persistent, self.local)
            self.ctx.run = replace(self.ctx.run, resumed_from=path)
            self._fire_with_path("on_checkpoint_load", path)
        return path

    # -- rewinding --------------------------------------------------------------
    def rewind(self, request: RewindRequest) -> None:
        """Roll back to the newest checkpoint before the divergence and go on (see
        :mod:`hookloop.checkpoint.rewind`); the run fails when there is none (its stop
        reason says why). The loop leaves the epoch either way, to start again where
        the restored state stands."""
        st = self.progress
        self.collect(wait=True)  # a checkpoint still being written counts
        managers = [m for m in (self.persistent, self.local) if m is not None]
        chosen = self.rewinder.choose(request.since_step, managers)
        if chosen is None:
            st.stop(
                f"abort: {request.reason}; no checkpoint before step {request.since_step} "
                "to rewind to",
                failed=True,
            )
            return
        path, owner = chosen
        rewind, history = self.rewinder.record(request, path, from_step=st.step)
        restore(path, owner, self.named_state(), *managers)  # exactly as a resume
        self.rewinder.apply(rewind, history)
        discard_after(rewind.to_step, managers)
        self.log.restart_at(st.step)  # the timers' per-step figures count from here
        if st.rank == 0:
            say_rewound(rewind)
        self.ctx.rewind = rewind  # loggers cut back to the restored step, as on a resume
        self._fire_with_path("on_checkpoint_load", path)
        self.ctx.rewind = None
