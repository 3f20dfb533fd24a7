"""Watch the total gradient norm: the largest per epoch, and a warning when it explodes.

A loss curve hides an exploding gradient until the loss goes NaN, or it just
oscillates; the gradient norm shows it early, and tells whether a learning rate
is too high. This callback keeps the largest norm of the epoch so far and warns
(``warnings.warn``, category :class:`GradientNormWarning`) when steps exceed
``warn_threshold``.

No host-device sync on unlogged steps: each step folds its norm into a running
maximum and a count of steps over the threshold, both tensors on the device
(``torch.fmax``, ``>``). They are read back on log steps and at the end of each
epoch. So a warning names the range of steps since the previous read, not the
single step, and comes at the next log step (or epoch end).

The norm is the loop's ``ctx.grad_norm`` (the pre-clipping total norm) when
``train.clip_grad_norm`` is set. With clipping off the loop computes no norm, so
this callback computes one at ``on_before_optimizer_step`` (where gradients still
exist): a fused norm over the parameters' gradients, one more reduction per step
but still no sync. NaN norms are ignored here (``fmax``); NaN is NaNDetection's
business. An infinite norm counts, and warns.

Outputs: ``max_grad_norm`` (largest norm this epoch so far) in ``ctx.logs`` at
each log event; at each epoch end the epoch's maximum goes into
``ctx.user_state["max_grad_norm"]`` and onto ``epoch_maxima``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from hookloop.callback import Callback
from hookloop.state import CallbackContext


class GradientNormWarning(UserWarning):
    """A step's total gradient norm exceeded ``GradientMonitor.warn_threshold``."""


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The L2 norm of all ``grads`` together, as a tensor (no host read); None if empty."""
    if not grads:
        return None
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class GradientMonitor(Callback):
    """Per-epoch maximum gradient norm, and a warning above ``warn_threshold``."""

    priority = 12

    def __init__(self, warn_threshold: float = 1e4) -> None:
        if (
            isinstance(warn_threshold, bool)
            or not isinstance(warn_threshold, (int, float))
            or not warn_threshold > 0
        ):
            raise ValueError(f"warn_threshold must be a number > 0, got {warn_threshold!r}")
        self.warn_threshold = float(warn_threshold)
        self.epoch_maxima: list[float] = []  # one per completed epoch
        self._epoch_max: float | None = None  # epoch so far, up to the last read
        self._reset_window()

    def _reset_window(self) -> None:
        # Since the last read: running max and count over threshold (tensors, or floats
        # right after a resume), and the step range they cover.
        self._window_max: Any = None
        self._window_over: Any = None
        self._window_steps: tuple[int, int] | None = None

    # -- the hot path: tensors only
    def on_epoch_start(self, ctx: CallbackContext) -> None:
        self._epoch_max = None
        self._reset_window()

    def on_before_optimizer_step(self, ctx: CallbackContext) -> None:
        norm = ctx.grad_norm
        if norm is None:  # clipping off: the loop has no norm, so compute one
            if ctx.model is None:
                return
            grads = [p.grad for p in ctx.model.parameters() if p.grad is not None]
            norm = total_grad_norm(grads)
            if norm is None:
                return
        norm = norm.detach().float()
        over = (norm > self.warn_threshold).int()
        if self._window_max is None:
            self._window_max, self._window_over = norm, over
        else:
            self._window_max = torch.fmax(_on(self._window_max, norm), norm)
            self._window_over = _on(self._window_over, over) + over
        step = ctx.state.step
        self._window_steps = (self._window_steps[0] if self._window_steps else step, step)

    # -- reads: log steps and epoch ends
    def on_before_log(self, ctx: CallbackContext) -> None:
        self._read(ctx)
        if self._epoch_max is not None and ctx.logs is not None:
            ctx.logs["max_grad_norm"] = self._epoch_max

    def on_epoch_end(self, ctx: CallbackContext) -> None:
        self._read(ctx)
        if self._epoch_max is not None:
            self.epoch_maxima.append(self._epoch_max)
            ctx.user_state["max_grad_norm"] = self._epoch_max

    def _read(self, ctx: CallbackContext) -> None:
        if self._window_max is None:
            return
        window_max, over = _host(self._window_max), int(_host(self._window_over))
        first, last = self._window_steps or (ctx.state.step, ctx.state.step)
        self._reset_window()
        if not math.isnan(window_max):
            self._epoch_max = (
                window_max if self._epoch_max is None else max(self._epoch_max, window_max)
            )
        if over and ctx.state.is_rank_zero:
            where = f"at step {last}" if first == last else f"between steps {first} and {last}"
            warnings.warn(
                f"GradientMonitor: total gradient norm above warn_threshold="
                f"{self.warn_threshold:g} on {over} step(s) {where} (max {window_max:.4g}); "
                "the learning rate may be too high",
                GradientNormWarning,
                stacklevel=2,
            )

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch_max": self._epoch_max,
            "epoch_maxima": list(self.epoch_maxima),
            "window_max": None if self._window_max is None else _host(self._window_max),
            "window_over": None if self._window_over is None else int(_host(self._window_over)),
            "window_steps": list(self._window_steps) if self._window_steps else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch_max = state.get("epoch_max")
        self.epoch_maxima = [float(v) for v in state.get("epoch_maxima", [])]
        self._window_max = state.get("window_max")  # floats until the next step
        self._window_over = state.get("window_over")
        steps = state.get("window_steps")
        self._window_steps = (int(steps[0]), int(steps[1])) if steps else None

    def __repr__(self) -> str:
        return f"GradientMonitor(warn_threshold={self.warn_threshold:g})"


def _on(value: Any, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a tensor beside ``like`` (a float only right after a resume)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _host(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)
