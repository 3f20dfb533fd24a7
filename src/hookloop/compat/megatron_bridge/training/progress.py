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
"""

from __future__ import annotations

import os

from hookloop.callbacks.progress_log import SAVED_CHECKPOINT, SAVING_ASYNC, ProgressLog
from hookloop.compat.megatron_bridge.training.state import GlobalState
from hookloop.state import CallbackContext

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
