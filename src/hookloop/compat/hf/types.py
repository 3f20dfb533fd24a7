"""The objects an HF-style handler receives: ``args``, ``state`` and ``control``.

They carry HuggingFace's field names so that callbacks written for
``transformers.Trainer`` (or Forgather's trainer) read them unmodified. They are views for
the dialect only: the engine's own counters stay in :class:`hookloop.TrainState`
and its requests in :class:`hookloop.Control`; the adapter copies one way into
``TrainerState`` and turns ``TrainerControl`` flags into native requests.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from hookloop.config import Config
    from hookloop.state import TrainState

_STRATEGIES = ("no", "steps", "epoch")


#: The ``--help`` of transformers' fields the dialect does not carry out (HfArgumentParser
#: hands a field's metadata to argparse, so the mark is its help text).
NOT_CARRIED_OUT = "transformers' field; hookloop.compat.hf refuses any value but its default"


def _theirs(default: Any) -> Any:
    """A transformers field this dialect does not carry out (refused unless at default)."""
    return field(default=default, metadata={"help": NOT_CARRIED_OUT})


@dataclass
class TrainingArguments:
    """HF's argument names for what a callback may read about the run.

    A plain dataclass (no device set-up, no accelerate). Build it yourself, or let
    :class:`hookloop.compat.hf.Trainer` derive it from the hookloop ``Config``
    (:meth:`from_config`); :meth:`to_config` goes the other way. As in HF,
    ``greater_is_better`` defaults to "the metric is not a loss".

    >>> args = TrainingArguments(metric_for_best_model="eval_loss")
    >>> args.greater_is_better
    False
    """

    output_dir: str | None = None
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    logging_strategy: str = "steps"
    logging_steps: int = 500
    logging_first_step: bool = False
    logging_dir: str | None = None
    eval_strategy: str = "no"
    eval_steps: int | None = None
    eval_delay: float = 0
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    load_best_model_at_end: bool = False
    seed: int = 42
    fp16: bool = False
    bf16: bool = False
    disable_tqdm: bool = False
    use_cpu: bool = False
    report_to: str | list[str] = "none"
    run_name: str | None = None
    restore_callback_states_from_checkpoint: bool = False
    # What transformers.Trainer builds from them (hookloop.compat.hf.optim / data).
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | None = None
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    data_seed: int | None = None
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    train_sampling_strategy: str = "random"
    logging_nan_inf_filter: bool = True
    include_for_metrics: list[str] = field(default_factory=list)
    prediction_loss_only: bool = False
    batch_eval_metrics: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    skip_memory_metrics: bool = True
    neftune_noise_alpha: float | None = None
    torch_compile: bool = False
    enable_jit_checkpoint: bool = False
    label_smoothing_factor: float = 0.0
    use_cache: bool = False
    # Passed to the DataLoader (hookloop.compat.hf.data).
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    # Read by example scripts (HfArgumentParser command lines), not by the Trainer; the
    # others change nothing here (hookloop.compat.hf.arguments.NO_EFFECT says why).
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: str | None = None
    log_level: str = "passive"
    eval_accumulation_steps: int | None = None
    dataloader_multiprocessing_context: str | None = None
    accelerator_config: Any = None  # read by hookloop.compat.hf.accelerator
    # transformers' other fields, with transformers' defaults: a Trainer built from them
    # refuses any set to something else, by name (hookloop.compat.hf.arguments), except
    # those it lists as without effect here.
    optim_target_modules: Any = _theirs(None)
    average_tokens_across_devices: bool = _theirs(True)
    tf32: Any = _theirs(None)
    activation_checkpointing: Any = _theirs(None)
    activation_checkpointing_kwargs: Any = _theirs(None)
    gradient_checkpointing: Any = _theirs(None)
    gradient_checkpointing_kwargs: Any = _theirs(None)
    torch_compile_backend: Any = _theirs(None)
    torch_compile_mode: Any = _theirs(None)
    use_liger_kernel: bool = _theirs(False)
    liger_kernel_config: Any = _theirs(None)
    torch_empty_cache_steps: Any = _theirs(None)
    auto_find_batch_size: bool = _theirs(False)
    log_on_each_node: bool = _theirs(True)
    include_num_input_tokens_seen: str | bool = _theirs("no")
    log_level_replica: str = _theirs("warning")
    project: str = _theirs("huggingface")
    trackio_space_id: Any = _theirs(None)
    trackio_bucket_id: Any = _theirs(None)
    trackio_static_space_id: Any = _theirs(None)
    eval_on_start: bool = _theirs(False)
    eval_do_concat_batches: bool = _theirs(True)
    eval_use_gather_object: bool = _theirs(False)
    save_only_model: bool = _theirs(False)
    save_on_each_node: bool = _theirs(False)
    push_to_hub: bool = _theirs(False)
    hub_token: Any = _theirs(None)
    hub_private_repo: Any = _theirs(None)
    hub_model_id: Any = _theirs(None)
    hub_strategy: str = _theirs("every_save")
    hub_always_push: bool = _theirs(False)
    hub_revision: Any = _theirs(None)
    ignore_data_skip: bool = _theirs(False)
    full_determinism: bool = _theirs(False)
    parallelism_config: Any = _theirs(None)
    dataloader_in_order: bool = _theirs(True)
    length_column_name: str = _theirs("length")
    ddp_find_unused_parameters: Any = _theirs(None)
    ddp_bucket_cap_mb: Any = _theirs(None)
    ddp_broadcast_buffers: Any = _theirs(None)
    ddp_static_graph: Any = _theirs(None)
    ddp_backend: Any = _theirs(None)
    ddp_timeout: int = _theirs(1800)
    fsdp: Any = _theirs(None)
    fsdp_config: Any = _theirs(None)
    deepspeed: Any = _theirs(None)
    debug: str = _theirs("")
    local_rank: int = _theirs(-1)

    def __post_init__(self) -> None:
        for name in ("logging_strategy", "eval_strategy", "save_strategy"):
            value = str(getattr(self, name, "")).lower()
            value = value.rsplit(".", 1)[-1]  # an IntervalStrategy enum prints as its name
            allowed = (*_STRATEGIES, "best") if name == "save_strategy" else _STRATEGIES
            if value not in allowed:
                raise ValueError(
                    f"TrainingArguments.{name} must be one of {', '.join(allowed)}, "
                    f"got {getattr(self, name)!r}"
                )
            setattr(self, name, value)
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ValueError(
                "`args.metric_for_best_model` must be provided with save_strategy='best' (the "
                "evaluation metric whose new best is saved)"
            )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingArguments.{name} must be an int >= 1, got {value!r}")
        self._check_training_fields()
        if self.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy"):  # transformers' rule
            if self.eval_strategy == "no":
                raise ValueError(
                    f"lr_scheduler_type={self.lr_scheduler_type!r} steps after evaluations: set "
                    "eval_strategy to 'steps' or 'epoch'"
                )
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.eval_steps is None and self.eval_strategy == "steps":
            self.eval_steps = self.logging_steps  # HF's rule
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _check_training_fields(self) -> None:
        """The optimizer, schedule, data and reporting fields (enums read as values)."""
        from hookloop.compat.hf import accelerator as hf_accelerator
        from hookloop.compat.hf import data, optim, reporting

        for name in ("lr_scheduler_type", "optim", "train_sampling_strategy"):
            value = getattr(self, name)
            setattr(self, name, str(getattr(value, "value", value)))
        if self.optim not in optim.OPTIMIZERS:
            raise ValueError(
                f"TrainingArguments.optim must be one of {', '.join(optim.OPTIMIZERS)}, "
                f"got {self.optim!r}"
            )
        if self.train_sampling_strategy not in data.SAMPLING:
            raise ValueError(
                "TrainingArguments.train_sampling_strategy must be one of "
                f"{', '.join(data.SAMPLING)}, got {self.train_sampling_strategy!r}"
            )
        if not (isinstance(self.warmup_steps, (int, float)) and self.warmup_steps >= 0):
            raise ValueError(
                "TrainingArguments.warmup_steps must be a number >= 0 (below 1: a fraction "
                f"of the run), got {self.warmup_steps!r}"
            )
        if not (isinstance(self.warmup_ratio, (int, float)) and 0 <= self.warmup_ratio < 1):
            raise ValueError(
                f"TrainingArguments.warmup_ratio must lie in [0, 1), got {self.warmup_ratio!r}"
            )
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"TrainingArguments.{name} must lie in [0, 1), got {value!r}")
        if not (isinstance(self.adam_epsilon, (int, float)) and self.adam_epsilon > 0):
            raise ValueError(
                f"TrainingArguments.adam_epsilon must be > 0, got {self.adam_epsilon!r}"
            )
        workers = self.dataloader_num_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(
                f"TrainingArguments.dataloader_num_workers must be an int >= 0, got {workers!r}"
            )
        if self.lr_scheduler_kwargs is not None and not isinstance(self.lr_scheduler_kwargs, dict):
            raise ValueError(
                "TrainingArguments.lr_scheduler_kwargs must be a dict or None, "
                f"got {self.lr_scheduler_kwargs!r}"
            )
        reporting.normalize(self.report_to)  # raises for a name hookloop cannot report to
        hf_accelerator.settings(self.accelerator_config)  # refused here, as transformers does

    # -- what transformers' TrainingArguments also answers about the process ------------
    @property
    def n_gpu(self) -> int:
        """GPUs this process trains on: one when CUDA is there and not ``use_cpu``."""
        return int(torch.cuda.is_available() and not self.use_cpu)

    @property
    def device(self) -> torch.device:
        if not self.n_gpu:
            return torch.device("cpu")
        return torch.device("cuda", self.local_process_index)

    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def world_size(self) -> int:
        dist = torch.distributed
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def process_index(self) -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0)) if self.world_size > 1 else 0

    @property
    def parallel_mode(self) -> str:
        """transformers' ``ParallelMode`` value (a string enum there)."""
        return "distributed" if self.world_size > 1 else "not_parallel"

    @property
    def should_log(self) -> bool:
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        return self.process_index == 0

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """The warm-up steps of a run of ``num_training_steps`` (a fraction below 1)."""
        from hookloop.compat.hf.optim import warmup_steps

        return warmup_steps(self, num_training_steps)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (enums as their values, the hub token hidden), as
        transformers serialises its arguments."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "<HUB_TOKEN>" if f.name.endswith("_token") and value else value
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """``to_dict`` with the batch sizes, every value a TensorBoard hparam can hold."""
        d = {**self.to_dict(), "train_batch_size": self.train_batch_size,
             "eval_batch_size": self.eval_batch_size}  # fmt: skip
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in d.items()}

    @classmethod
    def from_config(
        cls, config: Config, *, output_dir: str | None = None, has_eval_data: bool = True
    ) -> TrainingArguments:
        """What a hookloop ``Config`` means, under HF's names."""
        t, d, o, c = config.train, config.data, config.optimizer, config.checkpoint
        if not has_eval_data:
            eval_strategy = "no"
        elif t.eval_every:
            eval_strategy = "steps"
        else:
            eval_strategy = "epoch" if t.eval_at_epoch_end else "no"
        return cls(
            output_dir=output_dir,
            per_device_train_batch_size=d.batch_size,
            per_device_eval_batch_size=d.eval_batch_size or d.batch_size,
            gradient_accumulation_steps=t.grad_accum,
            learning_rate=o.lr,
            weight_decay=o.weight_decay,
            max_grad_norm=t.clip_grad_norm or 0.0,
            num_train_epochs=float(t.max_epochs or (0 if t.max_steps else 1)),
            max_steps=t.max_steps or -1,
            logging_strategy="steps" if t.log_every else "no",
            logging_steps=t.log_every or 500,
            eval_strategy=eval_strategy,
            eval_steps=t.eval_every,
            save_strategy="steps" if c.every else "no",
            save_steps=c.every or 500,
            save_total_limit=c.keep_last,
            metric_for_best_model=c.monitor,
            greater_is_better=(c.mode == "max") if c.monitor else None,
            seed=config.seed,
            fp16=t.precision == "fp16",
            bf16=t.precision == "bf16",
        )

    def _steps(self, steps: float) -> int:
        """An interval in steps: below 1, a fraction of ``max_steps`` (HF's rule); with an
        epoch budget the fraction's steps are known only from the data, so 1 stands in
        here and the dialect's flow, which knows the budget, decides."""
        if 0 < steps < 1:
            return _fraction_of(steps, self.max_steps) if self.max_steps > 0 else 1
        return int(steps)

    def to_config(self, base: Config | None = None) -> Config:
        """A hookloop ``Config`` (a copy of ``base``, or the defaults) that runs these args."""
        from hookloop.config import Config

        config = copy.deepcopy(base) if base is not None else Config()
        t, d, o, c = config.train, config.data, config.optimizer, config.checkpoint
        d.batch_size = self.per_device_train_batch_size
        d.eval_batch_size = self.per_device_eval_batch_size
        t.grad_accum = self.gradient_accumulation_steps
        o.lr = self.learning_rate
        o.weight_decay = self.weight_decay
        t.clip_grad_norm = self.max_grad_norm or None
        if self.max_steps > 0:
            t.max_steps, t.max_epochs = self.max_steps, None
        else:
            t.max_steps, t.max_epochs = None, max(1, round(self.num_train_epochs))
        t.log_every = self._steps(self.logging_steps) if self.logging_strategy == "steps" else 0
        t.eval_every = self._steps(self.eval_steps) if self.eval_strategy == "steps" else None
        t.eval_at_epoch_end = self.eval_strategy == "epoch"
        c.every = self._steps(self.save_steps) if self.save_strategy == "steps" else None
        c.keep_last = self.save_total_limit
        if self.metric_for_best_model is not None:
            c.monitor = eval_key(self.metric_for_best_model)
            c.mode = "max" if self.greater_is_better else "min"
        config.seed = self.seed
        t.compile = bool(self.torch_compile)
        t.precision = "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"
        if self.use_cpu:
            t.device = "cpu"
        return config.validate()


