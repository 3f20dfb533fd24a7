"""``hookloop.activation_checkpointing``: the same loss and gradients with and without,
and the wrapped blocks really run again in the backward pass."""

from __future__ import annotations

import copy

import pytest
import torch

from hookloop.activation_checkpointing import unwrap, wrap_for_checkpointing


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.down(torch.nn.functional.gelu(self.up(x)))


class MLP(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x)


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor, seed: int = 0):
    torch.manual_seed(seed)  # the same dropout draws for both models
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_mlp_blocks_same_loss_and_gradients_and_recomputed() -> None:
    torch.manual_seed(0)
    plain = MLP()
    checkpointed = copy.deepcopy(plain)
    wrapped = wrap_for_checkpointing(checkpointed, Block)
    assert wrapped == list(checkpointed.blocks)
    inner = count_calls(checkpointed.blocks[0].up)
    x = torch.randn(5, 8)
    loss, grads = loss_and_grads(plain, x)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, x)
    assert inner == [2]  # the forward, then again in the backward pass
    assert torch.equal(loss, loss_ckpt)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=1e-7)


def test_transformer_block_with_dropout_same_loss_and_gradients() -> None:
    torch.manual_seed(0)
    layer = dict(d_model=16, nhead=2, dim_feedforward=32, dropout=0.2, batch_first=True)
    plain = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**layer), num_layers=2,
                                        enable_nested_tensor=False)  # fmt: skip
    checkpointed = copy.deepcopy(plain)
    assert len(wrap_for_checkpointing(checkpointed, torch.nn.TransformerEncoderLayer)) == 2
    inner = count_calls(checkpointed.layers[1].linear1)
    x = torch.randn(3, 6, 16)
    loss, grads = loss_and_grads(plain, x)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed, x)
    assert inner == [2]
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-5, atol=1e-6)


def test_evaluation_is_not_recomputed_and_unwrap_restores() -> None:
    model = MLP()
    wrap_for_checkpointing(model, [Block])
    inner = count_calls(model.blocks[2].down)
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 8))
    assert inner == [1]
    unwrap(model)
    model.train()
    model(torch.randn(2, 8)).sum().backward()
    assert inner == [2]  # one more forward, none in the backward: no longer checkpointed
    assert "forward" not in vars(model.blocks[2])


def test_nothing_to_wrap_and_reentrant_are_refused() -> None:
    with pytest.raises(ValueError, match="no submodule of type TransformerEncoderLayer"):
        wrap_for_checkpointing(MLP(), torch.nn.TransformerEncoderLayer)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        wrap_for_checkpointing(MLP(), Block, use_reentrant=True)


# -- the native loop's switch: train.activation_checkpointing ----------------------------


def _gpt_run(*overrides: str) -> tuple[list[float], int]:
    """Losses of 3 steps of the small GPT recipe, and the bytes autograd saved for backward
    in the first step (what activation checkpointing trades for recomputation)."""
    from hookloop.config import apply_overrides
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    cfg = default_config("gpt-stdlib")
    apply_overrides(cfg, ["train.max_steps=3", "train.log_every=1", "model.n_layer=2",
                          "model.n_embd=32", "model.n_head=2", "model.block_size=32",
                          "data.batch_size=4", "train.eval_every=1000", *overrides])  # fmt: skip
    trainer = build_trainer(cfg)
    losses: list[float] = []
    trainer.callbacks.register("on_log", lambda ctx: losses.append(ctx.logs["loss"]))
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train()
    return losses, saved[0]


def test_the_native_switch_gives_the_same_losses_keeping_fewer_activations() -> None:
    plain, plain_bytes = _gpt_run()
    checkpointed, checkpointed_bytes = _gpt_run("train.activation_checkpointing=Block")
    assert checkpointed == plain
    assert checkpointed_bytes < plain_bytes / 2  # the blocks keep only their inputs


def test_the_native_switch_names_the_classes_a_model_has() -> None:
    from hookloop.errors import ConfigError

    with pytest.raises(ConfigError, match=r"names Blok, which GPT has no submodule of; its "
                       r"classes: .*Block"):  # fmt: skip
        _gpt_run("train.activation_checkpointing=Blok")
    with pytest.raises(ConfigError, match="must be module class names separated by commas"):
        _gpt_run("train.activation_checkpointing=Block;rm")
