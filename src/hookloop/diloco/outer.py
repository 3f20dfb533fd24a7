"""The outer step of DiLoCo, shared by the all-reduce callback and the server.

A worker's *pseudo-gradient* is how far it moved from the weights everyone
last agreed on: ``global - local``. The outer optimizer treats the average of
those as a gradient of the global weights and takes one SGD step with
Nesterov momentum (the DiLoCo paper's choice: lr 0.7, momentum 0.9). Both
transports call :class:`OuterOptimizer`, so given the same average they
produce the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_outer_settings(lr: Any, momentum: Any, nesterov: Any) -> None:
    """Raise ``ValueError`` naming the bad setting and what is allowed."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"outer_lr must be a number > 0, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}")
    if not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must lie in [0, 1), got {momentum!r}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be True or False, got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs outer_momentum > 0")


class OuterOptimizer:
    """Copies of the global weights and ``torch.optim.SGD`` over pseudo-gradients."""

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        *,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        check_outer_settings(lr, momentum, nesterov)
        self.weights = [w.detach().clone() for w in weights]
        self._sgd = torch.optim.SGD(self.weights, lr=lr, momentum=momentum, nesterov=nesterov)

    @torch.no_grad()
    def step(self, mean_pseudo_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Apply the averaged pseudo-gradients; returns the new global weights."""
        if len(mean_pseudo_grads) != len(self.weights):
            raise ValueError(
                f"expected {len(self.weights)} pseudo-gradients, got {len(mean_pseudo_grads)}"
            )
        for weight, grad in zip(self.weights, mean_pseudo_grads, strict=True):
            weight.grad = grad.to(device=weight.device, dtype=weight.dtype)
        self._sgd.step()
        self._sgd.zero_grad(set_to_none=True)
        return self.weights

    def configure(self, *, lr: float, momentum: float, nesterov: bool) -> None:
        """Change the outer step's settings (its momentum buffers are kept)."""
        check_outer_settings(lr, momentum, nesterov)
        for group in self._sgd.param_groups:
            group.update(lr=lr, momentum=momentum, nesterov=nesterov)

    def state_dict(self) -> dict[str, Any]:
        return {
            "weights": [w.detach().cpu() for w in self.weights],
            "sgd": self._sgd.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["weights"]
        if len(saved) != len(self.weights):
            raise ValueError(
                f"the saved outer state has {len(saved)} tensors, this model {len(self.weights)}"
            )
        for weight, value in zip(self.weights, saved, strict=True):
            weight.copy_(value.to(weight.device))
        self._sgd.load_state_dict(state["sgd"])


def mean_of(contributions: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Element-wise mean of several workers' tensors, summed in fp32 in the given order."""
    if not contributions:
        raise ValueError("mean_of needs at least one contribution")
    total = [t.to(torch.float32).clone() for t in contributions[0]]
    for other in contributions[1:]:
        for acc, t in zip(total, other, strict=True):
            acc.add_(t.to(torch.float32))
    return [t / len(contributions) for t in total]
