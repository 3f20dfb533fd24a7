"""transformers' ``TrainingArguments`` as a plain dataclass, for where transformers is
not installed, and the hookloop ``Config`` that runs either class.

Where transformers is installed, ``hookloop.compat.hf.TrainingArguments`` is transformers'
own class (:mod:`hookloop.compat.hf.training_args`); this one still names, in its fields'
help, which of transformers' fields the dialect refuses at any value but the default.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hookloop.compat.hf.types import eval_key, fraction_of

if TYPE_CHECKING:
    from hookloop.config import Config

_STRATEGIES = ("no", "steps", "epoch")


#: The ``--help`` of transformers' fields the dialect does not carry out (HfArgumentParser
#: hands a field's metadata to argparse, so the mark is its help text).
NOT_CARRIED_OUT = "transformers' field; hookloop.compat.hf refuses any value but its default"


def _theirs(default: Any) -> Any:
    """A transformers field this dialect does not carry out (refused unless at default)."""
    return field(default=default, metadata={"help": NOT_CARRIED_OUT})


@dataclass
class PlainTrainingArguments:
    """transformers' argument names as a plain dataclass (no device set-up, no accelerate).

    ``hookloop.compat.hf.TrainingArguments`` is this class where transformers is not
    installed; its fields marked :data:`NOT_CARRIED_OUT` are the ones the dialect refuses
    at any value but the default, whichever class carries them. The native Trainer's
    ``args`` for HF callbacks come from :meth:`from_config`. As in HF,
    ``greater_is_better`` defaults to "the metric is not a loss".

    >>> args = PlainTrainingArguments(metric_for_best_model="eval_loss")
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
    # hookloop.compat.hf.switches carries these out.
    eval_on_start: bool = False
    include_num_input_tokens_seen: str | bool = "no"
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict[str, Any] | None = None
    gradient_checkpointing: bool | None = None  # transformers' older name of the one above
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    auto_find_batch_size: bool = False
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
    torch_compile_backend: Any = _theirs(None)
    torch_compile_mode: Any = _theirs(None)
    use_liger_kernel: bool = _theirs(False)
    liger_kernel_config: Any = _theirs(None)
    torch_empty_cache_steps: Any = _theirs(None)
    log_on_each_node: bool = _theirs(True)
    log_level_replica: str = _theirs("warning")
    project: str = _theirs("huggingface")
    trackio_space_id: Any = _theirs(None)
    trackio_bucket_id: Any = _theirs(None)
    trackio_static_space_id: Any = _theirs(None)
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
        _resolve_old_names(self)
        for name in ("lr_scheduler_type", "optim", "train_sampling_strategy"):
            value = getattr(self, name)
            setattr(self, name, str(getattr(value, "value", value)))
        check_training_fields(self)
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
    ) -> PlainTrainingArguments:
        """What a hookloop ``Config`` means, under HF's names."""
        t, d, o, c = config.train, config.data, config.optimizer, config.checkpoint
        if d.batch_size == "auto":
            raise ValueError(
                "data.batch_size=auto is the native loop's; with transformers' arguments use "
                "auto_find_batch_size=True"
            )
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

    def to_config(self, base: Config | None = None) -> Config:
        """A hookloop ``Config`` (a copy of ``base``, or the defaults) that runs these args."""
        return config_for(self, base)


def _resolve_old_names(args: PlainTrainingArguments) -> None:
    """As transformers 5.x: ``gradient_checkpointing*`` stand for ``activation_checkpointing*``
    when those are unset, and then mirror them; ``include_num_input_tokens_seen`` True /
    False is ``"all"`` / ``"no"``."""
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))
    if args.activation_checkpointing is None:
        args.activation_checkpointing = args.gradient_checkpointing = False
    if isinstance(args.include_num_input_tokens_seen, bool):
        args.include_num_input_tokens_seen = "all" if args.include_num_input_tokens_seen else "no"


