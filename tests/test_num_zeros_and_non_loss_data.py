"""Megatron-Bridge's step and evaluation extras: ``num_zeros_in_grad`` in the step logs
(``train.log_num_zeros_in_grad``) and ``non_loss_data_func`` called on the model at
each evaluation, its result on ``ctx.non_loss_data`` during ``on_eval_end``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hookloop import Callback, CallbackManager, Config, DataConfig, TrainConfig, Trainer
from hookloop.testing import TinyModel, ToyData


class SparseUse(nn.Module):
    """An embedding table of which each batch uses only a few rows: the other rows'
    gradients are exactly zero, as in a language model's rare tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(-1)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 4, (6,), generator=g), torch.randn(6, generator=g)) for _ in range(n)]


class _Logs(Callback):
    priority = 200

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, ctx) -> None:
        self.logs.append(dict(ctx.logs))


def _zeros_by_hand(model: nn.Module, batches, steps: int) -> int:
    """Zero gradient elements at step ``steps``, replaying the same updates by hand."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches[:steps]):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        if i == steps - 1:
            return sum(int((p.grad == 0).sum()) for p in model.parameters())
        opt.step()
    raise AssertionError("unreachable")


def test_num_zeros_in_grad_is_logged_on_log_steps_when_asked():
    model, batches, logs = SparseUse(), _batches(4), _Logs()
    reference = copy.deepcopy(model)
    cfg = Config(
        train=TrainConfig(max_steps=4, log_every=2, log_num_zeros_in_grad=True, clip_grad_norm=None)
    )
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=batches,
        loss_fn=nn.functional.mse_loss, config=cfg, callbacks=CallbackManager([logs]),
    )  # fmt: skip
    trainer.train()
    assert [r["num_zeros_in_grad"] for r in logs.logs] == [
        _zeros_by_hand(copy.deepcopy(reference), batches, 2),
        _zeros_by_hand(copy.deepcopy(reference), batches, 4),
    ]
    assert logs.logs[0]["num_zeros_in_grad"] >= 6 * 3  # rows 4..9 of the table were unused


def test_num_zeros_in_grad_is_off_by_default():
    logs = _Logs()
    cfg = Config(train=TrainConfig(max_steps=2, log_every=1), data=DataConfig(batch_size=4))
    Trainer(
        TinyModel(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn, config=cfg,
        callbacks=CallbackManager([logs]),
    ).train()  # fmt: skip
    assert logs.logs and all("num_zeros_in_grad" not in r for r in logs.logs)


class _EvalSeen(Callback):
    def __init__(self) -> None:
        self.at_end: list[object] = []
        self.at_test_end: list[object] = []
        self.elsewhere: list[object] = []

    def on_eval_end(self, ctx) -> None:
        self.at_end.append(ctx.non_loss_data)

    def on_test_end(self, ctx) -> None:
        self.at_test_end.append(ctx.non_loss_data)

    def on_eval_step_end(self, ctx) -> None:
        self.elsewhere.append(ctx.non_loss_data)

    def on_train_step_end(self, ctx) -> None:
        self.elsewhere.append(ctx.non_loss_data)


def test_non_loss_data_func_runs_once_per_evaluation_and_test_on_the_model_in_eval_mode():
    calls: list[tuple[bool, bool]] = []

    def non_loss_data(model: nn.Module) -> dict[str, float]:
        calls.append((model.training, torch.is_grad_enabled()))
        return {"weight_sum": float(model.net[0].weight.sum())}

    seen = _EvalSeen()
    cfg = Config(
        train=TrainConfig(max_steps=4, log_every=0, eval_every=2, eval_at_epoch_end=False),
        data=DataConfig(batch_size=4),
    )
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=CallbackManager([seen]),
        non_loss_data_func=non_loss_data,
    )  # fmt: skip
    trainer.train()
    assert calls == [(False, False), (False, False)]  # steps 2 and 4
    assert len(seen.at_end) == 2 and seen.at_end[0] != seen.at_end[1]  # the model changed
    assert all(isinstance(v, dict) and "weight_sum" in v for v in seen.at_end)
    assert all(v is None for v in seen.elsewhere)  # only during on_eval_end
    assert trainer.model.training  # back in training mode afterwards

    trainer.test(ToyData(n=8, seed=2))  # the test phase calls it too, as Megatron's does
    assert calls == [(False, False)] * 3 and seen.at_test_end == [seen.at_end[-1]]


def test_a_non_callable_non_loss_data_func_is_refused():
    with pytest.raises(TypeError, match=r"non_loss_data_func must be callable\(model\)"):
        Trainer(TinyModel(), train_data=ToyData(), non_loss_data_func=3)


def test_pretrain_passes_non_loss_data_func_to_the_loop():
    from hookloop.entry import pretrain
    from hookloop.recipes import default_config

    cfg = default_config("mlp-regression")
    cfg.train.max_steps, cfg.train.eval_every, cfg.train.log_every = 4, 2, 0
    cfg.train.eval_at_epoch_end = False
    seen = _EvalSeen()
    pretrain(cfg, callbacks=[seen], non_loss_data_func=lambda model: type(model).__name__)
    assert seen.at_end == ["Sequential", "Sequential"]


def test_pretrain_hands_non_loss_data_to_callbacks_and_tensorboard(tmp_path):
    """Megatron-Bridge's pair: ``non_loss_data_func(model)`` after each evaluation, and
    ``process_non_loss_data_func(data, iteration, writer)`` with the TensorBoard writer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
    from hookloop.compat.megatron_bridge.training.callbacks import Callback as BridgeCallback
    from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
    from hookloop.compat.megatron_bridge.training.pretrain import pretrain

    cfg = tiny_gpt_pretrain_config(train_iters=4, eval_interval=2)
    cfg.logger.tensorboard_dir = str(tmp_path / "tb")
    processed: list[tuple[float, int]] = []
    at_eval_end: list[object] = []

    def weight_norm(model):
        return float(sum(p.detach().norm() for p in model.parameters()))

    def process(data, iteration, writer):
        processed.append((data, iteration))
        writer.add_scalar("weight-norm", data, iteration)

    class Seen(BridgeCallback):
        def on_eval_end(self, context):
            at_eval_end.append(context.non_loss_data)

        def on_test_end(self, context):
            at_eval_end.append(context.non_loss_data)

    pretrain(
        cfg, forward_step, callbacks=[Seen()], out_dir=tmp_path / "run",
        non_loss_data_func=weight_norm, process_non_loss_data_func=process,
    )  # fmt: skip
    # Evaluations at steps 2 and 4, the validation after training, then the test phase (the
    # config splits off test data), as Megatron-Bridge's pretrain runs them.
    assert [step for _, step in processed] == [2, 4, 4, 4]
    assert at_eval_end == [data for data, _ in processed]  # the dialect callbacks saw it too
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written = [(e.step, e.value) for e in events.Scalars("weight-norm")]
    assert written == [(s, pytest.approx(v)) for v, s in processed]


def test_processing_without_a_non_loss_data_func_is_refused():
    from hookloop.compat.megatron_bridge.recipes import tiny_gpt_pretrain_config
    from hookloop.compat.megatron_bridge.training.gpt_step import forward_step
    from hookloop.compat.megatron_bridge.training.pretrain import pretrain

    with pytest.raises(ValueError, match="process_non_loss_data_func needs non_loss_data_func"):
        pretrain(tiny_gpt_pretrain_config(), forward_step, process_non_loss_data_func=print)
    with pytest.raises(TypeError, match="non_loss_data_func must be callable or None"):
        pretrain(tiny_gpt_pretrain_config(), forward_step, non_loss_data_func=3)
