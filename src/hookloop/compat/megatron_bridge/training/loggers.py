"""The TensorBoard and W&B writers a Megatron-Bridge-style run's config enables.

Megatron-Bridge callbacks log through ``context.state.tensorboard_logger`` (a
``torch.utils.tensorboard.SummaryWriter``) and ``context.state.wandb_logger``
(the ``wandb`` module, after ``wandb.init``). As in Megatron-Bridge each is
opened on first use and only on the last rank; elsewhere, and when the config
does not ask for it, it is None, so ``if writer:`` guards work unchanged.

Where the settings come from:

- a :class:`ConfigContainer`: ``logger.tensorboard_dir``; ``logger.wandb_project``
  with ``logger.wandb_exp_name`` (required, as in the original) and
  ``logger.wandb_save_dir`` (default ``<checkpoint.save>/wandb``);
- a native :class:`hookloop.Config` with a run directory: ``logging.tensorboard``
  (into ``<run>/tb``) and ``logging.wandb`` / ``logging.wandb_project`` (run
  named after the directory).

W&B runs offline unless ``WANDB_MODE`` says otherwise (hookloop's rule for
every W&B writer; the original goes online by default).

:func:`write_training_scalars` and :func:`write_validation_scalars` write what
Megatron-Bridge's training log and evaluation write, under its tags: per log step
``learning-rate``, ``batch-size``, each loss, ``grad-norm`` (and
``skipped-train-samples`` once a step was skipped), each also ``<tag> vs samples``
against the consumed samples; per evaluation ``<loss> validation`` (and ``… vs
samples``; the ``… ppl`` pair with ``logger.log_validation_ppl_to_tensorboard``).
``training.train`` calls them; in ``pretrain()`` :class:`LogToWriters` does, from the
loop's logs (the test phase's losses as ``<loss> test``).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.callback import Callback
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.distributed import rank_info
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext

logger = logging.getLogger("megatron.bridge.training.train")

#: The loop's own log keys that are not losses: renamed to Megatron's tags, or not written.
NATIVE_LOG_TAGS = {"lr": "learning-rate", "grad_norm": "grad-norm", "epoch": None}


class Writers:
    """Opens the enabled writers lazily on the last rank; ``close()`` flushes and ends them."""

    def __init__(
        self,
        *,
        tensorboard_dir: str | Path | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str = "",
        wandb_save_dir: str | Path | None = None,
        wandb_entity: str | None = None,
        tensorboard_queue_size: int = 1000,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.tensorboard_dir = tensorboard_dir
        self.wandb_project = wandb_project
        self.wandb_exp_name = wandb_exp_name
        self.wandb_save_dir = wandb_save_dir
        self.wandb_entity = wandb_entity
        self.tensorboard_queue_size = tensorboard_queue_size
        self.config = config or {}
        self._tensorboard: Any = None
        self._wandb: Any = None

    @classmethod
    def for_run(cls, cfg: Any, out_dir: str | Path | None) -> Writers:
        """The writers ``cfg`` asks for, for a run writing into ``out_dir`` (may be None)."""
        if isinstance(cfg, ConfigContainer):
            lg = cfg.logger
            # wandb.init(dir=D) writes under D/wandb, so D is the parent of the run's wandb part
            save_dir = lg.wandb_save_dir or (RunDir(out_dir).wandb.parent if out_dir else None)
            return cls(
                tensorboard_dir=lg.tensorboard_dir,
                wandb_project=lg.wandb_project,
                wandb_exp_name=lg.wandb_exp_name,
                wandb_save_dir=save_dir,
                wandb_entity=lg.wandb_entity,
                tensorboard_queue_size=lg.tensorboard_queue_size,
                config=cfg.to_dict(),
            )
        logging = getattr(cfg, "logging", None)
        if out_dir is None or logging is None:
            return cls()
        run = RunDir(out_dir)
        return cls(
            tensorboard_dir=run.tensorboard if logging.tensorboard else None,
            wandb_project=logging.wandb_project if logging.wandb else None,
            wandb_exp_name=Path(out_dir).name,
            wandb_save_dir=run.wandb.parent,  # wandb.init(dir=D) writes under D/wandb
            config=cfg.to_dict(),
        )

    @property
    def enabled(self) -> bool:
        """Whether the config asks for any writer (on some rank)."""
        return bool(self.tensorboard_dir or self.wandb_project)

    @staticmethod
    def _on_last_rank() -> bool:
        rank, _, world = rank_info()
        return rank == world - 1

    @property
    def tensorboard(self) -> Any:
        """A ``SummaryWriter`` on the last rank when a TensorBoard directory is set, else None."""
        if self._tensorboard is None and self.tensorboard_dir and self._on_last_rank():
            writer = require(
                "torch.utils.tensorboard", extra="tensorboard", feature="tensorboard_logger"
            )
            self._tensorboard = writer.SummaryWriter(
                log_dir=str(self.tensorboard_dir), max_queue=self.tensorboard_queue_size
            )
        return self._tensorboard

    @property
    def wandb(self) -> Any:
        """The ``wandb`` module after ``wandb.init`` on the last rank when a project is set."""
        if self._wandb is None and self.wandb_project and self._on_last_rank():
            if not self.wandb_exp_name:
                raise ValueError(
                    "logger.wandb_project is set but logger.wandb_exp_name is empty: name the "
                    "W&B run (logger.wandb_exp_name = '...')"
                )
            wandb = require("wandb", extra="wandb", feature="wandb_logger")
            save_dir = self.wandb_save_dir
            if save_dir is not None:
                Path(save_dir).mkdir(parents=True, exist_ok=True)
            wandb.init(
                project=self.wandb_project,
                name=self.wandb_exp_name,
                dir=None if save_dir is None else str(save_dir),
                config=self.config,
                entity=self.wandb_entity,
                mode=os.environ.get("WANDB_MODE") or "offline",
            )
            self._wandb = wandb
        return self._wandb

    def close(self) -> None:
        """Flush and close what was opened (the run's end); nothing opened, nothing done."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def write_training_scalars(
    tensorboard: Any,
    wandb: Any,
    *,
    step: int,
    samples: int,
    skipped_samples: int,
    learning_rate: float,
    batch_size: int | None,
    losses: dict[str, float],
    grad_norm: float | None,
) -> None:
    """One log step's scalars under Megatron-Bridge's tags (either writer may be None)."""
    values: dict[str, float] = {"learning-rate": learning_rate}
    if skipped_samples > 0:
        values["skipped-train-samples"] = skipped_samples
    if batch_size is not None:
        values["batch-size"] = batch_size
    values |= losses
    if grad_norm is not None:
        values["grad-norm"] = grad_norm
    if tensorboard is not None:
        for tag, value in values.items():
            tensorboard.add_scalar(tag, value, step)
            if tag != "skipped-train-samples":
                tensorboard.add_scalar(f"{tag} vs samples", value, samples)
    if wandb is not None:
        wandb.log({"samples vs steps": samples, **values}, step=step)


