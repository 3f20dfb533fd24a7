"""What ``hookloop train --resume`` runs with: the run's own config, plus what the command changes.

A resumed run reads ``<run>/config.yaml`` (so a non-default recipe need not be
typed again), applies ``--config`` and the command line's overrides on top,
and says which keys changed. Keys whose change would make the checkpoint
meaningless are refused, each with its reason (``train.parallel`` is checked when
the checkpoint loads, against the layout it holds); optimizer hyperparameters given
on the command line win over the restored optimizer state (the run says so).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

from hookloop.callback import Callback
from hookloop.config import Config, apply_overrides, load_yaml, read_yaml_file
from hookloop.errors import ConfigError
from hookloop.optim import move_lr_peak
from hookloop.recipes import default_config
from hookloop.rundir import CONFIG_FILE, RunDir
from hookloop.rundir import LATEST_FILE as LATEST
from hookloop.state import CallbackContext

#: Keys a resume may not change, and why.
FROZEN_ON_RESUME: dict[str, str] = {
    "recipe": "the checkpoint holds another recipe's model",
    "model.": "the checkpoint's weights have the saved model's shape",
    "seed": "the data order and the saved data position follow the seed",
    "data.shuffle": "the saved data position indexes the saved order",
    "optimizer.name": "the saved optimizer state belongs to the saved optimizer",
}


def saved_config(run_dir: Path) -> Path | None:
    """The config a resumed run started from: ``<run>/config.yaml``, or, when that file is
    gone, the copy its newest checkpoint holds (said on stderr); None for neither."""
    run = RunDir(run_dir)
    if run.config.is_file():
        return run.config
    root = run.checkpoints
    if not root.is_dir():
        return None
    latest = root / LATEST
    names = [latest.read_text().strip()] if latest.is_file() else []
    names += sorted((p.name for p in root.glob("step-*")), reverse=True)
    for name in names:
        copy = root / name / CONFIG_FILE
        if name and "/" not in name and copy.is_file():
            print(
                f"hookloop: resume: {run.config} is missing; using the copy in {copy}",
                file=sys.stderr,
            )
            return copy
    return None


def resume_config(
    run_dir: Path,
    recipe: str | None,
    config_file: str | None,
    overrides: list[str],
    saved_file: Path | None = None,
    *,
    what: str = "on resume",
) -> tuple[Config, dict[str, tuple[Any, Any]]]:
    """The run's saved config (``saved_file``, default ``<run>/config.yaml``) with
    ``config_file`` and ``overrides`` applied, and the changes.

    Raises ValueError naming a frozen key that changed and why it cannot (``what``: when,
    in the message: ``on resume``, ``on a branch``).
    """
    saved_file = saved_file or RunDir(run_dir).config
    saved = _load(saved_file, None, [])
    for item in overrides:
        if item.startswith("recipe="):
            recipe = item.split("=", 1)[1]
    cfg = _load(saved_file, config_file, overrides, recipe=recipe or saved.recipe)
    if recipe is not None:
        cfg.recipe = recipe
    changes = diff(saved.to_dict(), cfg.to_dict())
    for key, (old, new) in changes.items():
        why = next((r for k, r in FROZEN_ON_RESUME.items() if key == k or key.startswith(k)), None)
        if why is not None:
            raise ConfigError(
                f"{key} cannot change {what} ({old!r} in {saved_file}, {new!r} now): {why}; "
                "start a new run in another --out directory instead"
            )
    return cfg, changes


def _load(
    saved_file: Path, config_file: str | None, overrides: list[str], recipe: str | None = None
) -> Config:
    cfg = default_config(recipe or _recipe_in(saved_file))
    load_yaml(str(saved_file), cfg)
    if config_file:
        load_yaml(config_file, cfg)
    apply_overrides(cfg, [o for o in overrides if not o.startswith("recipe=")])
    return cfg.validate()


def _recipe_in(saved_file: Path) -> str:
    data = read_yaml_file(saved_file, "run config")
    recipe = data.get("recipe") if isinstance(data, dict) else None
    return recipe if isinstance(recipe, str) else Config().recipe


def diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two nested config dicts."""
    changes: dict[str, tuple[Any, Any]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes.update(diff(a, b, f"{prefix}{key}."))
        elif _norm(a) != _norm(b):
            changes[f"{prefix}{key}"] = (a, b)
    return changes


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


#: Config keys a resume's command line changes as a recorded live change (``set``).
LIVE_ON_RESUME = {f"optimizer.{k}": k for k in ("lr", "weight_decay", "betas", "eps", "momentum")}
#: The client of a change a resume's command line made.
RESUME_CLIENT = "resume-override"


def live_overrides(changes: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """The resume's changes of live keys, as ``set`` values (``{"lr": 0.04}``)."""
    return {LIVE_ON_RESUME[k]: new for k, (_, new) in changes.items() if k in LIVE_ON_RESUME}


def recorded_config(cfg: Config, changes: dict[str, tuple[Any, Any]]) -> Config:
    """The config to write to config.yaml: ``cfg`` with each live key a resume changed
    back at its saved value (the change is a record in changes.jsonl instead, so that
    ``--replay`` starts where the run started and applies it at the step it was made)."""
    recorded = copy.deepcopy(cfg)
    for key, (old, _) in changes.items():
        if key in LIVE_ON_RESUME:
            section, name = key.split(".")
            value = tuple(old) if isinstance(old, list) else old
            setattr(getattr(recorded, section), name, value)
    return recorded


class OptimizerOverrides(Callback):
    """After the checkpoint is restored, apply the optimizer hyperparameters the command changed.

    The restored optimizer state would otherwise keep the saved values. The live keys
    (:data:`LIVE_ON_RESUME`) are applied as a live ``set`` at the restored step, with
    client ``resume-override``: checked like one (a value out of range is refused in
    one line), recorded in changes.jsonl, and so replayed by ``--replay``. A new ``lr``
    moves the running schedule's peak as a live ``set lr=`` does, so the schedule
    continues from the new peak. Any other ``optimizer.*`` key is set in every group
    that has it.
    """

    priority = 0

    def __init__(self, changes: dict[str, Any]) -> None:
        self.changes = {k.split(".", 1)[1]: v for k, v in changes.items()}
        self.live = {k: v for k, v in self.changes.items() if f"optimizer.{k}" in LIVE_ON_RESUME}
        self.ident = f"{time.time_ns():020d}"
        self.recorded = False  # a rewind to before it re-applies it, not re-records it

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        optimizer, scheduler = ctx.optimizer, ctx.scheduler
        if optimizer is None:
            return
        recorded = self.live if ctx.settings is not None else {}
        if recorded:
            self._set(ctx.settings)
        for key, value in self.changes.items():
            for i, group in enumerate(optimizer.param_groups):
                if key in recorded:
                    break  # set above, as a recorded change
                if key == "lr":
                    move_lr_peak(optimizer, scheduler, i, float(value))
                elif key in group:
                    group[key] = tuple(value) if isinstance(value, list) else value
            if ctx.state.is_rank_zero:
                print(
                    f"hookloop: resume: optimizer.{key}={value!r} from the command line "
                    "overrides the restored optimizer state",
                    file=sys.stderr,
                )

    def _set(self, live: Any) -> None:
        """Apply :attr:`live` as one recorded ``set`` (once; again, unrecorded, after a
        rewind to before it), or refuse the command line in one line."""
        if any(r.get("id") == self.ident for r in live.history):
            return
        try:
            live.check(self.live)
        except ValueError as err:
            raise ConfigError(f"resume: optimizer.* on the command line: {err}") from None
        entry = {"values": self.live, "client": RESUME_CLIENT, "replay": self.recorded}
        live.apply({self.ident: entry})
        if not any(r.get("id") == self.ident for r in live.history):
            reason = live.refused[-1]["reason"] if live.refused else "refused"
            raise ConfigError(f"resume: optimizer.* on the command line: {reason}")
        self.recorded = True
