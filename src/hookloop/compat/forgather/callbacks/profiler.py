"""Forgather's ``ProfilerCallback``: the native profiler with Forgather's window and files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hookloop.callbacks import profiler as _profiler
from hookloop.compat.forgather.callbacks.common import log
from hookloop.compat.forgather.events import answers_transformers_events

__all__ = ["ProfilerCallback"]


@answers_transformers_events
class ProfilerCallback(_profiler.ProfilerCallback):
    """``ProfilerCallback(start_step=3, num_steps=5, output_dir="benchmarks/profiles", ...)``.

    The native profiler over Forgather's window (the ``num_steps`` steps after
    ``start_step``) with Forgather's outputs: every rank writes its Chrome trace to
    ``<output_dir>/real_training_rank<R>.json``, and rank 0 prints the operator tables
    (by total CPU time, and by total CUDA time on a GPU) to stdout.
    """

    #: Where Forgather's profiler writes unless told otherwise.
    DEFAULT_DIR = "benchmarks/profiles"

    def __init__(
        self,
        start_step: int = 3,
        num_steps: int = 5,
        output_dir: str = DEFAULT_DIR,
        with_stack: bool = True,
        with_flops: bool = True,
        record_shapes: bool = True,
    ) -> None:
        super().__init__(
            output_dir=output_dir,
            with_stack=with_stack,
            with_flops=with_flops,
            record_shapes=record_shapes,
            start_step=start_step,
            num_steps=num_steps,
            ranks=None,
        )

    def write_window(
        self, prof: Any, directory: Path, step: int, rank: int, cuda: bool
    ) -> list[Path]:
        trace = directory / f"real_training_rank{rank}.json"
        prof.export_chrome_trace(str(trace))
        log.info("ProfilerCallback: trace saved to %s", trace)
        if rank == 0:
            first = step - self.active + 1
            rule = "=" * 80
            for device, key in [("CPU", "cpu_time_total")] + (
                [("CUDA", "cuda_time_total")] if cuda else []
            ):
                table = prof.key_averages().table(sort_by=key, row_limit=self.row_limit)
                print(f"\n{rule}\n{device} time summary (steps {first}-{step}):\n{rule}")
                print(table, flush=True)
        return [trace]
