"""The default recipe ``gpt-stdlib``: a small byte-level GPT trained on Python's own stdlib.

Everything it needs is already on the machine: the corpus is the standard
library's ``*.py`` files, read at run time from ``sysconfig.get_paths()["stdlib"]``,
and the vocabulary is the 256 byte values, so there is no tokenizer to fetch.
The defaults are sized so that ``hookloop train`` finishes in about two minutes
on a 2-core CPU with the loss clearly falling, which makes it a quick end-to-end
check of the training loop as well as a demo.

Public pieces, usable on their own:

- :class:`GPTConfig`, :class:`TextDataConfig`: the recipe's ``model`` / ``data`` sections;
- :func:`encode` / :func:`decode`: the byte-level codec;
- :func:`load_corpus`, :class:`ByteWindows`, :func:`split_corpus`: the data;
- :class:`GPT`, :func:`generate`, :func:`flops_per_token`, :func:`flops_per_sample`: the model;
- :func:`lm_step`: hookloop's per-micro-batch protocol (``(output, loss_func)``), logging
  the loss once, as ``loss``; :func:`forward_step`: the same in Megatron's shape, its loss
  also named ``lm loss`` (the Megatron-Bridge dialect's);
- :func:`build`, :func:`default_config`: what the recipe registry calls.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hookloop.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
    opt,
)
from hookloop.errors import ConfigError
from hookloop.recipes import Recipe, RecipeParts, register_recipe

#: Byte-level vocabulary: every byte value is a token, so any text can be encoded.
VOCAB_SIZE = 256

#: Below this much stdlib source the corpus is too small to be a meaningful default job.
MIN_STDLIB_BYTES = 200_000

#: Directories never read when walking a source tree (third-party code, caches).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

#: Also skipped in the stdlib: generated tables (codec maps, pydoc topics) and the test
#: suites (half the tree, full of deliberately odd files). Without them the corpus is
#: ordinary library code throughout, so the held-out tail resembles the training head.
_STDLIB_SKIP_DIRS = _SKIP_DIRS | {"encodings", "pydoc_data", "test", "tests"}


# -- configuration -----------------------------------------------------------


@dataclass
class GPTConfig(ModelConfig):
    """Shape of the byte-level GPT (vocabulary fixed at 256 bytes)."""

    n_layer: int = opt(4, "Transformer blocks.")
    n_head: int = opt(4, "Attention heads per block (must divide n_embd).")
    n_embd: int = opt(128, "Width of the residual stream.")
    block_size: int = opt(128, "Context length in bytes (also the training window).")
    dropout: float = opt(0.0, "Dropout on embeddings, attention and MLP outputs.")
    bias: bool = opt(True, "Use biases in Linear and LayerNorm layers.")

    def validate(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd must be divisible by model.n_head, "
                f"got n_embd={self.n_embd} and n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must lie in [0, 1), got {self.dropout!r}")


@dataclass
class TextDataConfig(DataConfig):
    """Where the text comes from and how much of it is held out for evaluation."""

    source: str = opt(
        "stdlib", "'stdlib' (this Python's standard library), a directory of .py files or a file."
    )
    max_bytes: int = opt(4_000_000, "Cap on the corpus size in bytes (read in sorted path order).")
    eval_fraction: float = opt(0.05, "Fraction of the corpus (its tail) held out for evaluation.")

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConfigError(
                "data.source must be 'stdlib' or a path to a directory or file, "
                f"got {self.source!r}"
            )
        if self.source != "stdlib" and not Path(self.source).expanduser().exists():
            raise ConfigError(
                f"data.source {self.source!r} does not exist; give 'stdlib', a directory of .py "
                "files or a text file"
            )
        mb = self.max_bytes
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ConfigError(f"data.max_bytes must be an int >= 1, got {mb!r}")
        ef = self.eval_fraction
        if isinstance(ef, bool) or not isinstance(ef, (int, float)) or not 0.0 < ef <= 0.5:
            raise ConfigError(f"data.eval_fraction must lie in (0, 0.5], got {ef!r}")


# -- byte-level codec -----------------------------------------------------------


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a uint8 tensor (one token per byte; nothing is unknown)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Text from byte ids; invalid UTF-8 (e.g. a sampled half character) becomes U+FFFD."""
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# -- corpus -------------------------------------------------------------------


def _sorted_files(root: Path, suffix: str, skip: frozenset[str] = _SKIP_DIRS) -> Iterator[Path]:
    """Files under ``root`` ending in ``suffix``, in sorted path order, lazily.

    Lazy so that a capped corpus stops reading early; sorted so that the same
    tree always gives the same corpus. Unlistable directories are skipped.
    """
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.name in skip or entry.name.startswith("."):
                    continue
                yield from _sorted_files(Path(entry.path), suffix, skip)
            elif entry.name.endswith(suffix) and entry.is_file():
                yield Path(entry.path)
        except OSError:
            continue


