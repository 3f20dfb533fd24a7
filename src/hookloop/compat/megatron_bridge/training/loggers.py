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

:class:`LogToWriters` is the entry point's own logging through the same
writers (as Megatron-Bridge's loop logs the loss components to TensorBoard/W&B): each
log's numbers at its step, and each evaluation's as ``<name> validation`` and
the test phase's as ``<name> test``, as Megatron's tags read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hookloop._optional import require
from hookloop.callback import Callback
from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.distributed import rank_info
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext


class Writers:
    """Opens the enabled writers lazily on the last rank; ``close()`` flushes and ends them."""

    def __init__(
        self,
        *,
        tensorboard_dir: str | Path | None = None,
        wandb_project: str | None = None,
        wandb_exp_name: str = "",
        wandb_save_dir: str | Path | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.tensorboard_dir = tensorboard_dir
        self.wandb_project = wandb_project
        self.wandb_exp_name = wandb_exp_name
        self.wandb_save_dir = wandb_save_dir
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
            self._tensorboard = writer.SummaryWriter(log_dir=str(self.tensorboard_dir))
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


class LogToWriters(Callback):
    """Writes every log and evaluation to the run's enabled writers (last rank only)."""

    priority = 100  # after the producers of on_before_log

    def __init__(self, writers: Writers) -> None:
        self.writers = writers

    def on_log(self, ctx: CallbackContext) -> None:
        self._write(ctx.logs, ctx.state.step, suffix="")

    def on_eval_end(self, ctx: CallbackContext) -> None:
        self._write(ctx.metrics, ctx.state.step, suffix=" validation")

    def on_test_end(self, ctx: CallbackContext) -> None:
        self._write(ctx.metrics, ctx.state.step, suffix=" test")

    def _write(self, values: dict[str, Any] | None, step: int, suffix: str) -> None:
        numbers = {
            # evaluation keys carry the loop's prefix ("eval_lm loss"): Megatron's tags don't
            (key.partition("_")[2] if suffix else key) + suffix: float(value)
            for key, value in (values or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if not numbers:
            return
        tensorboard, wandb = self.writers.tensorboard, self.writers.wandb
        if tensorboard is not None:
            for tag, value in numbers.items():
                tensorboard.add_scalar(tag, value, step)
        if wandb is not None:
            wandb.log(numbers, step=step)
