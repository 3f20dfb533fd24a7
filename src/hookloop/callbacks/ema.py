"""An exponential moving average of the weights, swapped in for evaluation.

After each optimizer step that counts (every ``every`` steps, from ``start_step`` on, not
skipped), each parameter's average moves towards it::

    average = decay * average + (1 - decay) * weight        # in float32

Until ``start_step`` the average is a copy of the weights (a warm-up: early weights are
poor and would weigh on the average for long). ``half_life=h`` (in counted updates) is
``decay = 0.5 ** (1 / h)``: after ``h`` updates a weight's share has halved.

The averages live in float32 on the parameters' device, keyed by parameter name (a DDP
wrapper's ``module.`` left out, so a checkpoint resumes on another number of ranks). Under
DDP every rank applies the same update to the same weights, so every rank holds the same
averages with no collective. Under FSDP2 each parameter is a DTensor holding this rank's
shard, and so is its average (the same placement): the update is on the local shards,
elementwise as without sharding, with no collective. A callback's plain state is saved
from rank 0 alone, so the sharded averages go through
:class:`~hookloop.checkpoint.state.ShardedStateful` instead: every rank saves its shards in
the same DCP save as the model's, and a resume (on any number of ranks) reshards them.

A checkpoint's averages are put in place at ``on_checkpoint_load`` (else at
``on_train_start``, for a state loaded by hand), so a rewind goes on from them.

Order with the last checkpoint: the loop's final save comes before ``on_train_end``, so
with ``swap_at_end=True`` the last checkpoint holds the *training* weights and the
averages in this callback's state (a resume goes on exactly); the model in memory after
``train()`` holds the averages, ready to save or serve. :meth:`EMA.averaged_state_dict`
gives them at any time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.distributed import full_tensor, is_sharded, local_shards
from hookloop.state import CallbackContext

#: The decay when neither ``decay`` nor ``half_life`` is given (a half-life of ~693 steps).
DEFAULT_DECAY = 0.999


class EMA(Callback):
    """Exponential moving average of the model's parameters (``decay`` or ``half_life``)."""

    priority = 12  # bookkeeping: the averages are up to date before producers and savers

    def __init__(
        self,
        decay: float | None = None,
        *,
        half_life: float | None = None,
        every: int = 1,
        start_step: int = 0,
        eval_with_ema: bool = True,
        swap_at_end: bool = False,
    ) -> None:
        if decay is not None and half_life is not None:
            raise ValueError("EMA takes one of decay= and half_life=, not both")
        if half_life is not None:
            if isinstance(half_life, bool) or not 0 < half_life < math.inf:
                raise ValueError(f"EMA half_life must be a number of steps > 0, got {half_life!r}")
            decay = 0.5 ** (1.0 / half_life)
        elif decay is None:
            decay = DEFAULT_DECAY
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be a number in [0, 1), got {decay!r}")
        for what, value, least in (("every", every, 1), ("start_step", start_step, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"EMA {what} must be an integer >= {least}, got {value!r}")
        self.decay = float(decay)
        self.every = every
        self.start_step = start_step
        self.eval_with_ema = eval_with_ema
        self.swap_at_end = swap_at_end
        self.updates = 0  # averaging updates applied (warm-up copies not counted)
        self.averages: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] | None = None  # loaded, not yet placed
        self._backup: dict[str, torch.Tensor] | None = None  # training weights while swapped
        self._holds_averages = False  # the model holds the averages (swap_at_end, or an eval)
        self._sharded = False  # the averages are DTensors, sharded like an FSDP2 model
        self._awaiting_shards = False  # loaded a sharded state: its averages come apart
        # A handler set to None is not registered (hookloop.callback): no cost per event.
        if not eval_with_ema:
            self.on_eval_start = self.on_eval_end = None  # type: ignore[assignment]  # see above
            self.on_test_start = self.on_test_end = None  # type: ignore[assignment]  # see above
        if not swap_at_end:
            self.on_train_end = None  # type: ignore[assignment]  # see above

    # -- events -----------------------------------------------------------------------
    def on_train_start(self, ctx: CallbackContext) -> None:
        params = _named_parameters(ctx.model)
        self._sharded = ctx.model is not None and is_sharded(ctx.model)
        self._take_loaded(params)
        if not self.averages:
            self._copy_weights(params)
        self._holds_averages = False

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        """A restore (a resume, a rewind, ``load_checkpoint``) puts the saved averages in
        place at once: after a rewind the run goes on from them, not from the averages of
        the branch it abandoned."""
        if ctx.model is None:
            return  # a bare context: on_train_start places them
        self._take_loaded(_named_parameters(ctx.model))
        self._holds_averages, self._backup = False, None  # the checkpoint's weights are in

    def on_after_optimizer_step(self, ctx: CallbackContext) -> None:
        if ctx.skipped_iter:
            return  # the weights did not move: the average does not either
        step = ctx.state.step
        if step <= self.start_step:
            self._copy_weights(_named_parameters(ctx.model))
        elif (step - self.start_step) % self.every == 0:
            self._update(_named_parameters(ctx.model))

    def on_eval_start(self, ctx: CallbackContext) -> None:
        self._swap_in(ctx)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._swap_out(ctx)

    def on_test_start(self, ctx: CallbackContext) -> None:
        self._swap_in(ctx)

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._swap_out(ctx)

    def on_train_end(self, ctx: CallbackContext) -> None:
        if self.averages and not self._holds_averages:
            _load_into(_named_parameters(ctx.model), self.averages)
            self._holds_averages = True

    # -- the averages -----------------------------------------------------------------
    def _take_loaded(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Averages loaded since the last event, checked against the model and placed."""
        if self._awaiting_shards:
            raise ValueError(
                "EMA state was saved with its averages in the checkpoint's shards, but the "
                "checkpoint holds none; resume from the checkpoint it was saved in"
            )
        if self._pending is not None:
            self.averages = _placed(self._pending, params)
            self._pending = None

    @torch.no_grad()
    def _copy_weights(self, params: dict[str, torch.nn.Parameter]) -> None:
        self.averages = {name: p.detach().float().clone() for name, p in params.items()}

    @torch.no_grad()
    def _update(self, params: dict[str, torch.nn.Parameter]) -> None:
        weight = 1.0 - self.decay
        averages = local_shards(self.averages[name] for name in params)  # in place: no_grad
        for average, p in zip(averages, local_shards(params.values()), strict=True):
            average.lerp_(p.detach().float(), weight)
        self.updates += 1

    def _swap_in(self, ctx: CallbackContext) -> None:
        """Put the averages into the model for an evaluation, keeping the weights aside."""
        if not self.averages or self._holds_averages:
            return  # nothing averaged yet, or the model holds the averages already
        params = _named_parameters(ctx.model)
        with torch.no_grad():
            self._backup = {name: p.detach().clone() for name, p in params.items()}
        _load_into(params, self.averages)

    def _swap_out(self, ctx: CallbackContext) -> None:
        if self._backup is not None:
            _load_into(_named_parameters(ctx.model), self._backup)  # exact: same dtype
            self._backup = None

    def averaged_state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name (float32, whole copies on the CPU). Under FSDP2
        every rank must call it: each average is gathered from the ranks' shards."""
        return {
            name: full_tensor(t.detach()).to("cpu", copy=True) for name, t in self.averages.items()
        }

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._sharded:  # the averages are in sharded_state_dict(), saved by every rank
            return {"decay": self.decay, "updates": self.updates, "averages": {}, "sharded": True}
        # copies: a background save serialises them while training goes on
        averages = self._pending if self._pending is not None else self.averaged_state_dict()
        return {"decay": self.decay, "updates": self.updates, "averages": averages}

    def sharded_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Under FSDP2, this rank's shards of the averages (DTensors) by parameter name: the
        checkpoint saves them beside the model's shards, or loads into them in place (then
        :meth:`load_sharded_state_dict`). Before any average, copies of the weights."""
        if self._pending is not None:
            return self._pending
        if self.averages:
            return self.averages
        with torch.no_grad():
            return {n: p.detach().float().clone() for n, p in _named_parameters(model).items()}

    def load_sharded_state_dict(self, averages: dict[str, torch.Tensor]) -> None:
        """The averages a checkpoint held in its shards (after :meth:`load_state_dict`)."""
        self._pending = dict(averages)  # checked against the model at on_train_start
        self._sharded, self._awaiting_shards = True, False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved state; refused in one line when it is not one this class wrote."""
        if not isinstance(state, dict) or not {"updates", "averages"} <= state.keys():
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"EMA state must hold 'updates' and 'averages', got {keys}")
        averages, updates = state["averages"], state["updates"]
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ValueError(f"EMA state 'updates' must be an integer >= 0, got {updates!r}")
        if not isinstance(averages, dict):
            raise ValueError(f"EMA state 'averages' must be a dict, got {type(averages).__name__}")
        for name, value in averages.items():
            if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                raise ValueError(
                    f"EMA state 'averages'[{name!r}] must be a float32 tensor, "
                    f"got {getattr(value, 'dtype', type(value).__name__)}"
                )
        self.updates = updates
        self._awaiting_shards = state.get("sharded") is True  # load_sharded_state_dict next
        self._pending = None if self._awaiting_shards else dict(averages)


