"""``ConfigContainer``: a run's configuration in Megatron-Bridge's shape, sections and names.

Megatron-Bridge code reads and sets ``cfg.train.train_iters``, ``cfg.train.global_batch_size``,
``cfg.optimizer.lr``, ``cfg.checkpoint.save_interval`` …; this container has
those sections and fields (a subset of Megatron-Bridge's, for the small byte-level
GPT hookloop trains) and :meth:`ConfigContainer.to_native` turns it into the
:class:`hookloop.Config` the loop runs. The entry points accept either.

>>> cfg = ConfigContainer()
>>> cfg.train.train_iters = 10
>>> native = cfg.to_native(world_size=1)
>>> native.train.max_steps, native.train.grad_accum
(10, 2)

Megatron-Bridge's sample-based settings convert to iterations as there:
``train.train_samples`` gives ``train_iters = train_samples // global_batch_size``.
A field Megatron-Bridge has and the dialect does not is refused by name:

>>> cfg.train.rampup_batch_size = [16, 8, 300]  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
AttributeError: train.rampup_batch_size is a Megatron-Bridge setting the dialect does not ...
"""

from __future__ import annotations

import dataclasses
import difflib
import signal
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hookloop import config as hc
from hookloop.recipes.gpt import GPTConfig, TextDataConfig


class Section:
    """A config section whose fields are fixed: setting any other name is refused by name."""

    section: ClassVar[str] = ""

    def __setattr__(self, name: str, value: Any) -> None:
        names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
            hint = f". Did you mean {close[0]!r}?" if close else ""
            where = f"{self.section}.{name}" if self.section else name
            raise AttributeError(
                f"{where} is a Megatron-Bridge setting the dialect does not reproduce "
                "(Megatron-Core or a feature of its own drives it); the "
                f"{self.section or 'ConfigContainer'} section has: {', '.join(names)}{hint}"
            )
        object.__setattr__(self, name, value)


@dataclass
class TrainingConfig(Section):
    """Steps (``train_iters``, or ``train_samples`` over the global batch), batch sizes,
    evaluation cadence and exit conditions.

    ``exit_signal_handler``: ``training.train`` catches ``exit_signal`` (SIGTERM), then
    saves (with ``checkpoint.save``) and exits after the step, as Megatron-Bridge.
    """

    section: ClassVar[str] = "train"
    train_iters: int | None = 4
    train_samples: int | None = None
    global_batch_size: int = 8
    micro_batch_size: int = 4
    eval_interval: int | None = 2
    eval_iters: int = 2
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    exit_signal: int = int(signal.SIGTERM)
    #: ``training.train``: the automatic garbage collector off, a collection every
    #: ``manual_gc_interval`` steps (0: none) and around each validation (``manual_gc_eval``).
    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    #: ``training.train``: a CUDA synchronisation every this many steps (None: none).
    train_sync_interval: int | None = None
    #: Steps whose data is read and dropped, not trained on (``training.train.train`` only).
    iterations_to_skip: list[int] = field(default_factory=list)


@dataclass
class GPTModelConfig(Section):
    """The byte-level GPT's shape (vocabulary fixed at 256 bytes)."""

    section: ClassVar[str] = "model"
    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 2
    seq_length: int = 32
    hidden_dropout: float = 0.0


@dataclass
class OptimizerConfig(Section):
    """``optimizer`` is ``"adam"`` (decoupled weight decay, as Megatron's) or ``"sgd"``."""

    section: ClassVar[str] = "optimizer"
    optimizer: str = "adam"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0


@dataclass
class SchedulerConfig(Section):
    """``lr_decay_style``: ``"constant"``, ``"cosine"`` or ``"linear"`` (to ``min_lr``).

    As in Megatron-Bridge the decay runs over ``lr_decay_iters`` (default: the run's
    steps) and the warm-up over ``lr_warmup_iters`` steps or ``lr_warmup_fraction`` of
    the decay; a ``train.train_samples`` run gives them in samples instead
    (``lr_decay_samples``, ``lr_warmup_samples``), divided by the global batch size.
    The warm-up starts from 0 (``lr_warmup_init`` must stay 0.0).
    """

    section: ClassVar[str] = "scheduler"
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    lr_warmup_fraction: float | None = None
    lr_decay_samples: int | None = None
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0


