"""Two config functions for the small byte-level GPT, each trains in seconds.

- ``small_gpt_pretrain_config()`` returns the native :class:`hookloop.Config`
  (the ``gpt-stdlib`` recipe, shrunk); keywords use Megatron-Bridge's names.
- ``tiny_gpt_pretrain_config()`` returns a Megatron-Bridge-shaped
  :class:`~hookloop.compat.megatron_bridge.training.config.ConfigContainer`
  (``cfg.train.train_iters``, ``cfg.optimizer.lr`` …), whose data is split
  train/valid/test by ``cfg.dataset.split`` (:func:`build_parts`).

>>> cfg = small_gpt_pretrain_config(train_iters=10, eval_interval=None)
>>> cfg.recipe, cfg.train.max_steps, cfg.train.eval_every
('gpt-stdlib', 10, None)
>>> tiny = tiny_gpt_pretrain_config(train_iters=6)
>>> tiny.train.train_iters, tiny.train.global_batch_size, tiny.checkpoint.save_interval
(6, 8, None)
"""

from __future__ import annotations

import torch

from hookloop.compat.megatron_bridge.training.config import ConfigContainer
from hookloop.config import Config, OptimizerConfig, SchedulerConfig, TrainConfig
from hookloop.recipes import RecipeParts
from hookloop.recipes import gpt as native_gpt
from hookloop.recipes.gpt import GPTConfig, TextDataConfig


def small_gpt_pretrain_config(
    *,
    train_iters: int = 4,
    micro_batch_size: int = 4,
    seq_length: int = 32,
    lr: float = 3e-3,
    eval_interval: int | None = 2,
    eval_iters: int = 2,
    save_interval: int | None = None,
    seed: int = 1234,
) -> Config:
    """A config for ``pretrain`` that runs in well under a second on a CPU.

    ``train_iters`` optimizer steps of ``micro_batch_size`` windows of
    ``seq_length`` bytes; every ``eval_interval`` steps (``None``: never) an
    evaluation over ``eval_iters`` batches; a checkpoint every ``save_interval``
    steps when ``pretrain`` is given an ``out_dir``.
    """
    for name, value in (
        ("train_iters", train_iters),
        ("micro_batch_size", micro_batch_size),
        ("seq_length", seq_length),
        ("eval_iters", eval_iters),
    ):
        _check_positive_int(name, value)
    for name, value in (("eval_interval", eval_interval), ("save_interval", save_interval)):
        if value is not None:
            _check_positive_int(name, value, allow_none=True)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    cfg = Config(
        recipe="gpt-stdlib",
        seed=seed,
        model=GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=seq_length),
        # 64 KiB of source: read in milliseconds, still far more windows than a few steps use.
        data=TextDataConfig(batch_size=micro_batch_size, max_bytes=65_536, eval_fraction=0.1),
        optimizer=OptimizerConfig(name="adamw", lr=float(lr), weight_decay=0.1),
        scheduler=SchedulerConfig(name="constant"),
        train=TrainConfig(
            max_steps=train_iters,
            log_every=0,
            eval_every=eval_interval,
            eval_max_batches=eval_iters,
            clip_grad_norm=1.0,
        ),
    )
    cfg.checkpoint.every = save_interval
    cfg.checkpoint.async_save = False  # Megatron-Bridge's default: on_checkpoint_save on time
    return cfg.validate()


def _check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def tiny_gpt_pretrain_config(
    *,
    train_iters: int = 4,
    global_batch_size: int = 8,
    micro_batch_size: int = 4,
    seq_length: int = 32,
    lr: float = 3e-3,
    eval_interval: int | None = 2,
    eval_iters: int = 2,
    save_interval: int | None = None,
    save: str | None = None,
    seed: int = 1234,
) -> ConfigContainer:
    """A Megatron-Bridge-shaped config container for ``pretrain``/``finetune`` (seconds on a CPU).

    Every keyword lands in its seed section (``train``, ``model``, ``optimizer``,
    ``checkpoint``, ``rng``); set any other field on the returned object.
    """
    cfg = ConfigContainer()
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size = global_batch_size
    cfg.train.micro_batch_size = micro_batch_size
    cfg.train.eval_interval = eval_interval
    cfg.train.eval_iters = eval_iters
    cfg.model.seq_length = seq_length
    cfg.optimizer.lr = lr
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        cfg.optimizer.min_lr = 0.1 * lr  # where a decay style ends (validate() checks lr)
    cfg.checkpoint.save = save
    cfg.checkpoint.save_interval = save_interval
    cfg.rng.seed = seed
    return cfg.validate()


def build_parts(cfg: ConfigContainer, native: Config) -> RecipeParts:
    """Model and the train/valid/test windows of ``cfg.dataset`` (the caller seeded RNGs).

    The corpus is cut into three consecutive stretches by ``dataset.split``, so
    no byte is in two splits; a split of weight 0 is absent (no test phase).
    """
    mcfg = native.model
    assert isinstance(mcfg, GPTConfig)
    corpus = native_gpt.load_corpus(cfg.dataset.source, cfg.dataset.max_bytes)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    fractions = cfg.split_weights()
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + round(fraction * data.numel()))
    bounds[-1] = data.numel()
    splits = []
    for name, fraction, start, end in zip(
        ("train", "valid", "test"), fractions, bounds, bounds[1:], strict=False
    ):
        if fraction == 0:
            splits.append(None)
            continue
        windows = native_gpt.ByteWindows(data[start:end].clone(), mcfg.block_size)
        if len(windows) == 0:
            raise ValueError(
                f"the {name} split ({end - start} bytes of dataset.split={cfg.dataset.split!r}) "
                f"is shorter than one window of model.seq_length={mcfg.block_size}; raise "
                "dataset.max_bytes or that split's weight"
            )
        splits.append(windows)
    model = native_gpt.GPT(mcfg)
    return RecipeParts(
        model=model,
        train_data=splits[0],
        eval_data=splits[1],
        test_data=splits[2],
        forward_step=native_gpt.forward_step,
        flops_per_sample=native_gpt.flops_per_sample(mcfg, model.num_params()),
    )
