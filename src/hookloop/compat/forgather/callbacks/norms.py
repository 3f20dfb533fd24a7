"""Forgather's norm loggers: the weight norm in every log, and per-parameter gradient and
parameter norms in JSON-array files in ``args.logging_dir``."""

from __future__ import annotations

from typing import Any

import torch

from hookloop.callbacks import norms as _norms
from hookloop.callbacks.norms import spectral_norm
from hookloop.compat.forgather.callbacks.common import (
    check_flag,
    check_positive_int,
    check_writer,
    log,
)
from hookloop.compat.forgather.callbacks.jsonlog import JsonArrayFile
from hookloop.compat.forgather.events import answers_transformers_events
from hookloop.compat.hf.callback import TrainerCallback
from hookloop.state import CallbackContext

__all__ = ["GradNormLogger", "ParameterNormLogger", "WeightNormLogger"]


@answers_transformers_events
class WeightNormLogger(_norms.WeightNormLogger):
    """The L2 norm of all parameters together.

    ``WeightNormLogger()``: as ``weight_norm`` in every log, as Forgather does now.
    Forgather's older ``WeightNormLogger(summary_writer, tag="weight_norm")`` writes
    it to that writer under ``tag`` at each evaluation instead (rank 0). hookloop's
    ``include=`` (parameter-name prefixes) and ``key=`` work in the first form.
    """

    def __init__(
        self,
        summary_writer: Any = None,
        tag: str = "weight_norm",
        *,
        include: Any = None,
        key: str = "weight_norm",
    ) -> None:
        if summary_writer is not None and not callable(getattr(summary_writer, "add_scalar", None)):
            if include is not None:
                raise ValueError(
                    "WeightNormLogger takes a summary_writer (Forgather's older form) or "
                    f"include=, got both: {summary_writer!r} and include={include!r}"
                )
            include, summary_writer = summary_writer, None  # hookloop's include, given first
        super().__init__(include, key=key)
        self.summary_writer = check_writer("summary_writer", summary_writer, optional=True)
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty TensorBoard tag, got {tag!r}")
        self.tag = tag
        self.warned_meta = False

    def on_before_log(self, ctx: CallbackContext) -> None:
        if self.summary_writer is None:
            super().on_before_log(ctx)

    def on_eval_end(self, ctx: CallbackContext) -> None:
        if self.summary_writer is None or not ctx.state.is_rank_zero or ctx.model is None:
            return
        params = [p.detach() for p in ctx.model.parameters()]
        if not params or any(p.device.type == "meta" for p in params):
            if not self.warned_meta:
                log.warning(
                    "WeightNormLogger: the model's parameters are on the meta device (a "
                    "pipeline stage's shell); the weight norm is not logged"
                )
                self.warned_meta = True
            return
        with torch.no_grad():
            norms = torch.stack([torch.linalg.vector_norm(p.float()).cpu() for p in params])
            total = float(torch.linalg.vector_norm(norms))
        self.summary_writer.add_scalar(self.tag, total, global_step=ctx.state.step)
        flush = getattr(self.summary_writer, "flush", None)
        if callable(flush):
            flush()


def _real_parameters(model: Any, who: str, warned: list[bool]) -> list[tuple[str, Any]] | None:
    """The named parameters, or None (warning once) for a pipeline stage's meta shell."""
    if model is None:
        return None
    params = list(model.named_parameters())
    if not params or params[0][1].device.type == "meta":
        if not warned[0]:
            log.warning("%s: the model's parameters are on the meta device; not logging", who)
            warned[0] = True
        return None
    return params