@dataclass
class CheckpointConfig(Section):
    """``save``: the run directory (checkpoints under it); ``load``: resume from there.

    ``async_save``: write in the background (``on_checkpoint_save`` then fires once the
    write is done, a step or two later); off by default, as in Megatron-Bridge.
    """

    section: ClassVar[str] = "checkpoint"
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    pretrained_checkpoint: str | None = None
    async_save: bool = False


@dataclass
class LoggerConfig(Section):
    """Log cadence and the writers ``GlobalState`` opens (last rank only, lazily).

    ``log_validation_ppl_to_tensorboard``: also write each validation's perplexity.
    ``log_progress``: append Megatron-Bridge's ``progress.txt`` lines to
    ``<checkpoint.save>/progress.txt`` (job start, each save with its throughput).
    """

    section: ClassVar[str] = "logger"
    log_interval: int = 1
    log_progress: bool = False
    tensorboard_dir: str | None = None
    tensorboard_queue_size: int = 1000
    log_validation_ppl_to_tensorboard: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str = ""
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None


@dataclass
class DatasetConfig(Section):
    """Byte windows of ``source`` text, split ``"train,valid,test"`` by weight."""

    section: ClassVar[str] = "dataset"
    source: str = "stdlib"
    max_bytes: int = 65_536
    split: str = "90,5,5"


@dataclass
class RNGConfig(Section):
    section: ClassVar[str] = "rng"
    seed: int = 1234


