"""DiLoCo: local training with an outer optimizer over pseudo-gradients.

Two transports, one outer step (:mod:`hookloop.diloco.outer`):

- :class:`DiLoCo` (this module): the ranks of one ``torch.distributed`` job
  average their pseudo-gradients with an all-reduce. Fine inside one cluster.
- :class:`DiLoCoCallback` (Forgather's name, :mod:`hookloop.diloco.callback`):
  each run is a worker of a DiLoCo server (``hookloop diloco serve``), over
  HTTP(S); workers on other machines may join late, die and come back.

For :class:`DiLoCo`: each rank trains on its own for ``sync_every`` steps with
no gradient communication (``train.parallel=local``). Then the ranks average
their pseudo-gradients — the distance each moved from the shared starting
point — with one all-reduce over the process group, and an outer SGD with
Nesterov momentum applies the average to the shared parameters, which every
rank copies back. Communication drops by a factor of ``sync_every``.

Without a process group of two or more ranks the callback does nothing, so
one configuration serves both single-process and distributed runs.

Checkpoints hold rank 0's weights. Between outer steps the ranks' weights
differ, so for an exact resume make ``checkpoint.every`` a multiple of
``sync_every`` (the ranks agree right after an outer step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hookloop.callback import Callback
from hookloop.diloco.callback import DiLoCoCallback
from hookloop.diloco.outer import OuterOptimizer, check_outer_settings
from hookloop.distributed import is_distributed
from hookloop.state import CallbackContext

__all__ = ["DiLoCo", "DiLoCoCallback"]


class DiLoCo(Callback):
    """Outer optimisation step every ``sync_every`` inner steps (priority 15).

    ``bf16_comm`` sends pseudo-gradients as bfloat16 (half the bytes); the
    average is accumulated back in the parameters' dtype.
    """

    priority = 15

    def __init__(
        self,
        sync_every: int = 500,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        bf16_comm: bool = False,
    ) -> None:
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        check_outer_settings(outer_lr, outer_momentum, nesterov)
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.bf16_comm = bool(bf16_comm)
        self.outer_steps = 0
        self._params: list[torch.nn.Parameter] = []
        self._outer: OuterOptimizer | None = None  # holds the parameters all ranks agreed on
        self._pending: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return bool(self._params)

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not is_distributed() or ctx.state.world_size < 2:
            return  # a no-op alone
        if ctx.config.train.parallel != "local":
            raise ValueError(
                "DiLoCo needs train.parallel='local' (no per-step gradient sync); "
                f"got train.parallel={ctx.config.train.parallel!r}"
            )
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        if self._pending is None:
            for p in self._params:  # start from one point: rank 0's weights
                dist.broadcast(p.data, src=0)
        self._outer = OuterOptimizer(
            self._params, lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.nesterov
        )
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self.active and ctx.state.step % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Average pseudo-gradients over ranks, take the outer step, adopt the result."""
        assert self._outer is not None
        world = dist.get_world_size()
        mean = []
        with torch.no_grad():
            for shared, local in zip(self._outer.weights, self._params, strict=True):
                delta = shared - local.detach()  # the pseudo-gradient
                wire = delta.to(torch.bfloat16) if self.bf16_comm else delta
                dist.all_reduce(wire, op=dist.ReduceOp.SUM)
                mean.append(wire.to(shared.dtype) / world)
            for shared, local in zip(self._outer.step(mean), self._params, strict=True):
                local.copy_(shared)
        self.outer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        if not self.active:
            return {"outer_steps": self.outer_steps}
        assert self._outer is not None
        outer = self._outer.state_dict()
        return {"outer_steps": self.outer_steps, "shared": outer["weights"], "outer": outer["sgd"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Loaded before on_train_start builds the outer optimizer: keep it until then.
        self._pending = state
        self.outer_steps = int(state.get("outer_steps", 0))

    def _restore(self, state: dict[str, Any]) -> None:
        if "shared" not in state:
            return
        assert self._outer is not None
        self._outer.load_state_dict({"weights": state["shared"], "sgd": state["outer"]})
