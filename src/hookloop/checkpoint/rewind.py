"""Rewind: survive a divergence by rolling back, skipping the bad data and going on.

Teams that train large models recover from a loss spike by hand: stop, reload
a checkpoint from before the spike, skip the batches around it, perhaps lower
the learning rate for a while, and restart. A rewind does that inside the
running process. Something (usually ``DivergenceDetector(action="rewind")``)
files :meth:`hookloop.requests.Control.request_rewind` with the step where the
divergence began (``since_step``); at the end of the step the loop, on every
rank at once (the request is agreed like a stop), then:

1. waits for a checkpoint still being written, and picks the newest intact
   checkpoint, persistent or local, taken *before* ``since_step``;
2. restores it exactly as a resume does (model, optimizer, RNG, data position,
   callback state) and fires ``on_checkpoint_load`` with ``ctx.rewind`` set, so
   every logger cuts its records back to the restored step as on a resume;
3. deletes the checkpoints newer than the restored one (they belong to the
   abandoned branch, and ``resume="auto"`` must never pick them);
4. trains on: the batches up to ``since_step`` are the same as before, then
   ``skip_batches`` batches per rank are skipped (by default those trained
   between the divergence's start and its confirmation); for ``lr_steps``
   steps after the restored one the learning rate is multiplied by
   ``lr_factor`` (the schedule itself is left alone).

The rewind history, the skips still ahead, and the batches skipped per epoch
are a checkpoint entry of their own (``rewind``), so a rewound run resumes
exactly. With no checkpoint before ``since_step`` the run ends as failed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hookloop.checkpoint.manager import CheckpointManager
from hookloop.checkpoint.storage import LATEST, CheckpointError, step_of, write_synced
from hookloop.distributed import barrier, broadcast_object, rank_info
from hookloop.requests import RewindRequest
from hookloop.state import Progress, Rewind

log = logging.getLogger("hookloop.checkpoint.rewind")

_NULL_CONTEXT = contextlib.nullcontext()


class Rewinder:
    """A run's rewinds: what was done (``state.rewinds``), the data skips still ahead, the
    batches skipped in each epoch, the learning-rate scaling in force; a named checkpoint
    state (``rewind``)."""

    def __init__(self, progress: Progress, grad_accum: int) -> None:
        self.progress = progress
        self.grad_accum = grad_accum
        self.pending: list[list[int]] = []  # [at_step, batches]: skip before step at_step
        self.skipped: dict[int, int] = {}  # epoch -> batches skipped in it
        self.lr_factor = 1.0
        self.lr_until = 0  # the factor applies to steps up to this one

    # -- checkpoint state --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": [r.to_json() for r in self.progress.rewinds],
            "pending": [list(p) for p in self.pending],
            "skipped": sorted(self.skipped.items()),
            "lr": [self.lr_factor, self.lr_until],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.progress.record_rewinds(tuple(Rewind(**r) for r in saved.get("history", ())))
        self.pending = [list(p) for p in saved.get("pending", ())]
        self.skipped = {int(e): int(n) for e, n in saved.get("skipped", ())}
        self.lr_factor, self.lr_until = saved.get("lr", (1.0, 0))

    # -- the loop's hot path -----------------------------------------------------
    def skip_due(self, step: int) -> bool:
        """Whether batches are to be skipped before step ``step + 1`` begins."""
        return bool(self.pending) and self.pending[0][0] <= step + 1

    def skip(self, batches: Iterator[Any], epoch: int) -> None:
        """Drop the due skip's batches from this epoch's ``batches``; what the epoch
        lacks is skipped at the start of the next one."""
        at_step, wanted = self.pending[0]
        dropped = sum(1 for _ in itertools.islice(batches, wanted))
        self.skipped[epoch] = self.skipped.get(epoch, 0) + dropped
        if dropped == wanted:
            self.pending.pop(0)
        else:
            self.pending[0] = [at_step, wanted - dropped]

    def reposition(self, batches: Iterator[Any], epoch: int, loader: Any) -> Iterator[Any]:
        """At the start of ``epoch`` after a resume or rewind: drop the batches rewinds
        skipped in it before the checkpoint (a loader with its own state already did)."""
        skipped = self.skipped.get(epoch, 0)
        if skipped and not callable(getattr(loader, "state_dict", None)):
            for _ in itertools.islice(batches, skipped):
                pass
        return batches

    def lr_scaled(self, optimizer: torch.optim.Optimizer, step: int) -> Any:
        """A context in which the optimizer steps with the rewind's learning-rate factor."""
        if self.lr_factor == 1.0 or step > self.lr_until:
            return _NULL_CONTEXT
        return _scaled_lr(optimizer, self.lr_factor)

    # -- a rewind ----------------------------------------------------------------
    def choose(
        self, since_step: int, managers: list[CheckpointManager]
    ) -> tuple[Path, CheckpointManager] | None:
        """The newest intact checkpoint before ``since_step`` of any manager (rank 0 looks,
        every rank gets its answer)."""
        found: tuple[str, int] | None = None
        if rank_info()[0] == 0:
            best: tuple[int, str, int] | None = None
            for index, manager in enumerate(managers):
                for path in reversed(manager.storage.complete()):
                    step = step_of(path)
                    if step >= since_step or (best is not None and step <= best[0]):
                        continue
                    try:
                        manager.storage.verify(path)
                    except CheckpointError as err:
                        log.warning("hookloop rewind: skipping damaged checkpoint: %s", err)
                        continue
                    best = (step, str(path), index)
                    break
            found = None if best is None else (best[1], best[2])
        if rank_info()[2] > 1:
            found = broadcast_object(found)
        return None if found is None else (Path(found[0]), managers[found[1]])

    def record(
        self, request: RewindRequest, path: Path, *, from_step: int
    ) -> tuple[Rewind, tuple[Rewind, ...]]:
        """The rewind about to be made, and the history it extends (kept across the
        restore, which loads the older history of the checkpoint)."""
        to_step = step_of(path)
        skip = request.skip_batches
        if skip is None:  # the batches trained while the divergence built up
            skip = (from_step - request.since_step + 1) * self.grad_accum
        rewind = Rewind(
            count=len(self.progress.rewinds) + 1,
            from_step=from_step,
            to_step=to_step,
            since_step=request.since_step,
            batches_skipped=skip,
            checkpoint=str(path),
            reason=request.reason,
            lr_factor=float(request.lr_factor),
            lr_steps=request.lr_steps,
        )
        return rewind, self.progress.rewinds

    def apply(self, rewind: Rewind, history: tuple[Rewind, ...]) -> None:
        """After the restore: the history grows, the skip and the LR factor are planned."""
        self.progress.record_rewinds((*history, rewind))
        if rewind.batches_skipped:
            self.pending.append([rewind.since_step, rewind.batches_skipped])
            self.pending.sort()
        if rewind.lr_steps and rewind.lr_factor != 1.0:
            self.lr_factor, self.lr_until = rewind.lr_factor, rewind.to_step + rewind.lr_steps


