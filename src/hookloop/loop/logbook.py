"""The log: what a log event reports, and the one place values leave the device.

Every step hands its reduced losses and grad norm to the :class:`LogBook` as device
tensors (:class:`LossWindow`); a log step reads all of them back at once, with the
step's token count, and builds ``ctx.logs`` (the mean of every loss since the last log,
``grad_norm``, ``lr``, ``epoch``, ``skipped_steps``, the checkpoint saves since the last
log, ``num_zeros_in_grad``, the timers) before firing ``on_before_log`` and ``on_log``.
A dialect logs its own keys (:meth:`LogBook.log`), through the same :meth:`LogBook.publish`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hookloop.distributed import all_reduce_mean
from hookloop.loop.device_skip import SKIPPED_KEY, DeviceSkip, drop_flag, masked_row_means
from hookloop.loop.records import Events
from hookloop.state import Progress, SaveTiming
from hookloop.step import read_back, to_float
from hookloop.timers import per_step_ms


class LogBook:
    """The loop's log (see the module doc): the loss window, the token and zero counts not
    yet read back, the saves since the last log, and ``last_logs``, the latest log's dict."""

    def __init__(
        self,
        *,
        progress: Progress,
        optimizer: torch.optim.Optimizer,
        config: Any,
        device: torch.device,
        events: Events,
    ) -> None:
        self.progress, self.optimizer, self.config = progress, optimizer, config
        self.ctx, self.hooks, self.fire = events.ctx, events.hooks, events.fire
        self.window = LossWindow(device)  # a named checkpoint state: ``log_pending``
        self.keep_all = bool(config.log_every)  # every step's losses, or only the latest
        self.pending_tokens: list[Any] = []  # token counts not yet read back from the device
        self.saves: list[SaveTiming] = []  # checkpoints committed since the last log
        self.zeros: torch.Tensor | None = None  # zero gradient elements of the log step
        self.last_logs: dict[str, Any] = {}
        self.last_log_step = 0  # the timers' per-step figures count from here
        #: The device's non-finite verdicts (a fused optimizer), counted with the log's read.
        self.device_skip: DeviceSkip | None = None

    # -- during the steps -----------------------------------------------------
    def add_step(
        self,
        loss_dict: dict[str, Any],
        grad_norm: torch.Tensor | None,
        skipped: bool | torch.Tensor,
        tokens: torch.Tensor | None,
        zeros: torch.Tensor | None,
    ) -> None:
        """Keep a step's numbers on the device (no sync). A skipped step's (non-finite)
        loss stays out of the logged average; its tokens count. ``skipped`` as a tensor:
        the device's verdict (:mod:`hookloop.loop.device_skip`), read at the log."""
        if tokens is not None:
            self.pending_tokens.append(tokens)
        if zeros is not None:
            self.zeros = zeros
        if type(skipped) is torch.Tensor:
            self.window.add({**loss_dict, SKIPPED_KEY: skipped}, grad_norm, keep_all=self.keep_all)
        elif not skipped:
            self.window.add(loss_dict, grad_norm, keep_all=self.keep_all)

    def add_save(self, timing: SaveTiming) -> None:
        """A checkpoint was committed: the next log counts it and its cost."""
        self.saves.append(timing)

    def sync_tokens(self) -> None:
        """Fold device-side token counts into ``state.tokens`` (one host read)."""
        if self.pending_tokens:
            (tokens,) = read_back([sum(self.pending_tokens)])
            assert tokens is not None  # read_back gives None only for None
            self.progress.add_tokens(int(tokens[0]))
            self.pending_tokens.clear()

    def restart_at(self, step: int) -> None:
        """After a rewind to ``step``: counts of the abandoned steps are dropped."""
        self.pending_tokens.clear()
        self.last_log_step = step

    # -- the log ----------------------------------------------------------------
    def log(self) -> None:
        """Build ``ctx.logs`` (this is where values are read back from the device) and
        publish it."""
        st, window = self.progress, self.window
        keys, values, n = window.stacked()  # every step's losses, or each key's mean
        if values is not None and st.world_size > 1:
            values = all_reduce_mean(values)  # every rank logs the same numbers
        tokens = sum(self.pending_tokens) if self.pending_tokens else None
        self.pending_tokens.clear()
        # One device-to-host transfer for the losses, the grad norm, the token count and the
        # device's count of skipped updates.
        skips = self.device_skip
        count = skips.count if skips is not None else None
        values_h: list[float] | None
        if window.grad_norm is None and tokens is None and count is None and values is not None:
            values_h, norm_h, tokens_h = values.tolist(), None, None  # usual: the losses alone
        else:
            values_h, norm_h, tokens_h, count_h = read_back(
                [values, window.grad_norm, tokens, count]
            )
            if skips is not None and count_h is not None:
                skips.settle(st, self.config.max_skipped_steps, total=int(count_h[0]))
        if tokens_h is not None:
            st.add_tokens(int(tokens_h[0]))
        logs: dict[str, Any] = {}
        if values_h is not None:
            keys, values_h, flags = drop_flag(keys, values_h, n)
            means = (
                row_means(values_h, n) if flags is None else masked_row_means(values_h, n, flags)
            )
            logs.update(zip(keys, means, strict=True))
        if norm_h is not None:
            logs["grad_norm"] = norm_h[0]
        logs["lr"] = float(self.optimizer.param_groups[0]["lr"])
        logs["epoch"] = st.epoch + (st.epoch_step / st.steps_per_epoch if st.steps_per_epoch else 0)
        logs["skipped_steps"] = st.skipped_steps
        self._add_counts(logs)
        window.clear()
        self.publish(logs)

    def _add_counts(self, logs: dict[str, Any]) -> None:
        """The saves, zero gradients and timers since the last log."""
        st, saves = self.progress, self.saves
        if saves:
            logs["checkpoint/saves"] = len(saves)
            logs["checkpoint/save_seconds"] = sum(t.seconds for t in saves)
            logs["checkpoint/blocked_seconds"] = sum(t.blocked_seconds for t in saves)
            saves.clear()
        if self.zeros is not None:
            logs["num_zeros_in_grad"] = int(to_float(self.zeros))
            self.zeros = None
        if self.config.log_timers:
            logs.update(per_step_ms(st.timers, st.step - self.last_log_step))
        self.last_log_step = st.step

    def publish(self, logs: dict[str, Any]) -> None:
        """Fire ``on_before_log`` (producers add to ``ctx.logs``), then ``on_log``."""
        hooks, ctx = self.hooks, self.ctx
        if hooks["on_before_log"] or hooks["on_log"]:
            ctx.logs = logs
            if hooks["on_before_log"]:
                self.fire("on_before_log", ctx)
            if hooks["on_log"]:
                self.fire("on_log", ctx)
            ctx.logs = None
        self.last_logs = logs


