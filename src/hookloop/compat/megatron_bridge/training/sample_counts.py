"""``train_state.consumed_valid_samples`` of a ``pretrain()``/``finetune()`` run.

Megatron-Bridge counts every sample its validation and test passes read, across the
whole run (a resumed run goes on from the saved count). hookloop's loop does not keep
that count, so this native callback does: after each validation or test batch it adds
the batch's samples times the data-parallel ranks, and it is saved in checkpoints with
the other callbacks' state.

``skipped_train_samples`` needs no counter here: ``pretrain()`` trains every step
(``train.iterations_to_skip`` is for ``training.train.train``) and its batch size never
shrinks, so it stays 0, as Megatron-Bridge's would.
"""

from __future__ import annotations

from typing import Any

from hookloop.callback import Callback
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.state import CallbackContext
from hookloop.step import batch_size_of


class ValidSampleCounter(Callback):
    """Adds each validation/test batch's samples to ``consumed_valid_samples``."""

    def __init__(self, global_state: GlobalState) -> None:
        self.global_state = global_state

    @property
    def name(self) -> str:
        return "MegatronBridgeValidSamples"

    def on_eval_step_end(self, ctx: CallbackContext) -> None:
        self._count(ctx)

    def on_test_step_end(self, ctx: CallbackContext) -> None:
        self._count(ctx)

    def _count(self, ctx: CallbackContext) -> None:
        samples = batch_size_of(ctx.batch) * ctx.state.world_size
        self.global_state.train_state.consumed_valid_samples += samples

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_valid_samples": self.global_state.train_state.consumed_valid_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        count = state.get("consumed_valid_samples")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"saved consumed_valid_samples must be an int >= 0, got {count!r}")
        self.global_state.train_state.consumed_valid_samples = count
