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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hookloop import config as hc
from hookloop.recipes.gpt import GPTConfig, TextDataConfig


@dataclass
class TrainingConfig:
    """Steps, batch sizes, evaluation cadence and exit conditions."""

    train_iters: int = 4
    global_batch_size: int = 8
    micro_batch_size: int = 4
    eval_interval: int | None = 2
    eval_iters: int = 2
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    #: Steps whose data is read and dropped, not trained on (``training.train.train`` only).
    iterations_to_skip: list[int] = field(default_factory=list)


@dataclass
class GPTModelConfig:
    """The byte-level GPT's shape (vocabulary fixed at 256 bytes)."""

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 2
    seq_length: int = 32
    hidden_dropout: float = 0.0


@dataclass
class OptimizerConfig:
    """``optimizer`` is ``"adam"`` (decoupled weight decay, as Megatron's) or ``"sgd"``."""

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
class SchedulerConfig:
    """``lr_decay_style``: ``"constant"``, ``"cosine"`` or ``"linear"`` (to ``min_lr``)."""

    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0


@dataclass
class CheckpointConfig:
    """``save``: the run directory (checkpoints under it); ``load``: resume from there.

    ``async_save``: write in the background (``on_checkpoint_save`` then fires once the
    write is done, a step or two later); off by default, as in Megatron-Bridge.
    """

    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    pretrained_checkpoint: str | None = None
    async_save: bool = False


@dataclass
class LoggerConfig:
    """Log cadence and the writers ``GlobalState`` opens (last rank only, lazily).

    ``log_progress``: append Megatron-Bridge's ``progress.txt`` lines to
    ``<checkpoint.save>/progress.txt`` (job start, each save with its throughput).
    """

    log_interval: int = 1
    log_progress: bool = False
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str = ""
    wandb_save_dir: str | None = None


@dataclass
class DatasetConfig:
    """Byte windows of ``source`` text, split ``"train,valid,test"`` by weight."""

    source: str = "stdlib"
    max_bytes: int = 65_536
    split: str = "90,5,5"


@dataclass
class RNGConfig:
    seed: int = 1234


@dataclass
class ConfigContainer:
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
        """Check every field; raises ``ValueError`` naming the field and what is allowed."""
        t, m, o, s = self.train, self.model, self.optimizer, self.scheduler
        for where, name in (
            ("train", "train_iters"),
            ("train", "global_batch_size"),
            ("train", "micro_batch_size"),
            ("train", "eval_iters"),
            ("model", "num_layers"),
            ("model", "hidden_size"),
            ("model", "num_attention_heads"),
            ("model", "seq_length"),
            ("logger", "log_interval"),
            ("dataset", "max_bytes"),
        ):
            _int_at_least(getattr(self, where), name, where, 1)
        for where, name in (
            ("train", "eval_interval"),
            ("train", "exit_interval"),
            ("checkpoint", "save_interval"),
        ):
            if getattr(getattr(self, where), name) is not None:
                _int_at_least(getattr(self, where), name, where, 1, none_ok=True)
        _int_at_least(s, "lr_warmup_iters", "scheduler", 0)
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
        if s.lr_decay_style not in ("constant", "cosine", "linear"):
            raise ValueError(
                "scheduler.lr_decay_style must be 'constant', 'cosine' or 'linear', "
                f"got {s.lr_decay_style!r}"
            )
        minutes = t.exit_duration_in_mins
        if minutes is not None and (not _number(minutes) or not minutes > 0):
            raise ValueError(f"train.exit_duration_in_mins must be > 0 or None, got {minutes!r}")
        ck = self.checkpoint
        if ck.load is not None and ck.save is not None and ck.load != ck.save:
            raise ValueError(
                f"checkpoint.load ({ck.load!r}) differs from checkpoint.save ({ck.save!r}): "
                "hookloop resumes a run in its own directory; set load to save (or leave it "
                "None), or use checkpoint.pretrained_checkpoint to start from other weights"
            )
        if not isinstance(ck.async_save, bool):
            raise ValueError(f"checkpoint.async_save must be True or False, got {ck.async_save!r}")
        if not isinstance(self.logger.log_progress, bool):
            raise ValueError(
                f"logger.log_progress must be True or False, got {self.logger.log_progress!r}"
            )
        if self.logger.wandb_project is not None and not self.logger.wandb_project:
            raise ValueError("logger.wandb_project must be a non-empty name or None")
        self.split_weights()
        return self

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
        if self.train.iterations_to_skip:
            raise ValueError(
                "train.iterations_to_skip is honoured by training.train.train(); pretrain() and "
                "finetune() run hookloop's loop, which trains every step: leave it empty there"
            )
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
                warmup_steps=s.lr_warmup_iters,
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