class LossWindow:
    """The steps' losses since the last log, kept as device tensors until it reads them.

    A named checkpoint state (``log_pending``): a resume mid-window logs the
    same averages as an uninterrupted run.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.losses: list[dict[str, Any]] = []
        self.grad_norm: torch.Tensor | None = None

    def add(self, loss_dict: dict[str, Any], grad_norm: Any, *, keep_all: bool = True) -> None:
        """Keep a step's losses (no sync). ``keep_all=False`` keeps only the latest."""
        if keep_all:
            self.losses.append(loss_dict)
        else:
            self.losses = [loss_dict]
        self.grad_norm = grad_norm

    def means(self) -> tuple[list[str], torch.Tensor | None]:
        """Keys of the latest step and each key's mean over the window, as one tensor
        (taken on the device; the native log takes them on the host from :meth:`stacked`)."""
        keys, values, n = self.stacked()
        if values is None or n == 1:
            return keys, values
        # Each row reduced as a contiguous vector, as a mean of that key alone would be.
        return keys, values.view(len(keys), n).mean(1)

    def stacked(self) -> tuple[list[str], torch.Tensor | None, int]:
        """What the log's means are taken from, as ONE tensor to read back at once:
        ``(keys of the latest step, values, n)``.

        Usually every step logged the same float32 scalars: ``values`` holds all of them,
        key by key (``n`` per key, the steps in the window), and :func:`row_means` takes
        each key's mean on the host, where it is a sum of Python floats instead of two more
        tensor operations. Otherwise ``values`` holds each key's mean already (``n`` = 1).
        """
        losses = self.losses
        if not losses:
            return [], None, 0
        keys = list(losses[-1])
        values = [d.get(k) for k in keys for d in losses]  # key-major: one row per key
        f32 = torch.float32
        tensors = [v for v in values if type(v) is torch.Tensor and v.dtype is f32]
        if len(tensors) == len(values):
            return keys, torch.stack(tensors), len(losses)
        if SKIPPED_KEY in keys:  # the device's verdicts: the skipped steps' losses left out
            kept = [d for d in losses if SKIPPED_KEY not in d or not d[SKIPPED_KEY]]  # one read
            keys = [k for k in keys if k != SKIPPED_KEY]
            if not kept:
                return keys, torch.full((len(keys),), math.nan), 1
            losses = kept
        return keys, torch.stack([_mean(d[k] for d in losses if k in d) for k in keys]), 1

    def clear(self) -> None:
        self.losses, self.grad_norm = [], None

    def state_dict(self) -> list[dict[str, Any]]:
        return self.losses

    def load_state_dict(self, losses: list[dict[str, Any]]) -> None:
        self.losses = [
            {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
            for d in losses
        ]


def row_means(values: list[float], n: int) -> list[float]:
    """The mean of each run of ``n`` consecutive values (``n`` = 1: the values as they are).

    Each is the exact sum of its values (``math.fsum``) divided by ``n``: the values'
    mean rounded once, to a Python float, whatever their order.
    """
    if n == 1:
        return values
    return [math.fsum(values[i : i + n]) / n for i in range(0, len(values), n)]


def _mean(values: Any) -> torch.Tensor:
    """Mean of 0-dim tensors (or numbers) as a float32 tensor, without a host read."""
    items = list(values)
    if all(type(v) is torch.Tensor for v in items):  # usual: one stack, not two ops per value
        stacked = torch.stack(items)
        return (stacked if stacked.dtype == torch.float32 else stacked.float()).mean()
    device = next((v.device for v in items if isinstance(v, torch.Tensor)), None)
    return torch.stack([torch.as_tensor(v, device=device).float() for v in items]).mean()
