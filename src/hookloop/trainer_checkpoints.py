"""The Trainer's checkpoint side: what a checkpoint holds, saving it (on the loop's
thread or in the background), loading it, and rolling back to one after a divergence.

A mixin of :class:`hookloop.trainer.Trainer`, kept apart so that the loop in
``trainer.py`` reads top to bottom; it uses the Trainer's attributes freely. The
file format and the commit protocol live in :mod:`hookloop.checkpoint`, the
background writer in :mod:`hookloop.checkpoint.background`, what a resume picks in
:mod:`hookloop.checkpoint.local`, the rewind's bookkeeping in :mod:`hookloop.checkpoint.rewind`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hookloop.checkpoint import CallbackStates, DictState, RNGState
from hookloop.checkpoint.background import PendingSave
from hookloop.checkpoint.local import find_resume, restore
from hookloop.checkpoint.rewind import discard_after, say_rewound
from hookloop.distributed import is_sharded
from hookloop.state import RewindRequest, SaveTiming


class TrainerCheckpoints:
    """Checkpoint methods of the Trainer (see the module doc)."""

    def _checkpoint_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds, by name (the names are the file format).

        Loaded in this order: the RNG last, so nothing restored after it draws.
        """
        assert self.checkpoints is not None
        state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        state |= {
            "train_state": self.state,
            "scaler": self.precision,
            "user_state": DictState(self.callbacks.user_state),
            "callbacks": CallbackStates(
                self.callbacks.stateful_callbacks(), strict=self.checkpoints.strict
            ),
            "data": self._data,
            "log_pending": self._losses,
            "rewind": self._rewinder,
            "rng": RNGState(),
        }
        return state

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of this exact state (every rank calls it) and fire
        ``on_checkpoint_save`` once it is committed. None if this step is already saved.

        With ``checkpoint.async_save`` (in training, one process, unsharded) the state
        is copied to host memory here and committed by a writer thread: the path
        returned is where it is being committed, and the event fires at a later step
        boundary with ``ctx.state`` as it was at this step (:mod:`hookloop.checkpoint.background`).
        """
        if self.checkpoints is None:
            raise ValueError("save_checkpoint() needs a run directory: pass out_dir to Trainer")
        st = self.state
        self._sync_tokens()
        self._t_save.start()
        self._collect_saves(wait=True)  # at most one save in flight: the previous one commits
        started = time.perf_counter()
        background = self._saves_in_background()
        job = self.checkpoints.capture(
            self._checkpoint_state(),
            step=st._step,
            epoch=st._epoch,
            config=self.config.to_dict(),
            metrics=st._last_eval,
            copy=self._host_copy if background else None,
        )
        if job is None:
            self._t_save.stop()
            return None
        pending = PendingSave(job.path, copy.copy(st) if background else None, started, 0.0)
        if background:
            pending.blocked = time.perf_counter() - started
            self._saves.start(job.run, pending)
            self._t_save.stop()
            return job.path
        path = job.run()
        self._t_save.stop()
        pending.finished = time.perf_counter()
        pending.blocked = pending.seconds
        self._announce_save(pending)
        return path

    def _saves_in_background(self) -> bool:
        """checkpoint.async_save applies in training, in one process, to an unsharded model
        (several ranks save together: their collectives stay on the loop's thread)."""
        return (
            self.config.checkpoint.async_save
            and self.state._in_training
            and self.state._world_size == 1
            and not is_sharded(self.model)
        )

    def _collect_saves(self, *, wait: bool) -> None:
        """Fire ``on_checkpoint_save`` for a background save that has committed (raising
        its error if it failed); with ``wait``, wait for the one in flight first."""
        pending = self._saves.take(wait=wait)
        if pending is not None:
            self._announce_save(pending)

    def _announce_save(self, pending: PendingSave) -> None:
        """``on_checkpoint_save`` with the save's timing, handlers seeing the saved step's state."""
        timing = SaveTiming(seconds=pending.seconds, blocked_seconds=pending.blocked)
        self.ctx.checkpoint_timing = timing
        self._unlogged_saves.append(timing)
        live = self.ctx.state
        if pending.state is not None:
            self.ctx.state = pending.state
        try:
            self._fire_checkpoint_event("on_checkpoint_save", pending.path)
        finally:
            self.ctx.state = live

    def _save_local_checkpoint(self) -> None:
        """A local checkpoint: the same state, kept only until the next (no event fired)."""
        st = self.state
        self._sync_tokens()
        self.local_checkpoints.save(  # type: ignore[union-attr]
            self._checkpoint_state(),
            step=st._step,
            epoch=st._epoch,
            config=self.config.to_dict(),
            metrics=st._last_eval,
        )

    def load_checkpoint(self, target: str) -> Path | None:
        """Restore from ``"auto"`` (the newest intact checkpoint) or a path, and fire
        ``on_checkpoint_load``. None when ``"auto"`` finds nothing to resume."""
        if self.checkpoints is None:
            raise ValueError("load_checkpoint() needs out_dir or resume: pass one to Trainer")
        path, owner = find_resume(target, self.checkpoints, self.local_checkpoints)
        if path is not None:
            restore(path, owner, self._checkpoint_state(), self.checkpoints, self.local_checkpoints)
            self.ctx.run = replace(self.ctx.run, resumed_from=path)
            self._fire_checkpoint_event("on_checkpoint_load", path)
        return path

    def _fire_checkpoint_event(self, event: str, path: Path) -> None:
        self.ctx.checkpoint_path = path
        self._fire(event)
        self.ctx.checkpoint_path = self.ctx.checkpoint_timing = None

    def _rewind(self, request: RewindRequest) -> bool:
        """Roll back to the newest checkpoint before the divergence and go on (see
        :mod:`hookloop.checkpoint.rewind`); the run fails when there is none. Returns True: the
        epoch loop is left, to start again where the restored state stands."""
        st = self.state
        self._collect_saves(wait=True)  # a checkpoint still being written counts
        managers = [m for m in (self.checkpoints, self.local_checkpoints) if m is not None]
        chosen = self._rewinder.choose(request.since_step, managers)
        if chosen is None:
            st._stop_reason = (
                f"abort: {request.reason}; no checkpoint before step {request.since_step} "
                "to rewind to"
            )
            st._failed = True
            return True
        path, owner = chosen
        rewind, history = self._rewinder.record(request, path, from_step=st._step)
        restore(path, owner, self._checkpoint_state(), *managers)  # exactly as a resume
        self._rewinder.apply(rewind, history)
        discard_after(rewind.to_step, managers)
        self._pending_tokens.clear()
        self._last_log_step = st._step  # the timers' per-step figures count from here
        if st.is_rank_zero:
            say_rewound(rewind)
        self.ctx.rewind = rewind  # loggers cut back to the restored step, as on a resume
        self._fire_checkpoint_event("on_checkpoint_load", path)
        self.ctx.rewind = None
        return True
