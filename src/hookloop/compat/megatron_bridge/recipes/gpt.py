"""``small_gpt_pretrain_config()``: the native ``gpt-stdlib`` recipe, shrunk to seconds.

It stands in for the seed's large-model config functions in examples and tests:
a two-layer byte-level GPT on a slice of Python's standard library, four steps
by default, evaluated every two. Keywords use the seed's names.

>>> cfg = small_gpt_pretrain_config(train_iters=10, eval_interval=None)
>>> cfg.recipe, cfg.train.max_steps, cfg.train.eval_every
('gpt-stdlib', 10, None)
"""

from __future__ import annotations

from hookloop.config import Config, OptimizerConfig, SchedulerConfig, TrainConfig
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
    return cfg.validate()


def _check_positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
