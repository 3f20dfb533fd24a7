"""The non-finite skip decided on the device, for a fused optimizer: no host read a step.

torch's fused optimizers (``Adam``, ``AdamW``, ``SGD``, ``Adagrad`` with ``fused=True``)
take the verdict of a GradScaler on the device: an update whose gradients hold a NaN or an
Inf leaves the parameters and the optimizer's state (its step count too) as they were.
:class:`DeviceSkip` drives that public path (``torch.amp.GradScaler``'s ``unscale_``,
``step`` and ``update``) with the scale held at 1, which changes no value, so an fp32 or
bf16 step skips a non-finite update without the host reading anything back.

Each step also keeps a 0/1 flag on the device (1: non-finite), for the log and the counts.
The host learns of the skipped updates when it next looks anyway (:meth:`settle`, before a
log, a save, an evaluation or a stop acts, and at the end of training): ``skipped_steps``
and ``nonfinite_steps`` catch up then, ``train.max_skipped_steps`` is checked then, and the
log leaves the skipped steps' losses out of its averages as the host verdict does.

Where this differs from the host verdict (``docs/training.md``): the learning-rate
schedule advances on a skipped step, since the host did not know to hold it;
``ctx.skipped_iter`` is False on every step; a callback that watches
``state.nonfinite_steps`` (NaNDetection) sees a skip at the first boundary after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from hookloop.state import Progress

#: The reserved key the step's flag travels under in the log's loss window.
SKIPPED_KEY = "__skipped__"


def fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a torch optimizer built with ``fused=True``."""
    groups = optimizer.param_groups
    return bool(groups) and all(group.get("fused") is True for group in groups)


class DeviceSkip:
    """Skips non-finite updates of a fused optimizer on the device (see the module doc)."""

    def __init__(self, device: torch.device, on_cpu: bool) -> None:
        self.scaler = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)
        self.scaler.scale(torch.ones((), device=device))  # makes the scaler's scale tensor
        self.on_cpu = on_cpu
        self.count = torch.zeros((), device=device)  # non-finite steps so far (float32)
        self.seen = 0  # of them, the ones the host has counted
        self.stepped = False  # an update since the host last counted

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        grad_norm: torch.Tensor | None,
        gradients: list[torch.Tensor],
        around: Callable[[Callable[[], Any]], None],
    ) -> torch.Tensor:
        """Step ``optimizer`` unless its gradients are non-finite, deciding on the device;
        ``around(step)`` runs the step (inside a rewind's lowered learning rate, say).
        Returns the step's flag (a 0-dim float32 tensor: 1 when the update was left out)."""
        scaler = self.scaler
        scaler.unscale_(optimizer)  # finds NaN/Inf; multiplies by 1
        around(lambda: scaler.step(optimizer))
        scaler.update(1.0)  # the scale stays 1 (a float: no read)
        flag = _nonfinite_flag(grad_norm, gradients, self.on_cpu)
        self.count.add_(flag)
        self.stepped = True
        return flag

    def settle(self, progress: Progress, max_skipped: int | None, total: int | None = None) -> int:
        """Count the skips since the last look into ``progress`` (one host read, none when
        the caller read ``count`` as ``total`` with its own); raise FloatingPointError at
        ``max_skipped``. Returns how many there were."""
        if total is None and not self.stepped:
            return 0  # nothing new since the last count: nothing to read
        total = int(self.count.item()) if total is None else total
        self.stepped = False
        new, self.seen = total - self.seen, total
        for _ in range(new):
            progress.count_nonfinite()
            progress.count_skipped()
        if new and max_skipped is not None and progress.skipped_steps >= max_skipped:
            raise FloatingPointError(
                f"{progress.skipped_steps} optimizer steps were skipped (non-finite "
                f"gradients), reaching train.max_skipped_steps={max_skipped}; the latest "
                f"by step {progress.step}"
            )
        return new


def _nonfinite_flag(
    grad_norm: torch.Tensor | None, gradients: list[torch.Tensor], on_cpu: bool
) -> torch.Tensor:
    """1.0 when the norm (or, without one, any gradient) is NaN or Inf, else 0.0: on the
    device, as :class:`~hookloop.loop.stepper.FiniteCheck` decides it, without the read."""
    if grad_norm is not None:
        total = grad_norm
    elif not gradients:
        return torch.zeros(())
    else:
        total = finiteness_probe(gradients, on_cpu)
    return torch.isfinite(total).logical_not().float()


def finiteness_probe(tensors: list[torch.Tensor], on_cpu: bool) -> torch.Tensor:
    """One scalar, on the device, that is NaN or Inf exactly when an element of ``tensors``
    (non-empty) is. On a GPU their largest magnitude (``get_total_norm`` with the infinity
    norm, a few foreach kernels); on the CPU, where those cost ~45 us a step on a small
    model, each tensor summed in float32 and the sums added (~12 us), which is also
    non-finite when finite elements add up past float32's range (~3.4e38): no gradient
    worth applying."""
    if on_cpu:
        f32 = torch.float32
        sums = [t.sum(dtype=f32) if t.dtype is not f32 else t.sum() for t in tensors]
        return torch.stack(sums).sum()
    return torch.nn.utils.get_total_norm(tensors, math.inf, foreach=True)


def masked_row_means(values: list[float], n: int, flags: list[float]) -> list[float]:
    """Each run of ``n`` values' mean over the steps whose flag is 0 (NaN when all were
    skipped, as a window of skipped steps alone has no loss to show)."""
    keep = [i for i in range(n) if not flags[i]]
    if not keep:
        return [math.nan] * (len(values) // n)
    return [math.fsum(values[r + i] for i in keep) / len(keep) for r in range(0, len(values), n)]


def drop_flag(keys: list[str], values: Any, n: int) -> tuple[list[str], Any, list[float] | None]:
    """Split the reserved flag row from host ``values`` (``n`` per key). Returns the other
    keys, their values and the flags (None: no flag row)."""
    if SKIPPED_KEY not in keys:
        return keys, values, None
    row = keys.index(SKIPPED_KEY)
    flags = values[row * n : (row + 1) * n]
    rest = values[: row * n] + values[(row + 1) * n :]
    return [k for k in keys if k != SKIPPED_KEY], rest, flags
