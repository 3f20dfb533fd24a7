"""The sections of a run's configuration: each one's fields, defaults and checks.

One dataclass per concern (model, data, optimizer, scheduler, train, checkpoint,
logging, callbacks, control); each field carries a one-line doc (``hookloop config``
prints them) and each section's ``validate`` names a bad key and what is allowed.
:mod:`hookloop.config` puts them together in :class:`~hookloop.config.Config`, reads
them from YAML and applies ``KEY=VALUE`` overrides; import them from there.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from hookloop.errors import ConfigError


def opt(default: Any, doc: str) -> Any:
    """A dataclass field with a default and a one-line doc."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    """Model hyper-parameters; recipes subclass this with their own fields."""


@dataclass
class DataConfig:
    """Data loading; recipes may subclass this to add source-specific fields."""

    batch_size: int | Literal["auto"] = opt(
        32, "Micro-batch size per process; auto: the largest that fits (found at start)."
    )
    auto_batch_start: int = opt(
        1024, "With batch_size=auto: the first size tried (then halved until one fits)."
    )
    eval_batch_size: int | None = opt(None, "Evaluation batch size (default: batch_size).")
    shuffle: bool = opt(True, "Shuffle training data each epoch (reproducibly, by seed).")
    num_workers: int = opt(0, "DataLoader worker processes.")
    ledger: bool = opt(
        False,
        "Write which samples each step took to <run>/ledger/ (checked by "
        "hookloop runs RUN --verify-ledger).",
    )

    def validate(self) -> None:
        if self.batch_size != "auto":
            _positive(self, "batch_size", "data")
        _positive(self, "auto_batch_start", "data")
        if self.eval_batch_size is not None:
            _positive(self, "eval_batch_size", "data")
        _non_negative(self, "num_workers", "data")


#: The optimizers ``optimizer.name`` knows by a short name (their settings are its keys).
OPTIMIZERS = ("adamw", "adam", "sgd")
#: The schedules ``scheduler.name`` knows by a short name (warm-up, then decay).
SCHEDULES = ("constant", "cosine", "linear")


@dataclass
class OptimizerConfig:
    name: str = opt(
        "adamw",
        "Optimizer: adamw | adam | sgd, a torch.optim class name (RMSprop, Adagrad, ...) "
        "or an import path package.module:Class.",
    )
    lr: float = opt(1e-3, "Peak learning rate.")
    weight_decay: float = opt(0.0, "Decoupled weight decay (adamw) or L2 (adam, sgd).")
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam betas (adamw, adam).")
    eps: float = opt(1e-8, "Adam epsilon (adamw, adam).")
    momentum: float = opt(0.0, "SGD momentum (sgd).")
    kwargs: dict[str, Any] = opt(
        {}, "More keyword arguments for the optimizer class, e.g. {alpha: 0.9, momentum: 0.5}."
    )

    def validate(self) -> None:
        check_class_name(self.name, OPTIMIZERS, "optimizer", "torch.optim")
        _keyword_arguments(self.kwargs, "optimizer")
        if not 0 <= self.lr < float("inf"):  # 0 is allowed: a run that measures, not learns
            raise ConfigError(f"optimizer.lr must be a finite number >= 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay!r}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas must each lie in [0, 1), got {self.betas!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.momentum must lie in [0, 1), got {self.momentum!r}")


@dataclass
class SchedulerConfig:
    name: str = opt(
        "constant",
        "Learning-rate schedule: constant | cosine | linear, a torch.optim.lr_scheduler "
        "class name (StepLR, ...) or an import path package.module:Class.",
    )
    warmup_steps: int = opt(
        0, "Linear warm-up steps from 0 to the peak rate (constant, cosine, linear)."
    )
    min_lr_ratio: float = opt(0.1, "Final rate as a fraction of the peak (cosine, linear).")
    kwargs: dict[str, Any] = opt(
        {}, "Keyword arguments for a scheduler class, e.g. {step_size: 100, gamma: 0.5}."
    )

    def validate(self) -> None:
        check_class_name(self.name, SCHEDULES, "scheduler", "torch.optim.lr_scheduler")
        _keyword_arguments(self.kwargs, "scheduler")
        _non_negative(self, "warmup_steps", "scheduler")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(
                f"scheduler.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}"
            )
        if self.name not in SCHEDULES and self.warmup_steps:
            raise ConfigError(
                f"scheduler.warmup_steps applies to {' | '.join(SCHEDULES)}, not to "
                f"{self.name}: set it to 0 (a class brings its own warm-up, e.g. "
                "SequentialLR over LinearLR)"
            )
        if self.name in SCHEDULES and self.kwargs:
            raise ConfigError(
                f"scheduler.kwargs applies to a scheduler class, not to {self.name!r} "
                f"(its keys are scheduler.warmup_steps and scheduler.min_lr_ratio)"
            )


def check_class_name(name: Any, short: tuple[str, ...], key: str, module: str) -> None:
    """``name`` is one of the ``short`` names, a class of ``module`` or ``pkg.mod:Class``
    (imported when the run is built); otherwise a one-line error naming the forms."""
    import importlib

    if isinstance(name, str) and name in short:
        return
    classes = class_names(importlib.import_module(module), module)
    if isinstance(name, str) and (name in classes or _is_import_path(name)):
        return
    by_lower = {c.lower(): c for c in [*short, *classes]}
    close = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f" Did you mean {by_lower[close[0]]!r}?" if close else ""
    example = "RMSprop" if key == "optimizer" else "StepLR"
    raise ConfigError(
        f"{key}.name must be {' | '.join(short)}, a {module} class name (e.g. {example}) "
        f"or an import path package.module:Class, got {name!r}.{hint}"
    )


def class_names(module: Any, prefix: str) -> list[str]:
    """The public classes ``module`` defines under ``prefix`` (its optimizers or schedulers;
    their base classes left out)."""
    bases = {"Optimizer", "LRScheduler", "_LRScheduler"}
    return sorted(
        name
        for name, obj in vars(module).items()
        if isinstance(obj, type)
        and not name.startswith("_")
        and name not in bases
        and obj.__module__.startswith(prefix)
    )


def _is_import_path(name: str) -> bool:
    module, _, attr = name.partition(":")
    parts = [*module.split("."), *attr.split(".")]
    return bool(module and attr) and all(part.isidentifier() for part in parts)


def _keyword_arguments(kwargs: Any, key: str) -> None:
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(
            f"{key}.kwargs must be a mapping of argument names to values, e.g. "
            f"{key}.kwargs={{name: value}}, got {kwargs!r}"
        )


@dataclass
class TrainConfig:
    max_steps: int | None = opt(None, "Stop after this many optimizer steps.")
    max_epochs: int | None = opt(None, "Stop after this many epochs (1 if neither is set).")
    grad_accum: int = opt(1, "Micro-batches accumulated per optimizer step.")
    clip_grad_norm: float | None = opt(1.0, "Clip the total gradient norm to this; null: off.")
    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Autocast precision.")
    device: str = opt("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'.")
    parallel: Literal["ddp", "fsdp", "local"] = opt(
        "ddp",
        "With several ranks: 'ddp' syncs gradients every step; 'fsdp' also shards weights "
        "and optimizer state (FSDP2); 'local' never syncs (DiLoCo).",
    )
    log_every: int = opt(10, "Fire the logging events every N steps (0: never).")
    eval_every: int | None = opt(None, "Evaluate every N steps (null: not by steps).")
    eval_at_epoch_end: bool = opt(True, "Evaluate at the end of each epoch.")
    eval_max_batches: int | None = opt(None, "Cap on evaluation batches (null: all).")
    skip_nonfinite: bool = opt(True, "Skip the optimizer step when loss or grad is NaN/Inf.")
    max_skipped_steps: int | None = opt(
        None, "Raise once this many steps have been skipped (null: no limit)."
    )
    max_skipped_fraction: float | None = opt(
        0.25, "A run that skipped more than this fraction of its steps failed (exit 4)."
    )
    exit_interval: int | None = opt(None, "Save and exit when step is a multiple of N.")
    exit_duration_minutes: float | None = opt(None, "Save and exit after this much wall time.")
    iterations_to_skip: list[int] = opt([], "Steps whose data is consumed without computing.")
    handle_signals: bool = opt(True, "On SIGTERM/SIGINT finish the step, save, exit.")
    deterministic: bool = opt(False, "torch.use_deterministic_algorithms(True).")
    compile: bool = opt(False, "torch.compile the model (and the loss_fn) for training.")
    activation_checkpointing: str | None = opt(
        None,
        "Recompute the activations of these submodule classes in backward instead of keeping "
        "them (comma-separated class names, e.g. Block); null: off.",
    )
    flops_per_sample: float | None = opt(
        None, "Training FLOPs per sample, for throughput (null: the recipe's estimate)."
    )
    gc_every: int | None = opt(
        None, "Automatic GC off in training; gc.collect() every N steps on every rank (null: off)."
    )
    gc_eval: bool = opt(True, "With gc_every: also collect before and after each evaluation.")
    timers: Literal["off", "on", "sync"] = opt(
        "on", "Loop timers in state.timers: 'on' host clock, 'sync' waits for the device too."
    )
    log_timers: bool = opt(False, "Add the loop timers (ms per step) to each log.")
    log_num_zeros_in_grad: bool = opt(False, "Log the count of zero gradient elements.")
    watchdog_seconds: float | Literal["auto"] | None = opt(
        "auto",
        "With several ranks: a rank silent or stuck in one callback this long hangs; the others "
        "name it and exit 5 ('auto': max(10, 3 x slowest of 20 steps); null or 0: off).",
    )

    def validate(self) -> None:
        for name in (
            "max_steps",
            "max_epochs",
            "eval_every",
            "eval_max_batches",
            "exit_interval",
            "max_skipped_steps",
        ):
            if getattr(self, name) is not None:
                _positive(self, name, "train")
        _positive(self, "grad_accum", "train")
        _non_negative(self, "log_every", "train")
        names = self.activation_checkpointing
        if names is not None and (
            not isinstance(names, str)
            or not all(n.strip().isidentifier() for n in names.split(","))
        ):
            raise ConfigError(
                "train.activation_checkpointing must be module class names separated by commas "
                f"(e.g. Block), or null; got {names!r}"
            )
        if self.max_skipped_fraction is not None and not 0 <= self.max_skipped_fraction < 1:
            raise ConfigError(
                "train.max_skipped_fraction must lie in [0, 1) or be null, got "
                f"{self.max_skipped_fraction!r}"
            )
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(
                f"train.clip_grad_norm must be > 0 or null, got {self.clip_grad_norm!r}"
            )
        if self.exit_duration_minutes is not None and not self.exit_duration_minutes > 0:
            raise ConfigError(
                "train.exit_duration_minutes must be > 0 or null, "
                f"got {self.exit_duration_minutes!r}"
            )
        if any(s < 1 for s in self.iterations_to_skip):
            raise ConfigError(
                f"train.iterations_to_skip holds step numbers >= 1, got {self.iterations_to_skip}"
            )
        self._validate_runtime()

    def _validate_runtime(self) -> None:
        """The keys of how the loop runs: collection, timers, parallelism, device."""
        if self.gc_every is not None:
            _positive(self, "gc_every", "train")
        if not isinstance(self.gc_eval, bool):
            raise ConfigError(f"train.gc_eval must be true or false, got {self.gc_eval!r}")
        if self.flops_per_sample is not None and not (
            isinstance(self.flops_per_sample, (int, float))
            and not isinstance(self.flops_per_sample, bool)
            and 0 < self.flops_per_sample < float("inf")
        ):
            raise ConfigError(
                "train.flops_per_sample must be a finite number > 0 or null, "
                f"got {self.flops_per_sample!r}"
            )
        if self.timers not in ("off", "on", "sync"):
            raise ConfigError(f"train.timers must be 'off', 'on' or 'sync', got {self.timers!r}")
        if self.log_timers and self.timers == "off":
            raise ConfigError(
                "train.log_timers needs the timers: set train.timers to 'on' or 'sync'"
            )
        wd = self.watchdog_seconds
        if (
            wd != "auto"
            and wd is not None
            and (
                isinstance(wd, bool)
                or not isinstance(wd, (int, float))
                or not 0 <= wd < float("inf")
            )
        ):
            raise ConfigError(
                f"train.watchdog_seconds must be 'auto', a number of seconds >= 0 or null "
                f"(0 and null: off), got {wd!r}"
            )
        parallel_modes = typing.get_args(type_hints(TrainConfig)["parallel"])
        if self.parallel not in parallel_modes:
            raise ConfigError(
                f"train.parallel must be one of {', '.join(map(repr, parallel_modes))}, "
                f"got {self.parallel!r}"
            )
        dev = self.device
        if dev not in ("auto", "cpu", "cuda", "mps") and not dev.startswith("cuda:"):
            raise ConfigError(
                f"train.device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got {dev!r}"
            )


@dataclass
class CheckpointConfig:
    every: int | None = opt(None, "Save every N steps (null: only at the end / on request).")
    keep_last: int | None = opt(3, "Keep the newest K step checkpoints (null: keep all).")
    save_on_end: bool = opt(True, "Save when training ends normally or is stopped.")
    monitor: str | None = opt(None, "Metric for keeping the best checkpoint, e.g. eval_loss.")
    mode: Literal["min", "max"] = opt("min", "Whether a lower or higher monitor is better.")
    keep_best: int = opt(1, "How many best checkpoints to keep when monitor is set.")
    strict_resume: bool = opt(False, "Error (not warn) on callback state mismatches at resume.")
    allow_restart: bool = opt(
        False, "resume=auto with every checkpoint damaged starts over (default: refuse)."
    )
    pretrained: str | None = opt(None, "Weights to start from (finetune): a checkpoint or file.")
    async_save: bool = opt(
        True,
        "Write checkpoints on a background thread: training waits only for a copy to host "
        "memory (one process, unsharded; otherwise saves are synchronous).",
    )
    local_every: int | None = opt(
        None, "Also save a local (non-persistent) checkpoint every N steps (null: off)."
    )
    local_dir: str | None = opt(
        None, "Where local checkpoints go (null: local_checkpoints/ in the run directory)."
    )

    def validate(self) -> None:
        if self.every is not None:
            _positive(self, "every", "checkpoint")
        if self.keep_last is not None:
            _positive(self, "keep_last", "checkpoint")
        _positive(self, "keep_best", "checkpoint")
        if not isinstance(self.async_save, bool):
            raise ConfigError(
                f"checkpoint.async_save must be true or false, got {self.async_save!r}"
            )
        if self.local_every is not None:
            _positive(self, "local_every", "checkpoint")
        if self.local_dir is not None and (
            not isinstance(self.local_dir, str) or not self.local_dir
        ):
            raise ConfigError(
                f"checkpoint.local_dir must be a directory path or null, got {self.local_dir!r}"
            )
        if self.local_dir is not None and self.local_every is None:
            raise ConfigError(
                "checkpoint.local_dir is set but checkpoint.local_every is null, so no local "
                "checkpoint would be written; set checkpoint.local_every=N (steps) as well"
            )


@dataclass
class LoggingConfig:
    progress: bool = opt(True, "Show a progress bar (plain lines when not on a terminal).")
    json: bool = opt(True, "Write metrics.jsonl in the run directory.")
    progress_log: bool = opt(
        True, "Append job starts and per-save throughput to progress.txt (Megatron format)."
    )
    tensorboard: bool = opt(True, "Write TensorBoard events under tb/ (needs the extra).")
    wandb: bool = opt(False, "Log to Weights & Biases (offline unless WANDB_MODE says).")
    wandb_project: str = opt("hookloop", "W&B project name.")
    csv: bool = opt(False, "Write metrics.csv in the run directory (Lightning's CSVLogger).")
    mlflow: bool = opt(False, "Log params, metrics and artifacts to MLflow (needs the extra).")
    mlflow_uri: str | None = opt(
        None, "MLflow tracking URI (null: a file store in the run directory's mlruns/)."
    )
    mlflow_experiment: str | None = opt(
        None, "MLflow experiment name (null: the recipe's name, else 'hookloop')."
    )
    progress_interval: float = opt(
        1.0, "Least seconds between two shown progress rows (0: every log event)."
    )

    def validate(self) -> None:
        if not self.wandb_project:
            raise ConfigError("logging.wandb_project must be a non-empty string")
        for name in ("mlflow_uri", "mlflow_experiment"):
            if getattr(self, name) == "":
                raise ConfigError(f"logging.{name} must be a non-empty string or null")
        pi = self.progress_interval
        if isinstance(pi, bool) or not isinstance(pi, (int, float)) or not 0 <= pi < float("inf"):
            raise ConfigError(
                f"logging.progress_interval must be a number of seconds >= 0, got {pi!r}"
            )


@dataclass
class CallbacksConfig:
    """The built-in callbacks `hookloop train` adds (each one switchable)."""

    info: bool = opt(True, "Print a run summary at the start (InfoCallback).")
    metrics: bool = opt(True, "Throughput, MFU and peak memory in the logs (DefaultMetrics).")
    peak_flops: float | None = opt(None, "Hardware peak FLOP/s, for MFU (null: no MFU).")
    nan_detection: bool = opt(True, "Stop when the loss turns NaN/Inf (NaNDetection).")
    divergence: bool = opt(
        True, "Stop when the loss spikes far above its best (DivergenceDetector)."
    )
    textgen: bool = opt(True, "Sample text at each evaluation (recipes that generate text).")
    early_stopping_patience: int | None = opt(
        None, "Stop after N evaluations without a better eval_loss (null: off)."
    )
    divergence_action: Literal["stop", "abort", "rewind"] = opt(
        "stop", "On a divergence: stop (save, exit 4), abort, or rewind (roll back, go on)."
    )
    rewind_skip_batches: int | None = opt(
        None, "Rewind: batches skipped from where it began (null: those trained since)."
    )
    rewind_lr_factor: float = opt(1.0, "Rewind: multiply the learning rate by this ...")
    rewind_lr_steps: int = opt(0, "... for this many steps after the restored one (0: off).")
    max_rewinds: int = opt(3, "Rewinds before a divergence ends the run as failed (exit 4).")
    straggler_every: int | None = opt(
        None, "Every N steps, name ranks slower than the median (StragglerDetection; null: off)."
    )
    straggler_threshold: float = opt(
        1.4, "A rank slower than this many times the median step time is a straggler."
    )
    profile: bool = opt(False, "Time every callback handler; print the cost table at the end.")
    torch_profile: str | None = opt(
        None, "START:END: torch.profiler traces of steps START..END under profile/ (null: off)."
    )
    model_summary: bool = opt(
        True, "Print parameters per top-level module at the start (ModelSummary)."
    )
    diloco: bool | None = opt(
        None, "DiLoCo worker of the server in DILOCO_SERVER (null: on when that is set)."
    )
    ema_decay: float | None = opt(
        None, "Keep an exponential moving average of the weights with this decay (EMA; null: off)."
    )
    ema_eval: bool = opt(True, "With ema_decay: evaluate with the averaged weights.")

    def validate(self) -> None:
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ConfigError(f"callbacks.peak_flops must be > 0 or null, got {self.peak_flops!r}")
        if self.early_stopping_patience is not None:
            _positive(self, "early_stopping_patience", "callbacks")
        self._validate_rewind()
        if self.straggler_every is not None:
            _positive(self, "straggler_every", "callbacks")
        st = self.straggler_threshold
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not st > 1:
            raise ConfigError(f"callbacks.straggler_threshold must be a number > 1, got {st!r}")
        if self.diloco is not None and not isinstance(self.diloco, bool):
            raise ConfigError(f"callbacks.diloco must be true, false or null, got {self.diloco!r}")
        if self.torch_profile is not None:
            profile_window(self.torch_profile)
        decay = self.ema_decay
        number = isinstance(decay, (int, float)) and not isinstance(decay, bool)
        if decay is not None and not (number and 0 <= decay < 1):
            raise ConfigError(
                f"callbacks.ema_decay must be a number in [0, 1) or null, got {decay!r}"
            )

    def _validate_rewind(self) -> None:
        if self.divergence_action not in ("stop", "abort", "rewind"):
            raise ConfigError(
                "callbacks.divergence_action must be 'stop', 'abort' or 'rewind', "
                f"got {self.divergence_action!r}"
            )
        if self.rewind_skip_batches is not None:
            _non_negative(self, "rewind_skip_batches", "callbacks")
        factor = self.rewind_lr_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ConfigError(f"callbacks.rewind_lr_factor must be a number > 0, got {factor!r}")
        if not 0 < factor < float("inf"):
            raise ConfigError(f"callbacks.rewind_lr_factor must be a number > 0, got {factor!r}")
        _non_negative(self, "rewind_lr_steps", "callbacks")
        _non_negative(self, "max_rewinds", "callbacks")


@dataclass
class ControlConfig:
    """The HTTP control server of `hookloop train` (rank 0 only)."""

    enabled: bool = opt(True, "Serve status, commands and a dashboard over HTTP.")
    host: str = opt("127.0.0.1", "Address to bind; anything but loopback gets a warning.")
    port: int = opt(0, "Port (0: pick a free one).")
    disable_auth: bool = opt(
        False,
        "Serve without a bearer token (Forgather's older clients send none); loopback only "
        "unless allow_remote_without_auth is also true.",
    )
    allow_remote_without_auth: bool = opt(
        False,
        "With disable_auth: allow a host other than loopback (anyone reaching it can stop "
        "the job).",
    )

    def validate(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ConfigError(f"control.port must be an int, got {self.port!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"control.port must lie in [0, 65535] (0: any), got {self.port}")
        if not self.host:
            raise ConfigError("control.host must be a non-empty address")
        for name in ("disable_auth", "allow_remote_without_auth"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"control.{name} must be true or false, got {getattr(self, name)!r}"
                )
        if self.disable_auth and not self.allow_remote_without_auth:
            import ipaddress

            try:
                loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
            except ValueError:
                loopback = False
            if not loopback:
                raise ConfigError(
                    f"control.disable_auth=true on control.host={self.host} would let anyone who "
                    "reaches it stop the job: use 127.0.0.1, keep authentication, or also set "
                    "control.allow_remote_without_auth=true"
                )


def profile_window(text: str) -> tuple[int, int]:
    """``callbacks.torch_profile``'s ``START:END`` as two ints, START < END, both >= 1."""
    start, sep, end = str(text).partition(":")
    try:
        first, last = int(start), int(end)
    except ValueError:
        first = last = 0
    if not sep or not 1 <= first < last:
        raise ConfigError(
            f"callbacks.torch_profile must be START:END with 1 <= START < END (steps, e.g. "
            f"5:10; quote it in YAML), got {text!r}"
        )
    return first, last


_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _positive(section: Any, name: str, where: str) -> None:
    value = getattr(section, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{name} must be an int >= 1, got {value!r}")


def _non_negative(section: Any, name: str, where: str) -> None:
    value = getattr(section, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}.{name} must be an int >= 0, got {value!r}")