class _NormsFile(TrainerCallback):
    """A norm logger's JSON array file in ``args.logging_dir``: opened at train start on
    the main process, resumable (records after the checkpoint are dropped)."""

    LOG_FILENAME = ""
    _file: JsonArrayFile

    def state_dict(self) -> dict[str, Any]:
        return {"writer": self._file.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._file.load_state_dict(state.get("writer", {}))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and getattr(args, "logging_dir", None) is not None:
            self._file.open(args.logging_dir)


@answers_transformers_events
class GradNormLogger(_NormsFile):
    """``GradNormLogger()``: per-parameter gradient norms in ``<logging_dir>/gradient_norms.json``.

    The norms of the (clipped) gradients the optimizer is about to use are taken
    before every optimizer step, kept on the device, and the latest ones are
    written at each evaluation: ``{global_step, epoch, grad_norms: {name: norm}}``.
    """

    priority = 25
    LOG_FILENAME = "gradient_norms.json"

    def __init__(self) -> None:
        self._file = JsonArrayFile(self.LOG_FILENAME)
        self._names: list[str] = []
        self._norms: torch.Tensor | None = None
        self._step, self._epoch = -1, 0.0
        self._warned = [False]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open:
            return
        params = _real_parameters(kwargs.get("model"), "GradNormLogger", self._warned)
        if params is None:
            return
        with_grad = [(n, p) for n, p in params if p.grad is not None]
        if not with_grad:
            return
        self._names = [n for n, _ in with_grad]
        with torch.no_grad():  # stays on the device: read back only when written
            self._norms = torch.stack([p.grad.detach().float().norm() for _, p in with_grad])
        self._step, self._epoch = state.global_step + 1, state.epoch  # the step being taken

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open or self._norms is None:
            return
        norms = dict(zip(self._names, self._norms.tolist(), strict=True))
        self._file.write(self._step, self._epoch, {"grad_norms": norms})
        self._norms = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()


def _spectral(p: torch.Tensor, v: torch.Tensor | None, iters: int) -> tuple[float, Any]:
    """Largest singular value of ``p`` seen as a matrix (rows: its first dimension)."""
    if p.dim() < 2:
        return float(p.detach().float().norm()), None
    sigma, v = spectral_norm(p.detach().reshape(p.shape[0], -1), v, iters)
    return float(sigma), v


@answers_transformers_events
class ParameterNormLogger(_NormsFile):
    """Per-parameter L2 and spectral norms in ``<logging_dir>/parameter_norms.json``.

    ``ParameterNormLogger(log_norms=True, log_spectral_norms=True,
    power_iter_steps=10)``: one record per evaluation, ``{global_step, epoch,
    norms, spectral_norms}``. Spectral norms come from power iteration,
    warm-started from the previous evaluation; the first uses twice the steps.
    """

    LOG_FILENAME = "parameter_norms.json"
    priority = 25

    def __init__(
        self,
        log_norms: bool = True,
        log_spectral_norms: bool = True,
        power_iter_steps: int = 10,
    ) -> None:
        self.log_norms = check_flag("log_norms", log_norms)
        self.log_spectral_norms = check_flag("log_spectral_norms", log_spectral_norms)
        self.power_iter_steps = check_positive_int("power_iter_steps", power_iter_steps)
        self._file = JsonArrayFile(self.LOG_FILENAME)
        self._vectors: dict[str, torch.Tensor] = {}
        self._first_eval = True
        self._warned = [False]

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._file.is_open:
            return
        params = _real_parameters(kwargs.get("model"), "ParameterNormLogger", self._warned)
        if params is None:
            return
        iters = self.power_iter_steps * (2 if self._first_eval else 1)
        self._first_eval = False
        record: dict[str, Any] = {}
        with torch.no_grad():
            if self.log_norms:
                values = torch.stack([p.detach().float().norm() for _, p in params]).tolist()
                record["norms"] = dict(zip([n for n, _ in params], values, strict=True))
            if self.log_spectral_norms:
                spectral = {}
                for name, p in params:
                    spectral[name], v = _spectral(p, self._vectors.get(name), iters)
                    if v is not None:
                        self._vectors[name] = v
                record["spectral_norms"] = spectral
        self._file.write(state.global_step, state.epoch, record)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._file.close()