def _read_tree(root: Path, max_bytes: int, skip: frozenset[str] = _SKIP_DIRS) -> bytes:
    chunks: list[bytes] = []
    total = 0
    for path in _sorted_files(root, ".py", skip):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable (permissions, vanished): the rest of the tree still serves
        if not data:
            continue
        if not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_corpus(source: str, max_bytes: int) -> bytes:
    """Read up to ``max_bytes`` of text from ``source``, deterministically.

    ``source`` is ``"stdlib"`` (every ``*.py`` under this interpreter's stdlib
    directory, ``site-packages`` excluded), a directory (its ``*.py`` files,
    recursively) or a single file. Files are concatenated in sorted path order,
    so a given tree always yields the same bytes and the same train/eval split.
    """
    if max_bytes < 1:
        raise ConfigError(f"data.max_bytes must be >= 1, got {max_bytes!r}")
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        corpus = _read_tree(root, max_bytes, _STDLIB_SKIP_DIRS)
        if len(corpus) < min(MIN_STDLIB_BYTES, max_bytes):
            raise RuntimeError(
                f"found only {len(corpus):,} bytes of Python source under the standard library "
                f"directory {str(root)!r} (need at least {MIN_STDLIB_BYTES:,}); this interpreter "
                "may ship without its .py files. Point the recipe at other text with "
                "data.source=PATH (a directory of .py files or a text file)."
            )
        return corpus
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data.source {source!r} does not exist; give 'stdlib', a directory of .py files "
            "or a text file"
        )
    if path.is_dir():
        corpus = _read_tree(path, max_bytes)
        if not corpus:
            raise RuntimeError(f"data.source {source!r} holds no readable, non-empty .py files")
        return corpus
    with path.open("rb") as fh:
        corpus = fh.read(max_bytes)
    if not corpus:
        raise RuntimeError(f"data.source {source!r} is empty")
    return corpus