def _fraction_of(steps: float, max_steps: int) -> Any:
    """An interval below 1 is that fraction of the run, rounded up (HF's rule); while the
    run's length is unknown (0) the fraction stays as given."""
    if steps < 1:
        return math.ceil(max_steps * steps) if max_steps > 0 else steps
    return int(steps)


def eval_key(metric: str) -> str:
    """HF names the best-model metric with or without the ``eval_`` prefix."""
    return metric if metric.startswith("eval_") else f"eval_{metric}"


@dataclass
class TrainerState:
    """HF's view of the run's progress, refreshed from the native ``TrainState``.

    ``global_step`` counts completed optimizer steps, as in HF: during the events
    inside a step (``on_step_begin`` … ``on_optimizer_step``) it is one less than
    the native ``state.step``. ``log_history`` gets every log and evaluation dict;
    ``best_metric`` is updated after each evaluation, once every ``on_evaluate``
    handler has seen the previous best.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    #: (micro-batches per epoch, per step) when ``epoch`` counts micro-batches, as HF
    #: counts it (set by the dialect's budget); not part of HF's saved state.
    epoch_batches: ClassVar[tuple[int, int] | None] = None

    def refresh(self, native: TrainState, *, inside_step: bool) -> None:
        """Copy the counters that move during a run from the native state."""
        done = native.step - 1 if inside_step else native.step
        self.global_step = done
        per_epoch = native.steps_per_epoch
        epoch_done = native.epoch_step - 1 if inside_step else native.epoch_step
        batches = self.epoch_batches  # (micro-batches per epoch, per step), or None
        if batches:  # HF counts an epoch in micro-batches (the last group may be partial)
            total, k = batches
            self.epoch = native.epoch + min(epoch_done * k, total) / total
        else:
            self.epoch = native.epoch + (epoch_done / per_epoch if per_epoch else 0.0)
        self.num_input_tokens_seen = native.tokens
        self.total_flos = float(native.flops)

    def count_epochs_in_batches(self, batches_per_epoch: int, grad_accum: int) -> None:
        """Count ``epoch`` as HF does: micro-batches seen over the epoch's batches."""
        self.epoch_batches = (batches_per_epoch, grad_accum)

    def set_budget(self, native: TrainState, args: Any) -> None:
        """The fields fixed for a run (read at init and again at train begin)."""
        self.max_steps = native.max_steps or 0
        self.num_train_epochs = native.num_epochs or 0
        self.is_local_process_zero = native.local_rank == 0
        self.is_world_process_zero = native.rank == 0
        self.logging_steps = getattr(args, "logging_steps", None) or 500
        self.eval_steps = getattr(args, "eval_steps", None) or self.logging_steps
        self.save_steps = getattr(args, "save_steps", None) or 500
        for kind in ("logging", "eval", "save"):  # below 1: a fraction of the run (HF's rule)
            setattr(
                self, f"{kind}_steps", _fraction_of(getattr(self, f"{kind}_steps"), self.max_steps)
            )
        self.train_batch_size = getattr(args, "per_device_train_batch_size", None)

    def resumable(self) -> dict[str, Any]:
        """What a hookloop checkpoint keeps of this state (the rest is re-derived)."""
        return {
            "log_history": [dict(entry) for entry in self.log_history],
            "best_metric": self.best_metric,
            "best_global_step": self.best_global_step,
            "best_model_checkpoint": self.best_model_checkpoint,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        for key, value in saved.items():
            if key in {f.name for f in dataclasses.fields(self)}:
                setattr(self, key, value)

    def save_to_json(self, json_path: str | os.PathLike[str]) -> None:
        """This state as JSON (HF's ``trainer_state.json``)."""
        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text)

    @classmethod
    def load_from_json(cls, json_path: str | os.PathLike[str]) -> TrainerState:
        """A state read back from :meth:`save_to_json`'s file (or HF's)."""
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps`` / ``eval_steps`` / ``save_steps`` from ``args``; a value
        below 1 is a fraction of ``max_steps``, as in HF."""
        for kind in ("logging", "eval", "save"):
            steps = getattr(args, f"{kind}_steps", None)
            if steps is not None:
                if steps < 1:
                    steps = math.ceil(max_steps * steps)
                setattr(self, f"{kind}_steps", steps)


#: Every flag a handler may set, in the order the adapter acts on them.
CONTROL_FLAGS = (
    "should_training_stop",
    "should_epoch_stop",
    "should_save",
    "should_evaluate",
    "should_log",
    "should_abort_without_save",
)


@dataclass
class TrainerControl:
    """HF's five flags plus Forgather's ``should_abort_without_save``.

    A handler sets a flag; the adapter files the matching native request
    (stop, save, evaluate, log, abort) as soon as the handler returns. As in
    HF, the flags are cleared at defined points: ``should_training_stop`` at
    train begin, ``should_epoch_stop`` at epoch begin, the other three at each
    step begin, and each of save/evaluate/log once it has been done.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
    should_abort_without_save: bool = False

    def new_training(self) -> None:
        """Training begins: the stop flags are cleared."""
        self.should_training_stop = False
        self.should_abort_without_save = False

    def new_epoch(self) -> None:
        """An epoch begins: ``should_epoch_stop`` is cleared."""
        self.should_epoch_stop = False

    def new_step(self) -> None:
        """A step begins: the save, evaluate and log flags are cleared."""
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    # transformers' names for the three, for code that calls them
    _new_training, _new_epoch, _new_step = new_training, new_epoch, new_step

    def flags(self) -> tuple[bool, ...]:
        """The flags as a tuple, in ``CONTROL_FLAGS`` order."""
        return tuple(getattr(self, name) for name in CONTROL_FLAGS)

    def state(self) -> dict[str, Any]:
        """HF's ``ExportableState`` form: the flags are the constructor's arguments."""
        return {"args": {name: getattr(self, name) for name in _HF_FLAGS}, "attributes": {}}


_HF_FLAGS = CONTROL_FLAGS[:5]  # transformers' five (Forgather's abort is never saved set)
