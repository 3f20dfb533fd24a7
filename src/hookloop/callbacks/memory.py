"""Peak memory: the CUDA allocator's high-water marks, and the process's peak RSS.

The numbers come from counters the allocator and the kernel keep anyway, so
reading them costs no device synchronisation; they are read on log steps only.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from hookloop.callback import Callback

try:  # imported once: DefaultMetrics reads the peak RSS on every log step
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]  # None: peak RSS not read
from hookloop.state import CallbackContext

log = logging.getLogger("hookloop.memory")

MIB = 1024**2


def peak_rss_mib() -> float | None:
    """The process's peak resident set size in MiB, or None where the OS does not say.

    ``getrusage`` reports ``ru_maxrss`` in KiB on Linux and in bytes on macOS.
    """
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def cuda_peaks_mib(device: torch.device) -> dict[str, float]:
    """Peak allocated and reserved CUDA memory on ``device`` (MiB), since the last reset."""
    return {
        "allocated": torch.cuda.max_memory_allocated(device) / MIB,
        "reserved": torch.cuda.max_memory_reserved(device) / MIB,
    }


def peak_memory_mib(device: torch.device | str | None) -> float | None:
    """One headline number: CUDA peak allocated on a CUDA device, else the peak RSS."""
    if not isinstance(device, torch.device):  # a str or None; a device is used as it is
        device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return cuda_peaks_mib(device)["allocated"]
    return peak_rss_mib()


def _device_of(ctx: CallbackContext) -> torch.device:
    device = ctx.run.device
    if device is None and ctx.model is not None:
        param = next(ctx.model.parameters(), None)
        device = param.device if param is not None else None
    return torch.device(device) if device is not None else torch.device("cpu")


class PeakMemory(Callback):
    """Logs peak memory on every log step (this rank's numbers).

    Keys written to ``ctx.logs``:

    - ``peak_rss_mib``: the process's peak resident set size (host memory), always;
    - on a CUDA device, ``peak_mem_allocated_mib`` and ``peak_mem_reserved_mib``:
      the caching allocator's high-water marks for the run's device (``ctx.run.device``).

    ``reset_every_log=True`` resets the CUDA peaks after each reading, so each
    log shows the peak of its own interval (the RSS peak cannot be reset).
    ``snapshot_path`` records the CUDA allocator history from the start of
    training and dumps it there at the end (view it at pytorch.org/memory_viz);
    recording costs time and memory, so it is off by default.
    """

    priority = 30

    def __init__(
        self,
        *,
        reset_every_log: bool = False,
        reset_at_start: bool = True,
        snapshot_path: str | Path | None = None,
        max_snapshot_entries: int = 100_000,
    ) -> None:
        for name, value in (
            ("reset_every_log", reset_every_log),
            ("reset_at_start", reset_at_start),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if snapshot_path is not None and not str(snapshot_path):
            raise ValueError(f"snapshot_path must be a file path or None, got {snapshot_path!r}")
        if isinstance(max_snapshot_entries, bool) or not isinstance(max_snapshot_entries, int):
            raise ValueError(
                f"max_snapshot_entries must be an int >= 1, got {max_snapshot_entries!r}"
            )
        if max_snapshot_entries < 1:
            raise ValueError(
                f"max_snapshot_entries must be an int >= 1, got {max_snapshot_entries!r}"
            )
        self.reset_every_log = reset_every_log
        self.reset_at_start = reset_at_start
        self.snapshot_path = Path(snapshot_path) if snapshot_path is not None else None
        self.max_snapshot_entries = max_snapshot_entries
        self._cuda: torch.device | None = None
        self._recording = False
        self.peaks: dict[str, float] = {}  # the run's highest readings so far

    def on_train_start(self, ctx: CallbackContext) -> None:
        device = _device_of(ctx)
        self._cuda = device if device.type == "cuda" and torch.cuda.is_available() else None
        self.peaks = {}
        if self._cuda is None:
            return
        if self.reset_at_start:
            torch.cuda.reset_peak_memory_stats(self._cuda)
        if self.snapshot_path is not None:
            torch.cuda.memory._record_memory_history(max_entries=self.max_snapshot_entries)
            self._recording = True

    def read(self) -> dict[str, float]:
        """The current readings, keyed as they are logged."""
        values: dict[str, float] = {}
        rss = peak_rss_mib()
        if rss is not None:
            values["peak_rss_mib"] = rss
        if self._cuda is not None:
            cuda = cuda_peaks_mib(self._cuda)
            values["peak_mem_allocated_mib"] = cuda["allocated"]
            values["peak_mem_reserved_mib"] = cuda["reserved"]
        return values

    def on_before_log(self, ctx: CallbackContext) -> None:
        if ctx.logs is None:
            return
        values = self.read()
        ctx.logs.update(values)
        for key, value in values.items():
            self.peaks[key] = max(value, self.peaks.get(key, 0.0))
        if self.reset_every_log and self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)

    def on_train_end(self, ctx: CallbackContext) -> None:
        for key, value in self.read().items():
            self.peaks[key] = max(value, self.peaks.get(key, 0.0))
        self._dump_snapshot(ctx)
        if ctx.state.is_rank_zero and self.peaks:
            log.info("peak memory: %s", ", ".join(f"{k} {v:.1f}" for k, v in self.peaks.items()))

    def on_exception(self, ctx: CallbackContext) -> None:
        self._dump_snapshot(ctx)

    def _dump_snapshot(self, ctx: CallbackContext) -> None:
        if not self._recording or self.snapshot_path is None:
            return
        self._recording = False
        path = self.snapshot_path
        if ctx.state.world_size > 1:
            path = path.with_name(f"{path.stem}_rank{ctx.state.rank}{path.suffix}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def __repr__(self) -> str:
        return f"PeakMemory(priority={self.priority}, reset_every_log={self.reset_every_log})"
