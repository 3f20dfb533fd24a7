"""Local (non-persistent) checkpoints, and the choice of what ``resume="auto"`` restores.

A long job loses everything since its last checkpoint when a node dies, yet a
full persistent checkpoint every few steps costs too much. A *local*
checkpoint is the cheap, frequent one (``checkpoint.local_every``): the same
format and atomic commit as a persistent one (a second
:class:`~hookloop.checkpoint.manager.CheckpointManager` with its own root), but only
the newest is kept, and it is never the run's output: it is not ``latest`` of
``checkpoints/``, not counted by that folder's retention, not announced
through ``on_checkpoint_save``, and not what ``load_weights`` or an export
reads.

``resume="auto"`` restores the newest *intact* checkpoint of both kinds; a
damaged local one is passed over for the persistent one, with a warning naming
both paths.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookloop.callback import Stateful
from hookloop.checkpoint.manager import CheckpointManager, SavePolicy
from hookloop.checkpoint.storage import CheckpointError, step_of
from hookloop.errors import ConfigError
from hookloop.rundir import LOCAL_CHECKPOINTS_DIR, RunDir, enclosing_run, is_checkpoint, is_run_dir


def local_manager(config: Any, run: RunDir, *, resuming: bool) -> CheckpointManager | None:
    """The manager of the run's local checkpoints (keep 1, nothing at the end), or None
    when ``checkpoint.local_every`` is off.

    Like the persistent one, it refuses to start a new run over local checkpoints
    that another run left behind.
    """
    if config.local_every is None:
        return None
    root = Path(config.local_dir) if config.local_dir else run.local_checkpoints
    if root.resolve() == run.checkpoints.resolve():
        raise ConfigError(
            f"checkpoint.local_dir={config.local_dir!r} is the run's persistent checkpoints "
            "folder; local checkpoints need a folder of their own (null: "
            f"{LOCAL_CHECKPOINTS_DIR}/ in the run directory)"
        )
    if config.local_dir:
        _refuse_anothers(root, run)
    policy = SavePolicy(every=config.local_every, keep_last=1, save_on_end=False)
    manager = CheckpointManager(
        root, policy, strict=config.strict_resume, allow_restart=config.allow_restart
    )
    if not resuming and manager.storage.complete():
        raise ConfigError(
            f"{root} (checkpoint.local_dir) already holds local checkpoints of a run; continue "
            "it with resume='auto' (CLI: --resume auto) or choose another local_dir"
        )
    return manager


def _refuse_anothers(root: Path, run: RunDir) -> None:
    """``checkpoint.local_dir`` may lie in this run's directory or outside every run, but
    never inside another run's directory or any checkpoint: it is written without that run's
    lock, and that run's resume would load this run's state."""
    own = Path(os.path.realpath(run.root))
    inside = enclosing_run(root)
    if inside is not None and inside[0] != own:
        owner, kind = inside
        raise ConfigError(
            f"checkpoint.local_dir={str(root)!r} lies inside {kind} {owner}, not this run's "
            f"directory {run.root}; give it a folder of its own (null: {LOCAL_CHECKPOINTS_DIR}/ "
            "in the run directory)"
        )
    resolved = Path(os.path.realpath(root))
    if resolved != own and (is_checkpoint(resolved) or is_run_dir(resolved)):
        raise ConfigError(
            f"checkpoint.local_dir={str(root)!r} is another run's directory or a checkpoint; "
            f"give it a folder of its own (null: {LOCAL_CHECKPOINTS_DIR}/ in the run directory)"
        )


def newest_intact_local(
    local: CheckpointManager, state: Mapping[str, Stateful] | None = None
) -> tuple[Path | None, list[str]]:
    """The newest local checkpoint that verifies (and reads, given ``state``), and what was
    wrong with newer ones."""
    damaged: list[str] = []
    for path in reversed(local.storage.complete()):
        try:
            local.check(path, state)
            return path, damaged
        except CheckpointError as err:
            damaged.append(str(err))
    return None, damaged


def find_resume(
    target: str,
    persistent: CheckpointManager,
    local: CheckpointManager | None,
    state: Mapping[str, Stateful] | None = None,
) -> tuple[Path | None, CheckpointManager]:
    """The checkpoint ``target`` names, and the manager it belongs to.

    ``"auto"`` with local checkpoints on: the newer of the newest intact local
    and the newest intact persistent checkpoint. A damaged local checkpoint is
    said (a warning naming it and the checkpoint used instead) and skipped.
    Given ``state``, "intact" includes reading the checkpoint for it.
    """
    if target != "auto" or local is None:
        return persistent.find(target, state), persistent
    local_path, damaged = newest_intact_local(local, state)
    persistent_path, persistent_error = None, None
    if persistent.storage.complete():
        try:
            persistent_path = persistent.find("auto", state)
        except CheckpointError as err:  # every persistent one damaged: a local one may do
            persistent_error = err
    if persistent_error is not None and local_path is None:
        raise persistent_error
    chosen: Path | None
    if local_path is not None and (
        persistent_path is None or step_of(local_path) > step_of(persistent_path)
    ):
        chosen, owner = local_path, local
    else:
        chosen, owner = persistent_path, persistent
    if damaged:
        instead = f"resuming from {chosen}" if chosen is not None else "no checkpoint is left"
        warnings.warn(
            f"hookloop resume: the local checkpoint is damaged ({damaged[0]}); {instead} instead",
            stacklevel=3,
        )
        if chosen is None and not persistent.allow_restart:
            raise CheckpointError(
                f"no intact checkpoint to resume: the local one in {local.storage.root} is "
                f"damaged ({damaged[0]}) and {persistent.storage.root} holds none; start over "
                "with --allow-restart (checkpoint.allow_restart=true)"
            )
    if persistent_error is not None:
        warnings.warn(
            f"hookloop resume: {persistent_error}; resuming from the local checkpoint {chosen}",
            stacklevel=3,
        )
    return chosen, owner


def restore(
    path: Path, owner: CheckpointManager, state: Mapping[str, Stateful], *others: Any
) -> None:
    """Load ``state`` from ``path``; every manager learns the step is saved where it is."""
    owner.restore(path, state)
    for other in others:
        if other is not None and other is not owner:
            other.last_saved_step = None
