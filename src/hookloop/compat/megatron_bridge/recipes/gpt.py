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

from pathlib import Path

import torch
from torch.utils.data import Dataset

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

    Every keyword lands in its Megatron-Bridge section (``train``, ``model``, ``optimizer``,
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
    When the corpus size is known without reading it (:func:`known_corpus_size`),
    the splits read it on first use, i.e. after ``on_data_init_start``, as
    Megatron-Bridge opens no dataset file before that event.
    """
    mcfg = native.model
    assert isinstance(mcfg, GPTConfig)
    corpus = Corpus(cfg.dataset.source, cfg.dataset.max_bytes)
    size = known_corpus_size(cfg.dataset.source, cfg.dataset.max_bytes)
    if size is None:
        size = corpus.read().numel()
    fractions = cfg.split_weights()
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + round(fraction * size))
    bounds[-1] = size
    splits: list[Dataset | None] = []
    for name, fraction, start, end in zip(
        ("train", "valid", "test"), fractions, bounds, bounds[1:], strict=False
    ):
        if fraction == 0:
            splits.append(None)
            continue
        windows = LazyByteWindows(corpus, start, end, mcfg.block_size)
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


def known_corpus_size(source: str, max_bytes: int) -> int | None:
    """The corpus's size in bytes when it is known without opening a file, else None.

    The standard library holds well over ``MIN_STDLIB_BYTES`` of source, so up to that
    many bytes are always read in full; a single file's size is on record. A directory
    may hold unreadable files, so its size is only known by reading it.
    """
    if source == "stdlib":
        return max_bytes if max_bytes <= native_gpt.MIN_STDLIB_BYTES else None
    path = Path(source).expanduser()
    if path.is_file():
        return min(path.stat().st_size, max_bytes)
    return None


class Corpus:
    """The run's bytes, read once, on first use, for all three splits."""

    def __init__(self, source: str, max_bytes: int) -> None:
        self.source, self.max_bytes = source, max_bytes
        self._data: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        if self._data is None:
            corpus = native_gpt.load_corpus(self.source, self.max_bytes)
            self._data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        return self._data


class LazyByteWindows(Dataset):
    """:class:`~hookloop.recipes.gpt.ByteWindows` of bytes ``[start, end)`` of a corpus
    that is read when the first window is asked for (its length is known before)."""

    def __init__(self, corpus: Corpus, start: int, end: int, block_size: int) -> None:
        self.corpus, self.start, self.end, self.block_size = corpus, start, end, block_size
        self._windows: native_gpt.ByteWindows | None = None

    def __len__(self) -> int:
        return max(0, (self.end - self.start - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._windows is None:
            data = self.corpus.read()
            if data.numel() < self.end:
                raise RuntimeError(
                    f"dataset.source {self.corpus.source!r} gave {data.numel()} bytes, fewer "
                    f"than the {self.end} its size promised; it changed while the run started"
                )
            chunk = data[self.start : self.end].clone()
            self._windows = native_gpt.ByteWindows(chunk, self.block_size)
        return self._windows[index]