def discard_after(step: int, managers: list[CheckpointManager]) -> None:
    """Delete every checkpoint newer than ``step`` (the abandoned branch); ``latest``
    points at the newest one left. Rank 0 does it; every rank waits."""
    if rank_info()[0] == 0:
        for manager in managers:
            storage = manager.storage
            for path in storage.complete():
                if step_of(path) > step:
                    storage.delete(path)
            left = storage.complete()
            pointer = storage.root / LATEST
            if left and storage.latest_name() != left[-1].name:
                staged = storage.root / f".{LATEST}.tmp"
                write_synced(staged, left[-1].name.encode())
                os.replace(staged, pointer)
            elif not left:
                pointer.unlink(missing_ok=True)
    barrier()


@contextlib.contextmanager
def _scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Multiply every group's learning rate for one optimizer step, then put it back."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def say_rewound(rewind: Rewind) -> None:
    """One log line per rewind, with everything the record holds."""
    lr = (
        f"; learning rate x{rewind.lr_factor:g} for {rewind.lr_steps} steps"
        if rewind.lr_steps and rewind.lr_factor != 1.0
        else ""
    )
    log.warning(
        "hookloop rewind %d: %s at step %d; rewound to step %d (%s); %d batches skipped "
        "from step %d%s",
        rewind.count,
        rewind.reason,
        rewind.from_step,
        rewind.to_step,
        rewind.checkpoint,
        rewind.batches_skipped,
        rewind.since_step,
        lr,
    )