def _named_parameters(model: torch.nn.Module | None) -> dict[str, torch.nn.Parameter]:
    """The parameters by name, without a DDP wrapper's ``module.`` (FSDP2 adds no prefix)."""
    if model is None:
        return {}  # an event fired without a model (a bare context): nothing to average
    inner = getattr(model, "module", model)
    bare = inner if isinstance(inner, torch.nn.Module) else model
    return dict(bare.named_parameters())


def _placed(
    saved: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]
) -> dict[str, torch.Tensor]:
    """Saved averages checked against the model's parameters and moved to their devices."""
    if saved.keys() != params.keys():
        missing = sorted(params.keys() - saved.keys())[:3]
        extra = sorted(saved.keys() - params.keys())[:3]
        raise ValueError(
            f"EMA state does not match the model's parameters (missing {missing}, unknown {extra})"
        )
    for name, p in params.items():
        if saved[name].shape != p.shape:
            raise ValueError(
                f"EMA state for {name!r} has shape {tuple(saved[name].shape)}, "
                f"the parameter {tuple(p.shape)}"
            )
    return {name: saved[name].to(p.device, copy=True) for name, p in params.items()}


@torch.no_grad()
def _load_into(params: dict[str, torch.nn.Parameter], values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` into the parameters (under FSDP2 shard by shard: the same placement)."""
    targets = local_shards(params.values())
    for target, value in zip(targets, local_shards(values[n] for n in params), strict=True):
        target.copy_(value)
