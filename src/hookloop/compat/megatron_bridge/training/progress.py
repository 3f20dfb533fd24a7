"""``logger.log_progress``: ``progress.txt`` in Megatron-Bridge's own line format.

hookloop's :class:`~hookloop.callbacks.progress_log.ProgressLog` writes the same file for
``hookloop train``; this subclass changes only what Megatron-Bridge writes differently:

- ``Job ID`` is ``$SLURM_JOB_ID`` or empty;
- throughputs read ``MODEL_TFLOP/s/GPU`` with one decimal, tokens two decimals, FLOPs
  ``.2e``, and nothing after the tokens;
- the job starts when the run's :class:`GlobalState` was made (``start_time``, as
  Megatron-Bridge counts it), not when training starts;
- a background save writes ``Saving async checkpoint`` with the figures and then
  ``Saved async checkpoint`` (both once the write is done).

Megatron-LM's and Megatron-Bridge's readers (``get_start_time_from_progress_log``) parse it.

The functions below are Megatron-Bridge's ``training.train`` helpers over the same file,
for code that runs its own loop (:func:`~.train.train`): :func:`append_to_progress_log`,
:func:`get_start_time_from_progress_log` and
:func:`compute_throughputs_and_append_to_progress_log`.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from hookloop.callbacks.progress_log import (
    SAVED_CHECKPOINT,
    SAVING_ASYNC,
    TIME_FORMAT,
    ProgressLog,
    first_job_start,
    tflops_per_device,
)
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.distributed import rank_info
from hookloop.state import CallbackContext

PROGRESS_FILE = "progress.txt"

SAVED_ASYNC = "Saved async checkpoint"


class MegatronBridgeProgressLog(ProgressLog):
    """A ``Starting job`` line and one entry per save, as Megatron-Bridge writes them."""

    def __init__(self, global_state: GlobalState, *, async_save: bool = False) -> None:
        super().__init__()
        self.job = os.environ.get("SLURM_JOB_ID", "")
        self.global_state = global_state
        self.async_save = async_save

    def job_started(self, ctx: CallbackContext) -> float:
        return self.global_state.start_time

    def save_lines(self, ctx: CallbackContext, job: float, cumulative: float) -> list[str]:
        st = ctx.state
        seq_length = _seq_length(self.global_state)
        tokens = st.tokens or st.samples * seq_length
        head = SAVING_ASYNC if self.async_save else SAVED_CHECKPOINT
        line = (
            f"{head}\tIteration: {st.step}\t"
            f"Job throughput: {job:.1f} MODEL_TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} MODEL_TFLOP/s/GPU\t"
            f"Floating-point operations: {st.flops:.2e}\t"
            f"Tokens (in billions): {tokens / 10**9:.2f}"
        )
        if self.async_save:
            return [line, f"{SAVED_ASYNC}\tIteration: {st.step}"]
        return [line]


def _seq_length(state: GlobalState) -> int:
    """The run's sequence length (Megatron-Bridge counts tokens as samples x seq_length)."""
    model = getattr(state.cfg, "model", None)
    length = getattr(model, "seq_length", None) or getattr(model, "block_size", None)
    return int(length or 0)


def append_to_progress_log(
    save_dir: str | Path, message: str, *, when: float | None = None
) -> None:
    """Append one line to ``<save_dir>/progress.txt`` (global rank 0 only).

    The line is stamped ``when`` (a ``time.time()``; default now), then the job id
    (``$SLURM_JOB_ID`` or empty) and the number of ranks, as Megatron-Bridge writes it.
    """
    rank, _, world_size = rank_info()
    if rank != 0:
        return
    stamp = datetime.fromtimestamp(time.time() if when is None else when).strftime(TIME_FORMAT)
    job = os.environ.get("SLURM_JOB_ID", "")
    path = Path(save_dir) / PROGRESS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one write per line: a kill loses at most that line
        f.write(f"{stamp}\tJob ID: {job}\t# GPUs: {world_size}\t{message}\n")


def get_start_time_from_progress_log(cfg: Any) -> tuple[datetime, float]:
    """When the earliest job with this world size started, and the FLOPs saved before it.

    Reads ``<cfg.checkpoint.save>/progress.txt``; a line written with another number of
    ranks starts the search afresh, as Megatron-Bridge's reader does.
    """
    save = _save_dir(cfg)
    if save is None:
        raise ValueError(
            "get_start_time_from_progress_log needs cfg.checkpoint.save (the run directory "
            "that holds progress.txt)"
        )
    world_size = rank_info()[2]
    start = first_job_start(Path(save) / PROGRESS_FILE, world_size)
    if start is None:
        raise ValueError(
            f"{Path(save) / PROGRESS_FILE} has no 'Starting job' line written with {world_size} "
            "rank(s); a job must log its start (logger.log_progress) before it saves"
        )
    return start.time, start.flops


def compute_throughputs_and_append_to_progress_log(
    state: GlobalState, num_floating_point_operations_so_far: float
) -> None:
    """Append a save's line: job and cumulative MODEL_TFLOP/s/GPU, FLOPs and tokens.

    The job's throughput counts the FLOPs since this job started (``state.job_start_flops``)
    over the time since its ``GlobalState`` was made; the cumulative one counts from the
    first job with this world size (:func:`get_start_time_from_progress_log`). Nothing is
    written without ``cfg.checkpoint.save``.
    """
    save = _save_dir(state.cfg)
    if save is None:
        return
    flops = float(num_floating_point_operations_so_far)
    world_size = rank_info()[2]
    now = time.time()
    job = tflops_per_device(flops - state.job_start_flops, now - state.start_time, world_size)
    first_time, first_flops = get_start_time_from_progress_log(state.cfg)
    seconds = (datetime.fromtimestamp(now) - first_time).total_seconds()
    cumulative = tflops_per_device(flops - first_flops, seconds, world_size)
    tokens = state.train_state.consumed_train_samples * _seq_length(state)
    async_save = bool(getattr(state.cfg.checkpoint, "async_save", False))
    head = SAVING_ASYNC if async_save else SAVED_CHECKPOINT
    append_to_progress_log(
        save,
        f"{head}\tIteration: {state.train_state.step}\t"
        f"Job throughput: {job:.1f} MODEL_TFLOP/s/GPU\t"
        f"Cumulative throughput: {cumulative:.1f} MODEL_TFLOP/s/GPU\t"
        f"Floating-point operations: {flops:.2e}\t"
        f"Tokens (in billions): {tokens / 10**9:.2f}",
    )


def _save_dir(cfg: Any) -> str | None:
    checkpoint = getattr(cfg, "checkpoint", None)
    return getattr(checkpoint, "save", None)