def check_training_fields(args: Any) -> None:
    """Refuse, by name, an optimizer, schedule, data or reporting field the dialect does
    not build (enums read as values; ``args`` is left as it is)."""
    from hookloop.compat.hf import accelerator as hf_accelerator
    from hookloop.compat.hf import data, optim, reporting

    optim_name = str(getattr(args.optim, "value", args.optim))
    sampling = getattr(args, "train_sampling_strategy", "random")
    sampling = str(getattr(sampling, "value", sampling))
    warmup_ratio = getattr(args, "warmup_ratio", 0.0)  # transformers 4.x's field

    if optim_name not in optim.OPTIMIZERS:
        raise ValueError(
            f"TrainingArguments.optim must be one of {', '.join(optim.OPTIMIZERS)}, "
            f"got {optim_name!r}"
        )
    if sampling not in data.SAMPLING:
        raise ValueError(
            "TrainingArguments.train_sampling_strategy must be one of "
            f"{', '.join(data.SAMPLING)}, got {sampling!r}"
        )
    if not (isinstance(args.warmup_steps, (int, float)) and args.warmup_steps >= 0):
        raise ValueError(
            "TrainingArguments.warmup_steps must be a number >= 0 (below 1: a fraction "
            f"of the run), got {args.warmup_steps!r}"
        )
    if not (isinstance(warmup_ratio, (int, float)) and 0 <= warmup_ratio < 1):
        raise ValueError(f"TrainingArguments.warmup_ratio must lie in [0, 1), got {warmup_ratio!r}")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        if not (isinstance(value, (int, float)) and 0 <= value < 1):
            raise ValueError(f"TrainingArguments.{name} must lie in [0, 1), got {value!r}")
    if not (isinstance(args.adam_epsilon, (int, float)) and args.adam_epsilon > 0):
        raise ValueError(f"TrainingArguments.adam_epsilon must be > 0, got {args.adam_epsilon!r}")
    workers = args.dataloader_num_workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(
            f"TrainingArguments.dataloader_num_workers must be an int >= 0, got {workers!r}"
        )
    if args.lr_scheduler_kwargs is not None and not isinstance(args.lr_scheduler_kwargs, dict):
        raise ValueError(
            "TrainingArguments.lr_scheduler_kwargs must be a dict or None, "
            f"got {args.lr_scheduler_kwargs!r}"
        )
    reporting.normalize(args.report_to)  # raises for a name hookloop cannot report to
    hf_accelerator.settings(args.accelerator_config)  # refused here, as transformers does


def _steps(args: Any, steps: float) -> int:
    """An interval in steps: below 1, a fraction of ``max_steps`` (HF's rule); with an
    epoch budget the fraction's steps are known only from the data, so 1 stands in
    here and the dialect's flow, which knows the budget, decides."""
    if 0 < steps < 1:
        return fraction_of(steps, args.max_steps) if args.max_steps > 0 else 1
    return int(steps)


def config_for(args: Any, base: Config | None = None) -> Config:
    """A hookloop ``Config`` (a copy of ``base``, or the defaults) that runs ``args``: a
    dialect ``TrainingArguments`` or transformers' (strategies compare as strings)."""
    from hookloop.config import Config

    config = copy.deepcopy(base) if base is not None else Config()
    t, d, o, c = config.train, config.data, config.optimizer, config.checkpoint
    d.batch_size = args.per_device_train_batch_size
    d.eval_batch_size = args.per_device_eval_batch_size
    t.grad_accum = args.gradient_accumulation_steps
    o.lr = args.learning_rate
    o.weight_decay = args.weight_decay
    t.clip_grad_norm = args.max_grad_norm or None
    if args.max_steps > 0:
        t.max_steps, t.max_epochs = args.max_steps, None
    else:
        t.max_steps, t.max_epochs = None, max(1, round(args.num_train_epochs))
    t.log_every = _steps(args, args.logging_steps) if args.logging_strategy == "steps" else 0
    t.eval_every = _steps(args, args.eval_steps) if args.eval_strategy == "steps" else None
    t.eval_at_epoch_end = args.eval_strategy == "epoch"
    c.every = _steps(args, args.save_steps) if args.save_strategy == "steps" else None
    c.keep_last = args.save_total_limit
    if args.metric_for_best_model is not None:
        c.monitor = eval_key(args.metric_for_best_model)
        c.mode = "max" if args.greater_is_better else "min"
    config.seed = args.seed
    t.compile = bool(args.torch_compile)
    t.precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    if args.use_cpu:
        t.device = "cpu"
    return config.validate()
