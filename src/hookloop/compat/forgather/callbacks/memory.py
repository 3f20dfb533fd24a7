"""Forgather's ``PeakMemory``: peak CUDA memory per rank, and an optional memory snapshot."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from hookloop.compat.forgather.callbacks.common import (
    check_flag,
    check_writer,
    log,
    markdown_block,
)
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback

__all__ = ["PeakMemory"]


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 1024**3:.3f} GiB" if num_bytes else "0 GiB"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


@answers_transformers_events
class PeakMemory(TrainerCallback):
    """Peak CUDA memory per rank: TensorBoard scalars, a log line, an optional snapshot.

    ``PeakMemory(summary_writer=None, show_details=False, do_log=False,
    enable_memory_snapshot=False, file_prefix="memory_snapshot")``. Rank and
    world size come from ``RANK`` / ``WORLD_SIZE`` (default 0 / 1). It is off
    unless the model is on a CUDA device. At each log it writes
    ``peak_memory_rank{i}`` (bytes) when given a writer and prints the peaks
    with ``do_log``; at train end it prints this rank's maximum. With
    ``enable_memory_snapshot`` it records allocation history and, at the first
    log, dumps ``{file_prefix}_rank{rank}.pickle`` in the working directory.
    """

    priority = 30

    def __init__(
        self,
        summary_writer: Any = None,
        show_details: bool = False,
        do_log: bool = False,
        enable_memory_snapshot: bool = False,
        file_prefix: str = "memory_snapshot",
    ) -> None:
        self.summary_writer = check_writer("summary_writer", summary_writer, optional=True)
        self.show_details = check_flag("show_details", show_details)
        self.do_log = check_flag("do_log", do_log)
        self.enable_memory_snapshot = check_flag("enable_memory_snapshot", enable_memory_snapshot)
        if not isinstance(file_prefix, str) or not file_prefix:
            raise ValueError(
                f"file_prefix must be a non-empty file name prefix, got {file_prefix!r}"
            )
        self.file_prefix = file_prefix
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.enabled = torch.cuda.is_available()
        self.max_allocated = 0
        self.snapshot_path: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        param = next(model.parameters(), None) if model is not None else None
        if param is None or param.device.type != "cuda":
            self.enabled = False
        if not self.enabled:
            return
        self.device = param.device
        self.max_allocated = 0
        if self.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled="all")

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled or (not self.do_log and self.summary_writer is None):
            return
        logs = kwargs.get("logs") or {}
        if self.enable_memory_snapshot:
            self.snapshot_path = f"{self.file_prefix}_rank{self.rank}.pickle"
            try:
                torch.cuda.memory._dump_snapshot(self.snapshot_path)
            except Exception as err:
                log.error("could not write the memory snapshot %s: %s", self.snapshot_path, err)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.enable_memory_snapshot = False
        peaks = logs.get("peak_mem_allocated")
        if not peaks:  # no per-rank list from the trainer: this rank's own figure
            peaks = [0] * self.world_size
            peaks[self.rank] = torch.cuda.max_memory_allocated(self.device)
        self.max_allocated = max(self.max_allocated, peaks[self.rank])
        if self.rank != 0:
            return
        if self.summary_writer is not None:
            for i, mem in enumerate(peaks):
                self.summary_writer.add_scalar(
                    f"peak_memory_rank{i}", mem, global_step=state.global_step
                )
            if self.show_details:
                self.summary_writer.add_text(
                    "peak_memory_details",
                    markdown_block(torch.cuda.memory_stats(self.device)),
                    global_step=state.global_step,
                )
            self.summary_writer.flush()
        if self.do_log:
            ranks = ", ".join(f"RANK{i} {_gib(mem)}" for i, mem in enumerate(peaks))
            _say(f"Peak CUDA Memory Allocated: {ranks}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        self.max_allocated = max(self.max_allocated, torch.cuda.max_memory_allocated(self.device))
        if self.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
        _say(f"RANK{self.rank} MAX CUDA MEMORY ALLOCATED: {_gib(self.max_allocated)}")
        if self.show_details and not self.do_log and self.summary_writer is not None:
            self.summary_writer.add_text(
                "peak_memory_details",
                markdown_block(torch.cuda.memory_stats(self.device)),
                global_step=state.global_step,
            )


def _say(text: str) -> None:
    """Forgather logs these lines at INFO; hookloop prints them so they are always seen."""
    log.info(text)
    print(text, file=sys.stderr, flush=True)
