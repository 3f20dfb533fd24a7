"""Forgather's ``DefaultMetrics``: throughput, MFU and peak memory in every log."""

from __future__ import annotations

from hookloop.callbacks import metrics as _metrics
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.state import CallbackContext

__all__ = ["DefaultMetrics"]


@answers_transformers_events
class DefaultMetrics(_metrics.DefaultMetrics):
    """``DefaultMetrics(peak_hardware_flops=None)``: throughput and MFU in every log.

    The native producer under Forgather's constructor. It also copies a
    ``peak_mem_allocated`` log entry to ``peak_mem``, as Forgather does.
    """

    def __init__(self, peak_hardware_flops: float | None = None) -> None:
        super().__init__(peak_hardware_flops=peak_hardware_flops)

    def on_before_log(self, ctx: CallbackContext) -> None:
        super().on_before_log(ctx)
        peak = ctx.logs.get("peak_mem_allocated") if ctx.logs is not None else None
        if peak is not None:
            ctx.logs["peak_mem"] = peak
