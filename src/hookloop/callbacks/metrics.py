"""Throughput, model FLOPs utilisation and peak memory, added to every log.

Keys written to ``ctx.logs`` on each log step (each only when it can be known):

- ``samples_per_sec``: training samples (all ranks) per wall-clock second since
  the previous log (so evaluation and checkpointing in between count against it);
- ``tok_per_sec``: the same for tokens. Tokens come from ``state.tokens`` when the
  forward step reports them (the ``(loss_sum, num_tokens, meta)`` loss pattern);
  otherwise from samples x ``seq_len`` when ``seq_len`` is given; otherwise the
  key is left out;
- ``mfu``: achieved FLOP/s over peak FLOP/s, as a fraction. Achieved FLOP/s is
  the growth of ``state.flops`` (present when the recipe gives the Trainer a
  ``flops_per_sample`` estimate) divided by the time spent inside training steps
  since the previous log, so evaluation, logging and checkpoint time are left out;
- ``peak_mem_mib``: peak CUDA memory allocated on the run's device (``ctx.run.device``), or the
  process's peak RSS on other devices (see :mod:`hookloop.callbacks.memory`,
  whose ``PeakMemory`` logs the detailed numbers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from hookloop.callback import Callback
from hookloop.callbacks.memory import peak_memory_mib
from hookloop.state import CallbackContext


def throughput(
    seconds: float,
    samples: float,
    tokens: float | None = None,
    flops: float | None = None,
    train_seconds: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """Rates for one interval: what was processed in ``seconds`` of wall time.

    ``mfu`` needs ``flops``, ``peak_flops`` and a positive ``train_seconds``
    (the part of the interval spent training); the rest need ``seconds > 0``.

    >>> throughput(2.0, samples=64, tokens=8192, flops=1e12, train_seconds=1.0, peak_flops=4e12)
    {'samples_per_sec': 32.0, 'tok_per_sec': 4096.0, 'mfu': 0.25}
    """
    out: dict[str, float] = {}
    if seconds > 0:
        out["samples_per_sec"] = samples / seconds
        if tokens is not None:
            out["tok_per_sec"] = tokens / seconds
    if flops and peak_flops and train_seconds and train_seconds > 0:
        out["mfu"] = flops / train_seconds / peak_flops
    return out


class DefaultMetrics(Callback):
    """Adds throughput, MFU and peak memory to each log (see the module doc for the keys).

    ``peak_flops`` is the hardware's peak FLOP/s summed over every rank (the FLOP
    count covers all ranks), e.g. ``989e12`` for one H100 SXM in dense bf16; with
    ``None`` no ``mfu`` is logged. ``peak_hardware_flops`` is accepted as
    Forgather's name for the same value. ``seq_len`` gives tokens per sample for runs
    whose forward step does not report token counts.
    """

    priority = 20

    #: Where time comes from; a test may replace it with a scripted clock.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(
        self,
        peak_flops: float | None = None,
        *,
        seq_len: int | None = None,
        memory: bool = True,
        peak_hardware_flops: float | None = None,
    ) -> None:
        if peak_hardware_flops is not None:
            if peak_flops is not None:
                raise ValueError("give peak_flops or Forgather's peak_hardware_flops, not both")
            peak_flops = peak_hardware_flops
        if peak_flops is not None and (
            isinstance(peak_flops, bool)
            or not isinstance(peak_flops, (int, float))
            or not math.isfinite(peak_flops)
            or peak_flops <= 0
        ):
            raise ValueError(
                f"peak_flops must be a FLOP/s figure > 0 or None (no MFU), got {peak_flops!r}"
            )
        if seq_len is not None and (
            isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1
        ):
            raise ValueError(
                f"seq_len must be an int >= 1 (tokens per sample) or None, got {seq_len!r}"
            )
        if not isinstance(memory, bool):
            raise ValueError(f"memory must be True or False, got {memory!r}")
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
        self.seq_len = seq_len
        self.memory = memory
        self._reset_interval(None, 0.0)
        if self.peak_flops is None:  # no MFU: the time inside steps is not needed
            self.on_train_step_start = self.on_train_step_end = None  # type: ignore[method-assign, assignment]  # None: not dispatched

    def _reset_interval(self, ctx: CallbackContext | None, now: float) -> None:
        st = ctx.state if ctx is not None else None
        self._last_time = now
        self._last_samples = st.samples if st is not None else 0
        self._last_tokens = st.tokens if st is not None else 0
        self._last_flops = st.flops if st is not None else 0.0
        self._train_seconds = 0.0
        self._step_started: float | None = None

    def on_train_start(self, ctx: CallbackContext) -> None:
        self._reset_interval(ctx, self.clock())

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        if ctx.rewind is not None:  # the counters went back: the next rates count from here
            self._reset_interval(ctx, self.clock())

    def on_train_step_start(self, ctx: CallbackContext) -> None:
        self._step_started = self.clock()

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self._step_started is not None:
            self._train_seconds += self.clock() - self._step_started
            self._step_started = None

    def on_before_log(self, ctx: CallbackContext) -> None:
        if ctx.logs is None:
            return
        st, now = ctx.state, self.clock()
        samples = st.samples - self._last_samples
        if st.tokens > self._last_tokens:
            tokens: float | None = st.tokens - self._last_tokens
        elif self.seq_len is not None:
            tokens = samples * self.seq_len
        else:
            tokens = None
        ctx.logs.update(
            throughput(
                now - self._last_time,
                samples,
                tokens,
                st.flops - self._last_flops,
                self._train_seconds,
                self.peak_flops,
            )
        )
        if self.memory:
            peak = peak_memory_mib(ctx.run.device)
            if peak is not None:
                ctx.logs["peak_mem_mib"] = peak
        self._reset_interval(ctx, now)

    def __repr__(self) -> str:
        return f"DefaultMetrics(priority={self.priority}, peak_flops={self.peak_flops})"
