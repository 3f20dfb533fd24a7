"""Live settings: change a running job's hyperparameters, recorded and replayed exactly.

``hookloop ctl set JOB lr=3e-4 clip_grad_norm=0.5`` (or ``POST /jobs/<id>/control``
with ``{"command": "set", "values": {...}}``) files one ``set`` request. The server
checks it first (:meth:`LiveSettings.check`: an unknown key, a wrong type, a value
out of range or a key fixed for the run's life is refused whole, naming the key and
what is allowed, and nothing changes). The loop agrees it across ranks like any
request and, at the end of the step it was agreed at, on every rank,
:meth:`LiveSettings.apply`:

1. checks the values again and works out each key's old and new value;
2. changes the values, and checks what the optimizer now holds (every group's rate
   within :data:`~hookloop.loop.live_values.MAX_RATE`, finite in its dtype);
3. appends one record to the run directory's ``changes.jsonl`` (rank 0, chained:
   :mod:`hookloop.loop.changes`; fsynced before any step runs with the new values, so
   no applied change is ever missing from it);
4. fires ``on_settings_change`` with ``ctx.changes`` (the loggers write it into
   ``metrics.jsonl``, TensorBoard and ``progress.txt``).

If step 2 or 3 fails (a value the optimizer cannot take, a full disk), the old values are
put back and the ``set`` refused: nothing recorded, the reason one line on stderr, in
:attr:`LiveSettings.refused` and in the control server's reply. A change replayed from
``changes.jsonl`` that fails stops the run in one line naming it and ``--skip-change ID``.

What can change (:meth:`LiveSettings.settable` lists a run's own):

=====================  ==================================================================
``lr``                 the learning rate's peak: with a schedule, its base rates
                       (``base_lrs``) and the current rate are scaled alike, so warm-up
                       and decay go on in the same shape; without one, the rate itself
``lr_scale``           multiply the current rate (and the schedule's peak) by a factor
``weight_decay``,      the optimizer's own hyperparameters, where its parameter groups
``momentum``,          have them; ``KEY@N`` changes parameter group ``N`` alone
``betas``, ``eps``
``clip_grad_norm``     the gradient-clipping norm (null: off)
``max_steps``          the step budget, not below the current step (the schedule's length stays)
``log_every``,         the cadences (``train.log_every``, ``train.eval_every``,
``eval_every``,        ``checkpoint.every``)
``save_every``
``Callback.attr``      an attribute a callback lists in its ``settable`` tuple (the new
                       value must have the old one's type)
=====================  ==================================================================

Replay. The changes travel in each checkpoint (the ``settings`` entry: every change
up to its step, and the current value of each changed key the optimizer does not
hold itself). A resume restores them, then re-applies every record of
``changes.jsonl`` past the restored step at the step it was first applied at, so a
steered run killed at any moment and resumed ends on the same weights, bit for bit,
as if it had never stopped. ``hookloop train --replay RUN`` replays a finished run's
changes from scratch. Before replaying, the file's chain is checked
(:func:`~hookloop.loop.changes.read_replayable`): a record edited by hand is refused.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from hookloop.distributed import broadcast_object, gather_objects, rank_info
from hookloop.errors import ConfigError
from hookloop.loop.changes import append_change, describe, read_changes, read_replayable
from hookloop.loop.live_values import (
    MAX_RATE,
    OPTIMIZER_CHECKS,
    Setting,
    SettingChange,
    SettingError,
    check_groups,
    check_recorded,
    fixed_keys,
    interval,
    plain,
    positive,
    positive_or_off,
    same_type_as_attribute,
)
from hookloop.loop.pause import Pauses
from hookloop.loop.records import Trained
from hookloop.loop.schedule_changes import Scheduled, max_steps_setting
from hookloop.optim import lr_peak, move_lr_peak
from hookloop.requests import register_kind
from hookloop.rundir import RunDir
from hookloop.state import RunInfo

register_kind("set", "change live settings (learning rate, clipping, cadences, ...)")

__all__ = ["LiveSettings", "Setting", "SettingChange", "SettingError", "read_changes"]

#: The optimizer hyperparameters ``set`` may change, where the param groups have them.
OPTIMIZER_KEYS = ("lr", "weight_decay", "momentum", "betas", "eps")
#: Config keys fixed for a run's life (the shape of the model, the data, the budget...).
FIXED_REASON = "it is fixed for the run's life (change it in the config and start a new run)"
#: The longest client description kept in a record.
MAX_CLIENT = 120
#: How many refused ``set`` s (and outcomes for the control server) are kept.
MAX_KEPT = 50


# -- the settings of one run ---------------------------------------------------------------


class LiveSettings:
    """The live settings of one run (a part of the loop; see the module doc)."""

    def __init__(
        self,
        *,
        trained: Trained,
        config: Any,
        clipping: Any,
        persistent: Any,
        callbacks: Any,
        control: Any,
        progress: Any,
        run: RunInfo,
    ) -> None:
        """``persistent``: the run's checkpoint manager (None: no checkpoints, so no
        ``save_every``); ``run``: the run's facts (its directory, whether it has
        evaluation data). A run without a directory of its own records its changes in
        the run its checkpoints belong to."""
        self.optimizer, self.scheduler, self.config = trained.optimizer, trained.scheduler, config
        self.clipping, self.persistent, self.callbacks = clipping, persistent, callbacks
        self.control, self.progress, self.has_eval = control, progress, run.has_eval_data
        self.run_dir: RunDir | None = run.dir
        if self.run_dir is None and persistent is not None:
            self.run_dir = RunDir.of_checkpoint(persistent.storage.root)
        #: Every change applied so far (and restored from the checkpoint), oldest first.
        self.history: list[dict[str, Any]] = []
        #: The ``set`` s refused when applied, newest last (the last :data:`MAX_KEPT`).
        self.refused: list[dict[str, Any]] = []
        #: A run whose changes ``hookloop train --replay`` re-applies from scratch.
        self.replay_from: RunDir | None = None
        #: Ids of recorded changes a resume or replay leaves out (``--skip-change``).
        self.skip_changes: set[str] = set()
        self._settings = self._loop_settings()
        self._mirrors: dict[str, list[Callable[[Any], None]]] = {}
        self._outcomes: dict[str, dict[str, Any]] = {}
        self._decided = threading.Condition()
        self.pauses, self.later = Pauses(), Scheduled(self)  # hookloop.loop.pause, ...
        self._check_start()

    def _check_start(self) -> None:
        """The optimizer's rates as the run starts within range (one line naming them)."""
        groups = self.optimizer.param_groups
        try:
            check_groups(groups, [self._peak(i) for i in range(len(groups))])
        except SettingError as err:
            raise ConfigError(f"the optimizer's {err} (optimizer.* in the config)") from None

    # -- what can change --------------------------------------------------------------
    def _loop_settings(self) -> dict[str, Setting]:
        cfg, persistent = self.config.train, self.persistent
        settings: dict[str, Setting] = {}
        for key in OPTIMIZER_KEYS:
            groups = self.optimizer.param_groups
            if all(key in g for g in groups):
                settings[key] = self._group_setting(key, None)
                for index in range(len(groups)):
                    settings[f"{key}@{index}"] = self._group_setting(key, index)
        clipping = self.clipping

        def put_clip(value: Any) -> None:
            clipping.max_norm = value if value is not None else clipping.off_value

        settings["clip_grad_norm"] = Setting(
            "the gradient-clipping norm (null: off)",
            lambda: None if clipping.max_norm in (None, math.inf) else clipping.max_norm,
            put_clip,
            positive_or_off,
        )
        settings["max_steps"] = max_steps_setting(self.progress, cfg)
        settings["log_every"] = Setting(
            "fire the logging events every N steps (0: never)",
            lambda: cfg.log_every,
            lambda v: setattr(cfg, "log_every", v),
            lambda k, v: interval(k, v, off=0),
        )
        if self.has_eval:
            settings["eval_every"] = Setting(
                "evaluate every N steps (null: not by steps)",
                lambda: cfg.eval_every,
                lambda v: setattr(cfg, "eval_every", v),
                lambda k, v: interval(k, v, off=None),
            )
        if persistent is not None:
            policy = persistent.policy
            settings["save_every"] = Setting(
                "save a checkpoint every N steps (null: only at the end and on request)",
                lambda: policy.every,
                lambda v: setattr(policy, "every", v),
                lambda k, v: interval(k, v, off=None),
            )
        return settings

    def _group_setting(self, key: str, index: int | None) -> Setting:
        check = OPTIMIZER_CHECKS[key]
        where = "every parameter group" if index is None else f"parameter group {index}"
        if key == "lr":

            def put_peak(value: float) -> None:
                for i in self._chosen(key, index):
                    self._set_peak(i, value)

            return Setting(
                f"the learning rate's peak in {where}",
                lambda: self._one([self._peak(i) for i in self._chosen(key, index)]),
                put_peak,
                check,
                in_optimizer=True,
            )

        def put(value: Any) -> None:
            groups = self.optimizer.param_groups  # replaced by a resume: read it each time
            for i in self._chosen(key, index):
                groups[i][key] = value

        return Setting(
            f"the optimizer's {key} in {where}",
            lambda: self._one(
                [plain(self.optimizer.param_groups[i][key]) for i in self._chosen(key, index)]
            ),
            put,
            check,
            in_optimizer=True,
        )

    def _chosen(self, key: str, index: int | None) -> list[int]:
        """The parameter groups a key changes: group ``index``, or every group (for
        ``weight_decay``, every group that decays, unless none does)."""
        if index is not None:
            return [index]
        groups = self.optimizer.param_groups
        every = list(range(len(groups)))
        if key == "weight_decay":
            return [i for i in every if groups[i]["weight_decay"]] or every
        return every

    @staticmethod
    def _one(values: list[Any]) -> Any:
        return values[0] if all(v == values[0] for v in values) else values

    def _peak(self, index: int) -> float:
        return lr_peak(self.optimizer, self.scheduler, index)

    def _set_peak(self, index: int, value: float) -> None:
        move_lr_peak(self.optimizer, self.scheduler, index, value)

    def define(self, key: str, setting: Setting) -> None:
        """Add a settable key, or replace how one is read and written (a dialect whose
        cadences live elsewhere: transformers' ``TrainingArguments``)."""
        self._settings[key] = setting

    def mirror(self, key: str, follow: Callable[[Any], None]) -> None:
        """Call ``follow(new value)`` after ``key`` changes (a dialect's copy of it, such as
        ``TrainingArguments.learning_rate``), and after a resume restores it."""
        self._mirrors.setdefault(key, []).append(follow)

    def callback_settings(self) -> dict[str, Setting]:
        """The attributes callbacks list in their ``settable`` tuple, as ``Name.attr``."""
        found: dict[str, Setting] = {}
        for cb in self.callbacks.callbacks:
            for attr in getattr(cb, "settable", ()) or ():
                key = f"{cb.name}.{attr}"
                found[key] = Setting(
                    f"{type(cb).__name__}.{attr}",
                    partial(getattr, cb, attr),
                    partial(setattr, cb, attr),
                    partial(same_type_as_attribute, cb, attr),
                )
        return found

    def settable(self) -> dict[str, Setting]:
        """Every key this run can change now, with its setting."""
        return {**self._settings, **self.callback_settings()}

    def values(self) -> dict[str, Any]:
        """The current value of every settable key (``KEY@N`` only where the groups differ)."""
        settable, out = self.settable(), {}
        for key, setting in settable.items():
            base, _, index = key.partition("@")
            if index:
                groups = [
                    settable[f"{base}@{i}"].get() for i in range(len(self.optimizer.param_groups))
                ]
                if all(v == groups[0] for v in groups):
                    continue
            out[key] = plain(setting.get())
        return out

    def describe(self) -> str:
        keys = [k for k in self.settable() if "@" not in k]
        groups = len(self.optimizer.param_groups)
        per_group = f"; per parameter group: KEY@N with N < {groups}" if groups > 1 else ""
        return ", ".join([*keys[:1], "lr_scale", *keys[1:]]) + per_group

    # -- checking a request -----------------------------------------------------------
    def check(self, values: Any) -> dict[str, Any]:
        """The values of a ``set``, checked whole against this run (:class:`SettingError`
        naming the first wrong key); the checked values come back normalised."""
        if not isinstance(values, dict) or not values:
            raise SettingError(
                f"set needs at least one KEY=VALUE; settable here: {self.describe()}"
            )
        settable, checked = self.settable(), {}
        if "lr" in values and "lr_scale" in values:
            raise SettingError("give lr or lr_scale, not both")
        for key, value in values.items():
            if key == "lr_scale":
                checked[key] = self._check_scale(key, value)
                continue
            setting = settable.get(key)
            if setting is None:
                raise SettingError(self._unknown(key))
            if (
                key in OPTIMIZER_KEYS
                and isinstance(current := setting.get(), list)
                and (key != "betas" or isinstance(current[0], list))
            ):
                raise SettingError(
                    f"{key}: the parameter groups hold different values {current}; set "
                    f"{key}@N for group N (N < {len(self.optimizer.param_groups)})"
                    + ("" if key != "lr" else " or scale them all with lr_scale")
                )
            checked[key] = setting.check(key, value)
        return checked

    def _check_scale(self, key: str, value: Any) -> float:
        """``lr_scale``: a factor > 0 that keeps every group's peak rate in range."""
        scale = positive(key, value)
        for index in range(len(self.optimizer.param_groups)):
            new = self._peak(index) * scale
            if not new <= MAX_RATE:
                raise SettingError(
                    f"{key}={scale:g} is out of range: it would make lr {new:g}, and lr is "
                    f"allowed (0, {MAX_RATE:g}]"
                )
        return scale

    def _unknown(self, key: Any) -> str:
        name = str(key)
        base = name.split("@")[0]
        if "@" in name and base in OPTIMIZER_KEYS and base in self._settings:
            groups = len(self.optimizer.param_groups)
            return (
                f"{name}: this optimizer has {groups} parameter group(s); "
                f"use {base}@N with N < {groups}"
            )
        if base in OPTIMIZER_KEYS:
            return (
                f"{name}: this run's optimizer ({type(self.optimizer).__name__}) has no {base}; "
                f"settable here: {self.describe()}"
            )
        if name == "eval_every":
            return f"eval_every: this run has no evaluation data; settable: {self.describe()}"
        if name == "save_every":
            return (
                "save_every: this run writes no checkpoints (no output directory); "
                f"settable: {self.describe()}"
            )
        if base in fixed_keys(self.config):
            return f"{name} cannot change mid-run: {FIXED_REASON}; settable: {self.describe()}"
        shown = name if len(name) <= 60 else name[:57] + "..."
        return f"unknown setting {shown!r}; settable here: {self.describe()}"

    # -- applying a request (the loop, on every rank) --------------------------------
    def apply(self, request: dict[str, Any]) -> list[SettingChange]:
        """Carry out the ``set`` requests agreed at this step's end, oldest first.

        A request refused here is undone and reported (:meth:`refuse`); one replayed
        from a ``changes.jsonl`` stops the run instead (a :class:`ConfigError` naming it)."""
        applied: list[SettingChange] = []
        for ident in sorted(request):
            asked = request[ident]
            try:
                if self.later.file(ident, asked):  # for a later step (schedule_changes)
                    continue
                record, changes = self._apply_one(ident, asked)
            except SettingError as err:
                self.refuse(ident, asked, str(err))
                continue
            self.history.append(record)
            self.later.applied(ident)
            self.decide(ident, {"id": ident, "step": record["step"], "applied": True})
            applied.extend(changes)
        return applied

    def _apply_one(
        self, ident: str, asked: dict[str, Any]
    ) -> tuple[dict[str, Any], list[SettingChange]]:
        """Check, set, verify, record (in that order); on any failure put the old values
        back and raise :class:`SettingError` with the reason."""
        values = self.check(asked["values"])
        changes = self._plan(values, str(asked.get("client") or "unknown")[:MAX_CLIENT])
        record = {
            "id": ident,
            "step": self.progress.step,
            "values": {k: plain(v) for k, v in values.items()},
            "changes": [c.to_json() for c in changes],
            "client": changes[0].client if changes else "",
            "time": time.time(),
        }
        saved = self._snapshot(values)
        failure: str | None = None
        try:
            self._put(values)
            groups = self.optimizer.param_groups
            check_groups(groups, [self._peak(i) for i in range(len(groups))])
            if not asked.get("replay"):  # a record replayed from this run's file is there
                record = self._append(record)
        except SettingError as err:
            failure = str(err)
        except OSError as err:  # the record could not be written: the change is not made
            failure = f"its record could not be written: {' '.join(str(err).split())}"
        except Exception as err:  # a setter that failed half-way: undo what it did
            failure = f"applying it failed: {type(err).__name__}: {err}"
        failure = self._agree(failure)
        if failure is not None:
            self._restore(saved)
            raise SettingError(failure)
        return record, changes

    def _agree(self, failure: str | None) -> str | None:
        """Every rank undoes a change any rank could not make (rank 0 writes the record)."""
        if rank_info()[2] == 1:
            return failure
        return next((f for f in gather_objects(failure) if f is not None), None)

    def _snapshot(self, values: dict[str, Any]) -> dict[str, Any]:
        """What :meth:`_restore` needs to undo ``values``: the param groups' settings, the
        schedule's peaks and the current value of every other key changed."""
        settable = self.settable()
        return {
            "groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ],
            "peaks": list(getattr(self.scheduler, "base_lrs", None) or []),
            "others": {
                k: settable[k].get()
                for k in values
                if k in settable and not settable[k].in_optimizer
            },
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        for group, kept in zip(self.optimizer.param_groups, saved["groups"], strict=True):
            group.update(kept)
        if saved["peaks"]:
            self.scheduler.base_lrs[:] = saved["peaks"]
        settable = self.settable()
        for key, value in saved["others"].items():
            settable[key].put(value)
        for key in [*OPTIMIZER_KEYS, *saved["others"]]:
            self._follow(key)

    def refuse(self, ident: str, asked: dict[str, Any], reason: str) -> None:
        """A ``set`` not applied: said on stderr and kept for the control server; one
        replayed from a ``changes.jsonl`` stops the run, naming the record."""
        step = self.progress.step
        if asked.get("recorded"):
            what = describe({"id": ident, "step": step, "values": asked.get("values")})
            raise ConfigError(
                f"{asked['recorded']}: change {what} cannot be applied: {reason}; to go on "
                f"without it, add --skip-change {ident}"
            )
        if rank_info()[0] == 0:
            print(f"hookloop: set refused at step {step}: {reason}", file=sys.stderr, flush=True)
        outcome = {"id": ident, "step": step, "applied": False, "reason": reason}
        self.refused = [*self.refused[-(MAX_KEPT - 1) :], outcome]
        self.decide(ident, outcome)

    def decide(self, ident: str, outcome: dict[str, Any]) -> None:
        with self._decided:
            self._outcomes[ident] = outcome
            while len(self._outcomes) > MAX_KEPT:
                self._outcomes.pop(next(iter(self._outcomes)))
            self._decided.notify_all()

    def outcome(self, ident: str, timeout: float) -> dict[str, Any] | None:
        """What became of the ``set`` filed as ``ident`` (``applied``, and ``reason`` when
        it was refused), waiting up to ``timeout`` seconds; None: not applied yet."""
        with self._decided:
            self._decided.wait_for(lambda: ident in self._outcomes, timeout)
            return self._outcomes.get(ident)

    def _plan(self, values: dict[str, Any], client: str) -> list[SettingChange]:
        settable, step, now = self.settable(), self.progress.step, time.time()
        changes = []
        for key, value in values.items():
            if key == "lr_scale":
                old = settable["lr"].get()
                new = [v * value for v in old] if isinstance(old, list) else old * value
                changes.append(SettingChange(step, "lr", old, new, client, now))
                continue
            changes.append(
                SettingChange(step, key, plain(settable[key].get()), plain(value), client, now)
            )
        return changes

    def _put(self, values: dict[str, Any]) -> None:
        settable = self.settable()
        for key, value in values.items():
            if key == "lr_scale":
                for index in range(len(self.optimizer.param_groups)):
                    self._set_peak(index, self._peak(index) * value)
            else:
                settable[key].put(value)
            self._follow("lr" if key == "lr_scale" else key)

    def _follow(self, key: str) -> None:
        """Tell the key's mirrors its new value."""
        if key in self._mirrors:
            value = self.settable()[key].get()
            for follow in self._mirrors[key]:
                follow(value)

    def _append(self, record: dict[str, Any]) -> dict[str, Any]:
        """One record in ``changes.jsonl`` (rank 0), on disk before any step runs with the
        change; returns it as written (chained)."""
        if self.run_dir is None or rank_info()[0] != 0:
            return record
        # A line a kill tore (its change was never made) is cut first; fsynced before return.
        return append_change(self.run_dir.changes, record)

    # -- replay ---------------------------------------------------------------------------
    def plan_replays(self, source: RunDir | None = None, *, fresh: bool = False) -> int:
        """File, for the step each was applied at, every recorded change past the current
        step that this run has not applied (after a resume or a rewind, or from ``source``
        for ``--replay``). Returns how many are planned. ``fresh``: a new run in this
        directory; the changes a former run recorded are kept aside, not replayed."""
        if fresh and source is None:
            self._set_aside()
            return 0
        self.control.cancel_later("set")
        own = source is None or (self.run_dir is not None and source.root == self.run_dir.root)
        source = source or self.run_dir
        records = None
        if rank_info()[0] == 0 or rank_info()[2] == 1:
            records = self._replayable(source) if source is not None else []
        if rank_info()[2] > 1:
            records = broadcast_object(records)
        records = self.later.replayable(records or [])  # no pause, no cancelled change
        done = {r["id"] for r in self.history}
        step, planned, now = self.progress.step, 0, {}
        for record in records:
            if record["id"] in done or record["step"] < step:
                continue
            assert source is not None  # records come from a run directory
            check_recorded(record, source.changes)
            entry = {
                "values": record["values"],
                "client": record.get("client") or "unknown",
                "replay": own,
                "recorded": str(source.changes),
            }
            if record["step"] == step:  # made after the restored checkpoint was written
                now[record["id"]] = entry
            else:
                self.control.request_later(record["step"], "set", **{record["id"]: entry})
            planned += 1
        self.apply(now)
        return planned

    def _replayable(self, source: RunDir) -> list[dict[str, Any]]:
        """The records of ``source`` a replay may apply (chain checked, ``--skip-change``
        ids left out), or a one-line ConfigError naming the first that is not."""
        return read_replayable(source.changes, self.skip_changes)

    def _set_aside(self) -> None:
        """A former run's ``changes.jsonl`` becomes ``changes-<time>.jsonl`` (rank 0)."""
        if self.run_dir is None or rank_info()[0] != 0 or not self.run_dir.changes.is_file():
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.replace(self.run_dir.changes, self.run_dir.changes.with_name(f"changes-{stamp}.jsonl"))

    # -- checkpoint state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        settable = self.settable()
        changed = {k for r in self.history for k in r["values"]} - {"lr_scale"}
        current = {
            k: plain(settable[k].get())
            for k in sorted(changed)
            if k in settable and not settable[k].in_optimizer
        }
        return {"history": [dict(r) for r in self.history], "values": current}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.history = [dict(r) for r in saved.get("history", ())]
        settable = self.settable()
        for key, value in saved.get("values", {}).items():
            if key in settable:
                settable[key].put(tuple(value) if isinstance(value, list) else value)
        for key in {k for r in self.history for k in r["values"]}:  # the dialects' copies
            self._follow("lr" if key == "lr_scale" else key)