def write_validation_scalars(
    tensorboard: Any,
    wandb: Any,
    *,
    step: int,
    samples: int,
    losses: dict[str, float],
    label: str = "validation",
    ppl: bool = False,
) -> None:
    """One evaluation's losses as ``<key> <label>`` (and ``… vs samples``; ``… ppl`` too)."""
    for key, loss in losses.items():
        values = {f"{key} {label}": loss}
        if ppl:
            values[f"{key} {label} ppl"] = math.exp(min(20.0, loss))
        if tensorboard is not None:
            for tag, value in values.items():
                tensorboard.add_scalar(tag, value, step)
                tensorboard.add_scalar(f"{tag} vs samples", value, samples)
        if wandb is not None:
            wandb.log(values, step=step)


def training_log_line(
    step: int,
    train_iters: int,
    samples: int,
    learning_rate: float,
    batch_size: int,
    losses: dict[str, float],
    grad_norm: float | None,
) -> str:
    """The console line of one log step, in Megatron-Bridge's layout."""
    parts = [
        f"iteration {step:8d}/{train_iters:8d}",
        f"consumed samples: {samples:12d}",
        f"learning rate: {learning_rate:.6E}",
        f"global batch size: {batch_size:5d}",
        *(f"{key}: {value:.6E}" for key, value in losses.items()),
    ]
    if grad_norm is not None:
        parts.append(f"grad norm: {grad_norm:.3f}")
    return " | ".join(parts)