@dataclass
class ConfigContainer(Section):
    """Every section of a run, under Megatron-Bridge's names."""

    train: TrainingConfig = field(default_factory=TrainingConfig)
    model: GPTModelConfig = field(default_factory=GPTModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def split_weights(self) -> tuple[float, float, float]:
        """``dataset.split`` as fractions ``(train, valid, test)`` summing to 1."""
        parts = self.dataset.split.split(",") if isinstance(self.dataset.split, str) else []
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if len(weights) != 3 or any(w < 0 for w in weights) or weights[0] <= 0:
            raise ValueError(
                "dataset.split must be three comma-separated weights 'train,valid,test' "
                f"(train > 0, none negative), e.g. '90,5,5'; got {self.dataset.split!r}"
            )
        total = sum(weights)
        return weights[0] / total, weights[1] / total, weights[2] / total

    def validate(self, world_size: int = 1) -> ConfigContainer:
        """Check every field; raises ``ValueError`` naming the field and what is allowed.

        A ``train.train_samples`` run gets its ``train.train_iters`` here, as in
        Megatron-Bridge.
        """
        self._check_counts()
        self._check_iterations()
        self._check_schedule()
        t = self.train
        skip = t.iterations_to_skip
        if not isinstance(skip, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in skip
        ):
            raise ValueError(
                f"train.iterations_to_skip must be a list of step numbers (ints >= 0), got {skip!r}"
            )
        _int_at_least(self.rng, "seed", "rng", 0)
        per_step = t.micro_batch_size * world_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size x data-parallel ranks ({t.micro_batch_size} x "
                f"{world_size} = {per_step})"
            )
        self._check_model_and_optimizer()
        self._check_exits_and_outputs()
        self.split_weights()
        return self

    def _check_counts(self) -> None:
        """The sizes, counts and intervals: ints of at least 1 (some may be None or 0)."""
        t = self.train
        for where, name in (
            ("train", "global_batch_size"),
            ("train", "micro_batch_size"),
            ("train", "eval_iters"),
            ("model", "num_layers"),
            ("model", "hidden_size"),
            ("model", "num_attention_heads"),
            ("model", "seq_length"),
            ("logger", "log_interval"),
            ("logger", "tensorboard_queue_size"),
            ("dataset", "max_bytes"),
        ):
            _int_at_least(getattr(self, where), name, where, 1)
        _int_at_least(t, "manual_gc_interval", "train", 0)
        for where, name in (
            ("train", "eval_interval"),
            ("train", "exit_interval"),
            ("train", "train_sync_interval"),
            ("checkpoint", "save_interval"),
        ):
            if getattr(getattr(self, where), name) is not None:
                _int_at_least(getattr(self, where), name, where, 1, none_ok=True)

    def _check_model_and_optimizer(self) -> None:
        """The model's shape and dropout; the optimizer's kind, rates and clipping."""
        m, o = self.model, self.optimizer
        if m.hidden_size % m.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({m.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({m.num_attention_heads})"
            )
        if not _number(m.hidden_dropout) or not 0 <= m.hidden_dropout < 1:
            raise ValueError(f"model.hidden_dropout must lie in [0, 1), got {m.hidden_dropout!r}")
        if o.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer.optimizer must be 'adam' or 'sgd', got {o.optimizer!r}")
        if not _number(o.lr) or not o.lr > 0:
            raise ValueError(f"optimizer.lr must be a number > 0, got {o.lr!r}")
        if not _number(o.min_lr) or not 0 <= o.min_lr <= o.lr:
            raise ValueError(f"optimizer.min_lr must lie in [0, optimizer.lr], got {o.min_lr!r}")
        if not _number(o.clip_grad) or o.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad must be >= 0 (0: off), got {o.clip_grad!r}")

    def _check_iterations(self) -> None:
        """``train_iters`` or ``train_samples`` (then ``train_iters`` from it), not both."""
        t = self.train
        if t.train_samples is None:
            _int_at_least(t, "train_iters", "train", 1)
            return
        _int_at_least(t, "train_samples", "train", 1, none_ok=True)
        iterations = t.train_samples // t.global_batch_size
        if iterations < 1:
            raise ValueError(
                f"train.train_samples ({t.train_samples}) must be at least one "
                f"train.global_batch_size ({t.global_batch_size})"
            )
        if t.train_iters is not None and t.train_iters != iterations:
            raise ValueError(
                f"set train.train_iters ({t.train_iters}) or train.train_samples "
                f"({t.train_samples}), not both (set the other to None)"
            )
        t.train_iters = iterations

    def _check_schedule(self) -> None:
        """The scheduler's fields: one unit (iterations or samples) and one warm-up kind."""
        s = self.scheduler
        if s.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(
                "scheduler.lr_decay_style must be 'constant', 'cosine' or 'linear', "
                f"got {s.lr_decay_style!r}"
            )
        _int_at_least(s, "lr_warmup_iters", "scheduler", 0)
        _int_at_least(s, "lr_warmup_samples", "scheduler", 0)
        for name in ("lr_decay_iters", "lr_decay_samples"):
            if getattr(s, name) is not None:
                _int_at_least(s, name, "scheduler", 1, none_ok=True)
        by_samples = self.train.train_samples is not None
        other = ("lr_decay_iters", "lr_warmup_iters") if by_samples else ("lr_decay_samples",)
        other += () if by_samples else ("lr_warmup_samples",)
        for name in other:
            if getattr(s, name) not in (None, 0):
                unit, kind = (
                    ("train.train_samples", "samples")
                    if by_samples
                    else ("train.train_iters", "iters")
                )
                raise ValueError(
                    f"scheduler.{name} does not fit a run counted by {unit}: give the schedule "
                    f"as scheduler.lr_decay_{kind} / lr_warmup_{kind} (or lr_warmup_fraction)"
                )
        fraction = s.lr_warmup_fraction
        if fraction is not None:
            if not _number(fraction) or not 0 <= fraction <= 1:
                raise ValueError(
                    f"scheduler.lr_warmup_fraction must lie in [0, 1] or be None, got {fraction!r}"
                )
            if s.lr_warmup_iters or s.lr_warmup_samples:
                raise ValueError(
                    "set one of scheduler.lr_warmup_fraction, lr_warmup_iters and "
                    "lr_warmup_samples, not several"
                )
        if s.lr_warmup_init != 0.0:
            raise ValueError(
                f"scheduler.lr_warmup_init must be 0.0 (hookloop's warm-up starts from 0), got "
                f"{s.lr_warmup_init!r}"
            )

    def schedule_iterations(self) -> tuple[int, int]:
        """``(warm-up, decay)`` in iterations, from the scheduler's fields (after validate)."""
        s, t = self.scheduler, self.train
        if t.train_samples is not None:
            decay = (s.lr_decay_samples or t.train_samples) / t.global_batch_size
            warmup = s.lr_warmup_samples / t.global_batch_size
        else:
            decay = s.lr_decay_iters or t.train_iters
            warmup = s.lr_warmup_iters
        if s.lr_warmup_fraction is not None:
            warmup = s.lr_warmup_fraction * decay
        return round(warmup), max(1, round(decay))

    def _check_exits_and_outputs(self) -> None:
        t, ck, lg = self.train, self.checkpoint, self.logger
        minutes = t.exit_duration_in_mins
        if minutes is not None and (not _number(minutes) or not minutes > 0):
            raise ValueError(f"train.exit_duration_in_mins must be > 0 or None, got {minutes!r}")
        if ck.load is not None and ck.save is not None and ck.load != ck.save:
            raise ValueError(
                f"checkpoint.load ({ck.load!r}) differs from checkpoint.save ({ck.save!r}): "
                "hookloop resumes a run in its own directory; set load to save (or leave it "
                "None), or use checkpoint.pretrained_checkpoint to start from other weights"
            )
        for where, section, name in (
            ("checkpoint", ck, "async_save"),
            ("logger", lg, "log_progress"),
            ("logger", lg, "log_validation_ppl_to_tensorboard"),
            ("train", t, "exit_signal_handler"),
            ("train", t, "manual_gc"),
            ("train", t, "manual_gc_eval"),
        ):
            if not isinstance(getattr(section, name), bool):
                raise ValueError(
                    f"{where}.{name} must be True or False, got {getattr(section, name)!r}"
                )
        valid_signals = {int(s) for s in signal.valid_signals()}
        if isinstance(t.exit_signal, bool) or t.exit_signal not in valid_signals:
            raise ValueError(
                f"train.exit_signal must be a signal number (e.g. signal.SIGTERM), "
                f"got {t.exit_signal!r}"
            )
        t.exit_signal = int(t.exit_signal)  # a plain int in the saved config (not signal.Signals)
        if lg.wandb_project is not None and not lg.wandb_project:
            raise ValueError("logger.wandb_project must be a non-empty name or None")

    def gpt_config(self) -> GPTConfig:
        """The byte-level GPT that ``model`` describes."""
        m = self.model
        return GPTConfig(
            n_layer=m.num_layers,
            n_head=m.num_attention_heads,
            n_embd=m.hidden_size,
            block_size=m.seq_length,
            dropout=float(m.hidden_dropout),
        )

    def to_native(self, world_size: int = 1) -> hc.Config:
        """The :class:`hookloop.Config` that runs this container on ``world_size`` ranks."""
        self.validate(world_size)
        t, o, s = self.train, self.optimizer, self.scheduler
        native = hc.Config(
            recipe="gpt-stdlib",
            seed=self.rng.seed,
            model=self.gpt_config(),
            data=TextDataConfig(
                source=self.dataset.source,
                batch_size=t.micro_batch_size,
                max_bytes=self.dataset.max_bytes,
            ),
            optimizer=hc.OptimizerConfig(
                name="adamw" if o.optimizer == "adam" else "sgd",
                lr=float(o.lr),
                weight_decay=float(o.weight_decay),
                betas=(float(o.adam_beta1), float(o.adam_beta2)),
                eps=float(o.adam_eps),
                momentum=float(o.sgd_momentum) if o.optimizer == "sgd" else 0.0,
            ),
            scheduler=hc.SchedulerConfig(
                name=s.lr_decay_style,  # type: ignore[arg-type]
                warmup_steps=self.schedule_iterations()[0],
                min_lr_ratio=float(o.min_lr) / float(o.lr),
            ),
            train=hc.TrainConfig(
                max_steps=t.train_iters,
                grad_accum=t.global_batch_size // (t.micro_batch_size * world_size),
                clip_grad_norm=float(o.clip_grad) or None,
                log_every=self.logger.log_interval,
                eval_every=t.eval_interval,
                eval_max_batches=t.eval_iters,
                exit_interval=t.exit_interval,
                exit_duration_minutes=t.exit_duration_in_mins,
                # Megatron counts the steps done before a step; hookloop numbers it from 1
                iterations_to_skip=[index + 1 for index in t.iterations_to_skip],
            ),
            checkpoint=hc.CheckpointConfig(
                every=self.checkpoint.save_interval,
                pretrained=self.checkpoint.pretrained_checkpoint,
                async_save=self.checkpoint.async_save,
            ),
            logging=hc.LoggingConfig(tensorboard=False, wandb=False),
        )
        return native.validate()


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(section: Any, name: str, where: str, low: int, *, none_ok: bool = False) -> None:
    value = getattr(section, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = f"an int >= {low}" + (" or None" if none_ok else "")
        raise ValueError(f"{where}.{name} must be {allowed}, got {value!r}")