class ByteWindows(Dataset):
    """Non-overlapping ``block_size`` windows of a byte sequence, for next-byte prediction.

    Item ``i`` is ``(x, y)``, two LongTensors of length ``block_size`` with
    ``y[t] == x[t + 1]`` in the underlying text: window ``i`` reads bytes
    ``[i * block_size, (i + 1) * block_size]`` (one byte of look-ahead for the
    last target). Map-style, so the trainer's resumable sampler can index it.
    """

    def __init__(self, data: torch.Tensor | bytes, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size!r}")
        if isinstance(data, (bytes, bytearray)):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.data = data.flatten()
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (self.data.numel() - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def split_corpus(
    corpus: bytes, block_size: int, eval_fraction: float
) -> tuple[ByteWindows, ByteWindows]:
    """Train windows from the head of the corpus, eval windows from its tail (no shared bytes)."""
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    cut = int(data.numel() * (1.0 - eval_fraction))
    # Copies, so each split owns just its bytes (cheap to pickle for DataLoader workers).
    train = ByteWindows(data[:cut].clone(), block_size)
    held_out = ByteWindows(data[cut:].clone(), block_size)
    for name, ds in (("train", train), ("eval", held_out)):
        if len(ds) == 0:
            raise ConfigError(
                f"the {name} split of a {len(corpus):,}-byte corpus is shorter than one window "
                f"of model.block_size={block_size}; raise data.max_bytes, data.eval_fraction or "
                "use a larger data.source"
            )
    return train, held_out


# -- model --------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees only positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, heads, T, head_dim) tensors
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over bytes; ``forward(idx)`` gives logits ``(B, T, 256)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.tok_emb = nn.Embedding(VOCAB_SIZE, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, VOCAB_SIZE, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: input and output share byte vectors
        self._init_weights()

    def _init_weights(self) -> None:
        # Small normal weights keep the first logits near uniform (loss ~ ln 256). The
        # projections that write into the residual stream are scaled down by
        # sqrt(2 * n_layer) so the stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=resid_std)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, tied weights once; optionally without the position table."""
        n = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates
        if exclude_embeddings:
            n -= self.pos_emb.weight.numel()
        return n

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds model.block_size={self.config.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (shared/tied tensors counted once)."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """Training FLOPs (forward + backward) per token of a full ``block_size`` window.

    ``6 * N + 12 * L * T * d``: each parameter costs a multiply-add in the
    forward pass and two in the backward (6 FLOPs per token), and the attention
    score and value products (``QK^T`` and ``AV``, 2·T·d FLOPs a token each
    forward, x3 with backward) add ``12 * L * T * d``, counted for the full
    T x T matrix as is conventional (the causal mask's saving is ignored). ``N``
    is the model's parameter count; the tied token table stands in for the
    LM-head matmul.
    """
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 1:
        raise ValueError(f"n_params must be an int >= 1, got {n_params!r}")
    return float(6 * n_params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd)


def flops_per_sample(cfg: GPTConfig, n_params: int) -> float:
    """Training FLOPs for one sequence of ``block_size`` tokens: ``block_size`` x
    :func:`flops_per_token`, i.e. ``6 * N * T + 12 * L * T**2 * d``."""
    return cfg.block_size * flops_per_token(cfg, n_params)


# -- hookloop protocol ----------------------------------------------------------


def _lm_loss(
    logits: torch.Tensor, targets: torch.Tensor, name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, num_tokens, {name: mean})``; no entry without a ``name``."""
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    # A fill kernel, not torch.tensor(n, device=...): that copies from host memory and
    # synchronises the device on every micro-batch.
    num_tokens = torch.full((), targets.numel(), dtype=torch.int64, device=targets.device)
    if name is None:
        return loss_sum, num_tokens, {}
    return loss_sum, num_tokens, {name: loss_sum.detach() / num_tokens}


def lm_step(
    state: Any, data_iterator: Iterator[Any], model: nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]]:
    """The recipe's step: run one micro-batch; return ``(logits, loss_func)``.

    ``loss_func(logits)`` gives ``(loss_sum, num_tokens, {})``: the *summed* cross
    entropy, so the trainer can divide by the token count of the whole step (all
    micro-batches) and get an exact per-token mean, logged once, as ``loss``.
    """
    return _step(data_iterator, model, None)


def forward_step(
    state: Any, data_iterator: Iterator[Any], model: nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]]:
    """:func:`lm_step` in Megatron's shape: ``loss_func(logits)`` gives
    ``(loss_sum, num_tokens, {"lm loss": mean})``, the name Megatron-Bridge logs (its
    dialect runs this step)."""
    return _step(data_iterator, model, "lm loss")


def _step(
    data_iterator: Iterator[Any], model: nn.Module, name: str | None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]]:
    x, y = next(data_iterator)
    device = next(model.parameters()).device
    x = x.to(device, non_blocking=True)
    y = y.to(device, non_blocking=True)
    logits = model(x)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        return _lm_loss(output, y, name)

    return logits, loss_func


@torch.no_grad()
def generate(
    model: GPT,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> str:
    """Sample ``max_new_tokens`` bytes after ``prompt`` and return only the continuation.

    The context is cropped to the model's ``block_size``; ``temperature=0`` picks
    the most likely byte. The model's train/eval mode is restored afterwards, so
    this is safe to call from inside a training run (e.g. in a callback).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= VOCAB_SIZE
    ):
        raise ValueError(f"top_k must be None or an int in [1, {VOCAB_SIZE}], got {top_k!r}")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")

    device = next(model.parameters()).device
    block_size = model.config.block_size
    # An empty prompt starts from a newline: the start of a line is a natural beginning.
    ids = encode(prompt or "\n").long().to(device)[None, :]
    n_prompt = ids.shape[1]
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(ids[:, -block_size:])[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < VOCAB_SIZE:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                if generator is not None and generator.device != probs.device:
                    nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
                else:
                    nxt = torch.multinomial(probs, 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        model.train(was_training)
    return decode(ids[0, n_prompt:])


# -- recipe ---------------------------------------------------------------------


def build(config: Config) -> RecipeParts:
    """Build the model and the train/eval datasets; the caller has already seeded RNGs."""
    mcfg, dcfg = config.model, config.data
    if not isinstance(mcfg, GPTConfig):
        raise TypeError(f"recipe gpt-stdlib needs a GPTConfig model section, got {type(mcfg)}")
    if not isinstance(dcfg, TextDataConfig):
        raise TypeError(f"recipe gpt-stdlib needs a TextDataConfig data section, got {type(dcfg)}")
    mcfg.validate()
    dcfg.validate()
    corpus = load_corpus(dcfg.source, dcfg.max_bytes)
    train_data, eval_data = split_corpus(corpus, mcfg.block_size, dcfg.eval_fraction)
    model = GPT(mcfg)
    return RecipeParts(
        model=model,
        train_data=train_data,
        eval_data=eval_data,
        forward_step=lm_step,
        flops_per_sample=flops_per_sample(mcfg, model.num_params()),
    )


def default_config() -> Config:
    """Defaults measured to finish in under two minutes on 2 idle CPU cores (see module doc)."""
    return Config(
        recipe="gpt-stdlib",
        model=GPTConfig(),
        data=TextDataConfig(batch_size=32, eval_batch_size=64),
        optimizer=OptimizerConfig(
            name="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8
        ),
        scheduler=SchedulerConfig(name="cosine", warmup_steps=20, min_lr_ratio=0.1),
        train=TrainConfig(
            max_steps=300,  # ~0.29 s/step on 2 idle cores: about 90 s of training
            log_every=10,
            eval_every=75,
            eval_max_batches=8,
            clip_grad_norm=1.0,
        ),
        checkpoint=CheckpointConfig(every=100),
    )


register_recipe(
    Recipe(
        name="gpt-stdlib",
        description=(
            "Byte-level GPT trained on this Python's standard library source "
            "(no download; about 2 minutes on a laptop CPU)."
        ),
        default_config=default_config,
        build=build,
    )
)
