"""Mixed precision for the loop: autocast, and the gradient scaler fp16 needs.

``train.precision``: ``fp32`` (nothing), ``bf16`` (autocast; bf16 has fp32's
range, so gradients need no scaling) or ``fp16`` (autocast plus a
``GradScaler``: the loss is scaled up before backward so small gradients do
not flush to zero, gradients are unscaled before clipping, and the scaler
skips an update whose gradients overflowed).
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch

_NULL_CONTEXT = contextlib.nullcontext()  # reusable: entering it does nothing


class Precision:
    """One object for everything precision changes in a step; a named checkpoint state."""

    #: Whether the last ``step()`` left the parameters alone because fp16's scaler found
    #: overflowed gradients, so it never called ``optimizer.step()`` (always False without
    #: a scaler). The loop then does not step the LR scheduler either, as
    #: ``transformers.Trainer`` does.
    skipped_update = False

    def __init__(self, precision: str, device: torch.device) -> None:
        dev = device.type
        if precision == "bf16" and dev == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("train.precision='bf16' but this GPU does not support bfloat16")
        if precision == "fp16" and dev not in ("cuda", "cpu"):
            raise ValueError(f"train.precision='fp16' needs a cuda or cpu device, got {dev}")
        self.device_type = dev
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler(dev) if precision == "fp16" else None
        self._counted: Any = None  # the optimizer whose step() calls _count_update counts
        self._updates = 0
        if self.scaler is None:  # the step's calls go straight to torch: no layer in between
            self.backward = torch.Tensor.backward  # type: ignore[method-assign]  # per instance
            self.step = operator.methodcaller("step")  # type: ignore[method-assign, assignment]  # same call, untyped

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass's context: autocast to the reduced dtype, or nothing."""
        if self.dtype is None:
            return _NULL_CONTEXT
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size (before clipping or reading them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the update (the scaler skips it by itself if gradients overflowed)."""
        if self.scaler is None:
            optimizer.step()
            return
        # Skipped means the scaler never called optimizer.step(): accelerate (and so
        # transformers.Trainer) tells it the same way. A step pre-hook counts the calls, so
        # this reads nothing from the device.
        if self._counted is not optimizer:
            optimizer.register_step_pre_hook(self._count_update)
            self._counted = optimizer
        updates = self._updates
        self.scaler.step(optimizer)
        self.scaler.update()
        self.skipped_update = self._updates == updates

    def _count_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._updates += 1

    @property
    def checks_overflow(self) -> bool:
        """Whether non-finite gradients are already caught here (fp16's scaler)."""
        return self.scaler is not None

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)