class IntervalLosses:
    """The losses of the steps since the last console line, for its averages.

    Megatron-Bridge's console line shows each loss averaged over the steps of the log
    interval that updated the model; a skipped step (non-finite gradients) adds nothing.
    The sums stay tensors on the device until :meth:`take` reads them, on a log step.

    >>> interval = IntervalLosses()
    >>> interval.add({"lm loss": 3.0}, skipped=False)
    >>> interval.add({"lm loss": 99.0}, skipped=True)
    >>> interval.add({"lm loss": 1.0}, skipped=False)
    >>> interval.take()
    {'lm loss': 2.0}
    >>> interval.take()  # emptied by the line that showed them
    {}
    """

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.steps = 0

    def add(self, losses: dict[str, Any], skipped: bool) -> None:
        if skipped:
            return
        for key, value in losses.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.steps += 1

    def take(self) -> dict[str, float]:
        """Each loss's mean over the updated steps so far, then start a new interval."""
        means = {key: float(total) / max(1, self.steps) for key, total in self.sums.items()}
        self.sums, self.steps = {}, 0
        return means


def log_training_step(
    state: Any,
    loss_dict: dict[str, Any],
    grad_norm: float | None,
    optimizer: Any,
    interval: IntervalLosses,
    skipped: bool = False,
) -> None:
    """After each step of ``training.train`` (``state`` a GlobalState, its step already
    counted): add the step's losses to ``interval``; every ``logger.log_interval`` steps
    write the step's scalars to the writers and log the console line, its losses the
    interval's means."""
    ts, cfg = state.train_state, state.cfg
    interval.add(loss_dict, skipped)
    if not cfg.logger.log_interval or ts.step % cfg.logger.log_interval:
        return  # nothing read back to the host between log steps
    losses = {key: float(value) for key, value in loss_dict.items()}
    learning_rate = float(optimizer.param_groups[0]["lr"])
    write_training_scalars(
        state.tensorboard_logger,
        state.wandb_logger,
        step=ts.step,
        samples=ts.consumed_train_samples,
        skipped_samples=ts.skipped_train_samples,
        learning_rate=learning_rate,
        batch_size=cfg.train.global_batch_size,
        losses=losses,
        grad_norm=grad_norm,
    )
    line = training_log_line(
        ts.step,
        cfg.train.train_iters,
        ts.consumed_train_samples,
        learning_rate,
        cfg.train.global_batch_size,
        interval.take(),
        grad_norm,
    )
    logger.info(line)


class LogToWriters(Callback):
    """Writes every log and evaluation of a ``pretrain()`` run to its enabled writers.

    ``batch_size``: the global batch size (None: no ``batch-size`` tag);
    ``validation_ppl``: also the perplexities (``logger.log_validation_ppl_to_tensorboard``).
    """

    priority = 100  # after the producers of on_before_log

    def __init__(
        self, writers: Writers, batch_size: int | None = None, validation_ppl: bool = False
    ) -> None:
        self.writers = writers
        self.batch_size = batch_size
        self.validation_ppl = validation_ppl

    def on_log(self, ctx: CallbackContext) -> None:
        numbers = _numbers(ctx.logs)
        named = {NATIVE_LOG_TAGS.get(key, key): value for key, value in numbers.items()}
        losses = {
            key: value
            for key, value in numbers.items()
            if key not in NATIVE_LOG_TAGS and key != "skipped_steps"
        }
        if len(losses) > 1:
            losses.pop("loss", None)  # the loop's total; Megatron writes the loss-dict keys
        if "learning-rate" not in named:
            return
        write_training_scalars(
            self.writers.tensorboard,
            self.writers.wandb,
            step=ctx.state.step,
            samples=ctx.state.samples,
            skipped_samples=0,
            learning_rate=named["learning-rate"],
            batch_size=self.batch_size,
            losses=losses,
            grad_norm=named.get("grad-norm"),
        )

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._evaluation(ctx, "validation")

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._evaluation(ctx, "test")

    def _evaluation(self, ctx: CallbackContext, label: str) -> None:
        # evaluation keys carry the loop's prefix ("eval_lm loss"): Megatron's tags don't
        losses = {key.partition("_")[2]: v for key, v in _numbers(ctx.metrics).items()}
        if len(losses) > 1:
            losses.pop("loss", None)
        write_validation_scalars(
            self.writers.tensorboard,
            self.writers.wandb,
            step=ctx.state.step,
            samples=ctx.state.samples,
            losses=losses,
            label=label,
            ppl=self.validation_ppl,
        )


def _numbers(values: dict[str, Any] | None) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in (values or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
