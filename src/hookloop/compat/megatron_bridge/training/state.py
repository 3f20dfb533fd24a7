"""``GlobalState`` and ``TrainState``: what forward steps and callbacks receive as ``state``.

Shaped as Megatron-Bridge's (``megatron.bridge.training.state``): ``cfg``,
``train_state`` (a plain, mutable dataclass with its eight fields), ``timers`` (with
Megatron-Core's ``log()`` and ``write()``), ``start_time``, the TensorBoard and
W&B writers its config names (opened on first use, last rank only) and the exit
signal handler. The loop keeps its own counters; before each callback event and each
forward step the dialect copies them into ``train_state`` under Megatron-Bridge's
numbering (:meth:`GlobalState.refresh`): during a step, ``step`` is the number of
steps done before it, as in Megatron-Bridge, where the counter moves after the step.

>>> state = GlobalState()
>>> state.train_state.step, state.train_state.consumed_train_samples
(0, 0)
>>> state.train_state.step = 5  # a plain dataclass, as upstream's
>>> timer = state.timers("forward")
>>> timer.start(); timer.stop()
>>> timer.elapsed() >= 0.0
True
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.compat.megatron_bridge.training.loggers import Writers
from hookloop.compat.megatron_bridge.training.utils.sig_utils import DistributedSignalHandler
from hookloop.state import TrainState as NativeTrainState
from hookloop.timers import Timer
from hookloop.timers import Timers as NativeTimers

__all__ = ["FaultToleranceState", "GlobalState", "Timer", "Timers", "TrainState"]

#: Megatron-Core logs its timers through this logger.
timers_logger = logging.getLogger("megatron.core.timers")


@dataclass
class TrainState:
    """Progress of the run under Megatron-Bridge's names (all counters over all ranks)."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fields as tensors of Megatron-Bridge's types (int32 counters, float64 FLOPs)."""
        return {
            name: torch.tensor(value, dtype=_DTYPES[name]) for name, value in vars(self).items()
        }

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        for name in _DTYPES:
            setattr(self, name, state_dict[name].item())


_DTYPES = {
    "step": torch.int32,
    "consumed_train_samples": torch.int32,
    "skipped_train_samples": torch.int32,
    "consumed_valid_samples": torch.int32,
    "floating_point_operations_so_far": torch.float64,
    "do_train": torch.bool,
    "do_valid": torch.bool,
    "do_test": torch.bool,
}


@dataclass
class FaultToleranceState:
    """Megatron-Bridge's fault-tolerance bookkeeping; the dialect keeps it, NVRx never fills it."""

    ft_state_path: str | None = None
    is_persistent_chkpt_loaded: bool = False
    is_async_chkpt_enabled: bool = False
    is_calculating_timeouts: bool = False
    is_setup_section_open: bool = False
    seen_checkpoints_cnt: int = 0
    seen_tr_iters_cnt: int = 0
    curr_eval_iter_idx: int = 0


class Timers:
    """The run's named timers with Megatron-Core's reporting: ``log()`` and ``write()``.

    ``timers(name)`` is the loop's own timer of that name (``forward-backward``,
    ``optimizer``, … and any a forward step or callback starts).
    """

    def __init__(self, native: NativeTimers | None = None) -> None:
        self.native = native if native is not None else NativeTimers()

    def __call__(self, name: str, log_level: int | None = None) -> Timer:
        return self.native(name, log_level)

    def __contains__(self, name: object) -> bool:
        return name in self.native

    def names(self) -> list[str]:
        return self.native.names()

    def elapsed(self, reset: bool = True) -> dict[str, float]:
        return self.native.elapsed(reset=reset)

    def _min_max_ms(
        self, names: list[str], reset: bool, normalizer: float
    ) -> dict[str, tuple[float, float]]:
        """``{name: (min, max)}`` over ranks of each timer that ran, in ``normalizer`` units."""
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"names must be a list of timer names, got {names!r}")
        if not isinstance(normalizer, (int, float)) or not normalizer > 0:
            raise ValueError(f"normalizer must be a number > 0, got {normalizer!r}")
        values = torch.tensor(
            [self.native(n).elapsed(reset=reset) if n in self.native else 0.0 for n in names],
            dtype=torch.float64,
        )
        low, high = values.clone(), values.clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
            torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
        return {
            name: (float(lo) / normalizer, float(hi) / normalizer)
            for name, lo, hi in zip(names, low.tolist(), high.tolist(), strict=True)
            if hi > 0
        }

    def log(
        self,
        names: list[str],
        rank: int | None = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Log ``(min, max) time across ranks (ms)`` of ``names`` on ``rank`` (default: last)."""
        times = self._min_max_ms(list(names), reset, normalizer / 1000.0)
        if not times:
            return
        lines = ["(min, max) time across ranks (ms):"]
        lines += [
            "    {}: ({:.2f}, {:.2f})".format((name + " ").ljust(48, "."), lo, hi)
            for name, (lo, hi) in times.items()
        ]
        this_rank, world = _rank_and_world()
        if (world - 1 if rank is None else rank) == this_rank:
            timers_logger.info("\n".join(lines))

    def write(
        self,
        names: list[str],
        writer: Any,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Write each timer's maximum over ranks (seconds) as ``<name>-time`` to ``writer``
        (a TensorBoard ``SummaryWriter`` or the ``wandb`` module)."""
        times = self._min_max_ms(list(names), reset, normalizer)
        if writer is None:
            return
        for name, (_, high) in times.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", high, iteration)
            else:
                writer.log({name + "-time": high}, iteration)

    def __repr__(self) -> str:
        return f"Timers({', '.join(self.native.names())})"


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class GlobalState:
    """``cfg``, ``train_state``, ``timers``, ``start_time`` and the two writers of a run.

    One is shared by the forward step and the callbacks of a run. ``start_time`` is
    when it was made (Megatron-Bridge measures the job's throughput from there).
    ``GlobalState(cfg)`` or, as in Megatron-Bridge, ``GlobalState()`` then
    ``state.cfg = cfg``: the writers and the signal handler follow the config set.
    """

    def __init__(
        self,
        cfg: Any = None,
        *,
        native_config: Any = None,
        writers: Writers | None = None,
    ) -> None:
        self._cfg = cfg
        self._native_config = native_config
        self.start_time: float = time.time()
        #: FLOPs already done when this job started (a resumed run's restored count);
        #: the job's throughput in ``progress.txt`` counts from here.
        self.job_start_flops: float = 0.0
        #: Writers given by the entry point; None: those ``cfg`` names, made on first use.
        self._given_writers = writers
        self._writers: Writers | None = writers
        self._signal_handler: DistributedSignalHandler | None = None
        self._train_state = TrainState()
        self._timers = Timers()
        self._ft_state = FaultToleranceState()
        #: NVRx's straggler detection is not reproduced: always None.
        self.nvrx_straggler_manager: Any = None
        #: NVRx's fault-tolerance client: the dialect makes none, so it stays None.
        self.rank_monitor_client: Any = None

    @property
    def cfg(self) -> Any:
        """The run's ConfigContainer (or hookloop Config)."""
        return self._cfg

    @cfg.setter
    def cfg(self, value: Any) -> None:
        if value is not self._cfg:
            self.close_loggers()
            self._writers = self._given_writers
            self._signal_handler = None
            self._native_config = None  # that of the config before
        self._cfg = value
        if value is not None:
            self._set_signal_handler()  # reads train.exit_signal, as Megatron-Bridge's

    @property
    def native_config(self) -> Any:
        """The hookloop Config the loop runs (``cfg`` itself unless cfg is a ConfigContainer)."""
        return self._cfg if self._native_config is None else self._native_config

    @native_config.setter
    def native_config(self, value: Any) -> None:
        self._native_config = value

    @property
    def train_state(self) -> TrainState:
        return self._train_state

    @train_state.setter
    def train_state(self, value: TrainState) -> None:
        if not isinstance(value, TrainState):
            raise TypeError(f"train_state must be a TrainState, got {type(value).__name__}")
        self._train_state = value

    @property
    def timers(self) -> Timers:
        """The run's named timers (the loop's own once a run is attached)."""
        return self._timers

    @property
    def tensorboard_logger(self) -> Any:
        """A ``SummaryWriter`` into ``cfg.logger.tensorboard_dir`` on the last rank, else None."""
        return self._open_writers().tensorboard

    @property
    def wandb_logger(self) -> Any:
        """The ``wandb`` module, its run started (last rank, when enabled), else None."""
        return self._open_writers().wandb

    @property
    def fault_tolerance_state(self) -> FaultToleranceState:
        return self._ft_state

    @fault_tolerance_state.setter
    def fault_tolerance_state(self, value: FaultToleranceState) -> None:
        self._ft_state = value

    @property
    def signal_handler(self) -> DistributedSignalHandler | None:
        """The handler of ``cfg.train.exit_signal`` (SIGTERM; None without a ``train``
        section); ``training.train`` enters it when ``cfg.train.exit_signal_handler`` is set."""
        if self._signal_handler is None:
            self._set_signal_handler()
        return self._signal_handler

    def _set_signal_handler(self) -> None:
        train = getattr(self._cfg, "train", None) if self._cfg is not None else None
        if train is not None:
            self._signal_handler = DistributedSignalHandler(
                getattr(train, "exit_signal", signal.SIGTERM)
            )

    @property
    def energy_monitor(self) -> None:
        """Megatron-Core's GPU energy meter: None, as upstream without ``logger.log_energy``
        (a setting the dialect does not have)."""
        return None

    @property
    def async_calls_queue(self) -> None:
        """Megatron-Core's queue of background checkpoint writes: None. With
        ``checkpoint.async_save`` the dialect writes in the background its own way."""
        return None

    def initialize_async_checkpoint_worker(self) -> None:
        """Does nothing: no Megatron-Core queue to start (see :attr:`async_calls_queue`)."""

    def reset_for_restart(self) -> None:
        """Start the run's bookkeeping afresh for a restart within the same process.

        The timers, ``train_state`` and signal handler are new ones; the writers are
        closed and open again on next use. ``cfg``, ``start_time``, the
        fault-tolerance state and ``rank_monitor_client`` are kept, as in Megatron-Bridge.
        """
        self.close_loggers()
        self._writers = self._given_writers
        self._train_state = TrainState()
        self._timers = Timers()
        self._signal_handler = None
        self.nvrx_straggler_manager = None

    def close_loggers(self) -> None:
        """Flush and close the writers opened during the run (the entry points call it)."""
        if self._writers is not None:
            self._writers.close()

    def _open_writers(self) -> Writers:
        if self._writers is None:
            cfg = self._cfg
            save = cfg.checkpoint.save if isinstance(cfg, ConfigContainer) else None
            self._writers = Writers.for_run(cfg, save)
        return self._writers

    def refresh(
        self,
        native: NativeTrainState,
        *,
        in_step: bool = False,
        has_valid: bool | None = None,
        has_test: bool | None = None,
    ) -> None:
        """Copy the loop's counters into ``train_state``; ``in_step`` inside a training step.

        The loop counts a step as soon as it begins; Megatron-Bridge after its update.
        So inside a step the step, its samples and its FLOPs are taken back out
        (the per-step share, exact for a constant batch size). The steps
        ``train.iterations_to_skip`` lists count as skipped samples, without FLOPs.
        """
        ts, step, samples, flops = self._train_state, native.step, native.samples, native.flops
        step_samples, step_flops = (samples // step, flops / step) if step else (0, 0.0)
        if in_step and step > 0:
            samples, flops, step = samples - step_samples, flops - step_flops, step - 1
        skipped = self._skipped_before(step)  # read their data, trained nothing
        ts.step, ts.consumed_train_samples = step, samples
        ts.skipped_train_samples = skipped * step_samples
        ts.floating_point_operations_so_far = flops - skipped * step_flops
        ts.do_train = True
        if has_valid is not None:
            ts.do_valid = has_valid
        if has_test is not None:
            ts.do_test = has_test
        if self._timers.native is not native.timers:
            self._timers = Timers(native.timers)

    def _skipped_before(self, step: int) -> int:
        """How many of the first ``step`` steps ``train.iterations_to_skip`` lists."""
        listed = getattr(getattr(self._cfg, "train", None), "iterations_to_skip", None) or ()
        return sum(1 for index in listed if index < step)

    def __repr__(self) -> str:
        return f"GlobalState(train_state={self._train_state!r})"
