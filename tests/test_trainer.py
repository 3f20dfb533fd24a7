"""The Trainer: budgets, accumulation, clipping, precision, schedules, evaluation, exits,
data order."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.data import Dataset

from hookloop import Callback, CallbackManager, ExitCode, Trainer
from hookloop.data import EpochSampler
from hookloop.testing import RecordingCallback, TinyModel, ToyData


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _mse(model, x, y) -> float:
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


class IndexData(Dataset):
    """Sample i is ``([i, 0, 0, 0], [0])``: batches reveal which samples they hold."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), 0.0, 0.0, 0.0]), torch.zeros(1)


# -- it trains -----------------------------------------------------------------------------


def test_loss_falls_on_toy_data(make_trainer, make_config):
    cfg = make_config(max_epochs=10, log_every=4)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.05
    logged: list[float] = []
    manager = CallbackManager()
    manager.register("on_log", lambda ctx: logged.append(ctx.logs["loss"]))
    trainer = make_trainer(manager, n=64, eval_n=32, cfg=cfg)

    before = trainer.evaluate()["eval_loss"]
    result = trainer.train()

    assert isinstance(trainer.optimizer, torch.optim.SGD)  # built from the config
    assert result.metrics["eval_loss"] < before / 10
    assert logged[-1] < logged[0] / 10
    assert all(math.isfinite(v) for v in logged)


def test_training_with_every_callback_switched_off_still_trains(make_config):
    cfg = make_config(max_epochs=10)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.05
    model, data = TinyModel(), ToyData(64)
    before = _mse(model, data.x, data.y)

    result = Trainer(model, train_data=data, config=cfg, loss_fn=TinyModel.loss_fn).train()

    assert result.step == 160
    assert _mse(model, data.x, data.y) < before / 10


# -- budgets -------------------------------------------------------------------------------


def test_max_epochs_runs_whole_epochs(make_trainer):
    rec = RecordingCallback(events=["on_epoch_start", "on_epoch_end"])
    trainer = make_trainer([rec], n=16, max_epochs=3)  # 4 steps an epoch
    assert (trainer.state.steps_per_epoch, trainer.state.max_steps) == (4, 12)

    result = trainer.train()

    assert (result.step, result.epoch) == (12, 3)
    assert trainer.state.samples == 48
    assert rec.events == [
        ("on_epoch_start", 0, 0),
        ("on_epoch_end", 4, 0),
        ("on_epoch_start", 4, 0),
        ("on_epoch_end", 8, 0),
        ("on_epoch_start", 8, 0),
        ("on_epoch_end", 12, 0),
    ]


def test_an_epoch_bounded_run_says_it_stopped_at_max_epochs(make_trainer):
    assert make_trainer(n=16, max_epochs=2).train().stop_reason == "max_epochs"


def test_max_steps_stops_mid_epoch_without_epoch_end(make_trainer):
    rec = RecordingCallback(events=["on_epoch_end", "on_eval_end"])
    result = make_trainer([rec], n=16, eval_n=4, max_steps=6).train()
    assert (result.step, result.epoch, result.stop_reason) == (6, 1, "max_steps")
    assert rec.events == [("on_eval_end", 4, 0), ("on_epoch_end", 4, 0)]


@pytest.mark.parametrize(
    ("budget", "step", "reason"),
    [
        ({"max_epochs": 1, "max_steps": 100}, 4, "max_epochs"),
        ({"max_epochs": 5, "max_steps": 3}, 3, "max_steps"),
        ({}, 4, None),  # neither: one epoch
    ],
)
def test_the_smaller_budget_wins(make_trainer, budget, step, reason):
    result = make_trainer(n=16, **budget).train()
    assert result.step == step
    if reason is not None:
        assert result.stop_reason == reason


def test_unsized_data_runs_one_epoch_by_default(make_config):
    data = ToyData(16)

    def batches():
        for i in range(0, 16, 4):
            yield data.x[i : i + 4], data.y[i : i + 4]

    trainer = Trainer(
        TinyModel(), train_data=batches(), config=make_config(), loss_fn=TinyModel.loss_fn
    )
    assert trainer.state.max_steps is None
    result = trainer.train()
    assert (result.step, result.stop_reason) == (4, "max_epochs")


def test_grad_accum_groups_micro_batches_and_drops_a_partial_group(make_trainer):
    rec = RecordingCallback(events=["on_micro_step_end", "on_train_step_end"])
    trainer = make_trainer([rec], n=20, grad_accum=2, max_epochs=1)  # 5 batches -> 2 steps
    assert trainer.state.steps_per_epoch == 2

    trainer.train()

    assert rec.events == [
        ("on_micro_step_end", 1, 0),
        ("on_micro_step_end", 1, 1),
        ("on_train_step_end", 1, 0),
        ("on_micro_step_end", 2, 0),
        ("on_micro_step_end", 2, 1),
        ("on_train_step_end", 2, 0),
    ]
    assert trainer.state.samples == 16


def test_too_few_batches_for_one_step_is_refused(make_trainer):
    with pytest.raises(ValueError, match=r"train\.grad_accum=3"):
        make_trainer(n=8, grad_accum=3)  # 2 batches an epoch


# -- gradients, precision ------------------------------------------------------------------


class GradProbe(Callback):
    def __init__(self) -> None:
        self.reported: list[torch.Tensor | None] = []
        self.clipped_norms: list[float] = []

    def on_before_optimizer_step(self, ctx):
        self.reported.append(ctx.grad_norm)
        norms = torch.stack([p.grad.norm() for p in ctx.model.parameters()])
        self.clipped_norms.append(torch.linalg.vector_norm(norms).item())


def test_clipping_bounds_the_gradient_and_reports_the_norm_before_clipping(
    make_trainer, make_config
):
    cfg = make_config(max_steps=1, clip_grad_norm=0.05)
    cfg.data.shuffle = False
    probe = GradProbe()
    make_trainer([probe], cfg=cfg).train()

    reference, data = TinyModel(), ToyData(16)
    loss = torch.nn.functional.mse_loss(reference(data.x[:4]), data.y[:4])
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()

    (reported,) = probe.reported
    assert isinstance(reported, torch.Tensor) and reported.dim() == 0
    assert reported.item() == pytest.approx(expected, rel=1e-5)
    assert expected > 0.05
    assert probe.clipped_norms[0] == pytest.approx(0.05, rel=1e-4)


def test_without_clipping_there_is_no_grad_norm(make_trainer):
    probe = GradProbe()
    logs: list[dict] = []
    manager = CallbackManager(probe)
    manager.register("on_log", lambda ctx: logs.append(dict(ctx.logs)))
    make_trainer(manager, max_steps=2, clip_grad_norm=None, log_every=2).train()
    assert probe.reported == [None, None]
    assert "grad_norm" not in logs[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_cpu_runs_and_trains(make_trainer, make_config, precision):
    # autocast on CPU costs ~20 ms a step in torch itself, so this run is kept short
    cfg = make_config(max_steps=40, precision=precision, eval_at_epoch_end=False)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.1
    dtypes: list[torch.dtype] = []
    manager = CallbackManager()
    manager.register("on_micro_step_end", lambda ctx: dtypes.append(ctx.outputs.dtype), once=True)
    trainer = make_trainer(manager, n=64, eval_n=32, cfg=cfg)

    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]

    expected = torch.bfloat16 if precision == "bf16" else torch.float16
    assert dtypes == [expected]  # the forward ran under autocast
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert after < before / 4


def test_an_update_fp16s_scaler_skips_does_not_advance_the_lr_schedule(make_trainer, make_config):
    """As transformers.Trainer: when the GradScaler skips an update (overflowed gradients),
    the scheduler is not stepped either, and torch's "scheduler before optimizer" warning
    never comes."""
    cfg = make_config(max_steps=6, precision="fp16", eval_at_epoch_end=False)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.1
    cfg.scheduler.name = "linear"
    overflow_at, seen = 3, []  # per step: (lr used, scaler skipped, weights changed)
    manager = CallbackManager()

    def before(ctx):
        ctx.user_state["w"] = [p.detach().clone() for p in ctx.model.parameters()]
        ctx.user_state["lr"] = ctx.optimizer.param_groups[0]["lr"]

    def after(ctx):
        changed = any(
            not torch.equal(a, p)
            for a, p in zip(ctx.user_state["w"], ctx.model.parameters(), strict=True)
        )
        seen.append((ctx.user_state["lr"], ctx.trainer.precision.skipped_update, changed))

    manager.register("on_train_step_start", before)
    manager.register("on_train_step_end", after)
    trainer = make_trainer(manager, n=64, cfg=cfg)
    first = next(trainer.model.parameters())
    first.register_hook(lambda g: g * float("inf") if trainer.state.step == overflow_at else g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    skipped = [skip for _, skip, _ in seen]
    assert len(seen) == 6 and skipped[overflow_at - 1]  # (its first scale may overflow too)
    assert [changed for _, _, changed in seen] == [not skip for skip in skipped]
    lrs = [lr for lr, _, _ in seen]
    for step in range(1, 6):  # the rate moves on after an applied update, and only then
        assert (lrs[step] < lrs[step - 1]) == (not skipped[step - 1]), (lrs, skipped)
    assert trainer.scheduler.last_epoch == skipped.count(False)


# -- learning-rate schedule ----------------------------------------------------------------


def _lrs_used(make_trainer, cfg) -> list[float]:
    used: list[float] = []
    manager = CallbackManager()
    manager.register(
        "on_train_step_start", lambda ctx: used.append(ctx.optimizer.param_groups[0]["lr"])
    )
    make_trainer(manager, cfg=cfg).train()
    return used


def test_cosine_schedule_from_config(make_trainer, make_config):
    cfg = make_config(max_steps=10)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 0.1
    cfg.scheduler.name, cfg.scheduler.min_lr_ratio = "cosine", 0.1

    used = _lrs_used(make_trainer, cfg)

    expected = [0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 10))) for s in range(10)]
    assert used == pytest.approx(expected)


def test_warmup_then_linear_decay(make_trainer, make_config):
    cfg = make_config(max_steps=6)
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 1.0
    cfg.scheduler.name, cfg.scheduler.warmup_steps, cfg.scheduler.min_lr_ratio = "linear", 2, 0.0
    assert _lrs_used(make_trainer, cfg) == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])


def test_epoch_budget_sets_the_schedule_length(make_trainer, make_config):
    cfg = make_config(max_epochs=2)  # 8 steps
    cfg.optimizer.name, cfg.optimizer.lr = "sgd", 1.0
    cfg.scheduler.name, cfg.scheduler.min_lr_ratio = "linear", 0.2
    trainer = make_trainer(cfg=cfg)
    trainer.train()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


def test_decaying_schedule_without_a_step_budget_is_refused(make_config):
    cfg = make_config()
    cfg.scheduler.name = "cosine"
    with pytest.raises(ValueError, match=r"train\.max_steps"):
        Trainer(TinyModel(), train_data=iter([]), config=cfg, loss_fn=TinyModel.loss_fn)


def test_a_given_scheduler_is_stepped_once_per_step(make_config):
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = Trainer(
        model,
        optimizer,
        train_data=ToyData(16),
        config=make_config(max_steps=3),
        loss_fn=TinyModel.loss_fn,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
    )
    trainer.train()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


# -- evaluation ----------------------------------------------------------------------------


def test_eval_every_n_steps_and_at_epoch_end_before_on_epoch_end(make_trainer):
    rec = RecordingCallback(events=["on_eval_end", "on_epoch_end"])
    result = make_trainer([rec], eval_n=8, max_epochs=2, eval_every=3).train()
    assert rec.events == [
        ("on_eval_end", 3, 0),
        ("on_eval_end", 4, 0),
        ("on_epoch_end", 4, 0),
        ("on_eval_end", 6, 0),
        ("on_eval_end", 8, 0),
        ("on_epoch_end", 8, 0),
    ]
    assert set(result.metrics) == {"eval_loss"}


def test_epoch_end_evaluation_can_be_switched_off(make_trainer):
    rec = RecordingCallback(events=["on_eval_end"])
    make_trainer([rec], eval_n=8, max_epochs=2, eval_every=3, eval_at_epoch_end=False).train()
    assert [step for _, step, _ in rec.events] == [3, 6]


def test_eval_max_batches_caps_each_evaluation(make_trainer):
    rec = RecordingCallback(events=["on_eval_step_end"])
    trainer = make_trainer([rec], eval_n=16, max_steps=1, eval_max_batches=2)
    trainer.evaluate()
    assert len(rec.events) == 2


def test_model_is_in_eval_mode_during_evaluation_and_back_in_train_mode_after(make_trainer):
    modes: list[tuple[str, bool]] = []
    manager = CallbackManager()
    manager.register("on_eval_step_start", lambda ctx: modes.append(("eval", ctx.model.training)))
    manager.register("on_train_step_start", lambda ctx: modes.append(("train", ctx.model.training)))
    make_trainer(manager, eval_n=4, max_steps=3, eval_every=1).train()
    assert modes == [("train", True), ("eval", False)] * 3


def test_evaluate_and_test_return_the_mean_batch_loss_and_fire_their_events(make_trainer):
    rec = RecordingCallback()
    trainer = make_trainer([rec], eval_n=8, test_n=8, max_steps=1)
    rec.events.clear()

    metrics = trainer.evaluate()
    eval_events = rec.names()
    rec.events.clear()
    test_metrics = trainer.test()
    test_events = rec.names()

    model, eval_data, test_data = TinyModel(), ToyData(8, seed=1), ToyData(8, seed=2)
    expected_eval = (
        _mse(model, eval_data.x[:4], eval_data.y[:4])
        + _mse(model, eval_data.x[4:], eval_data.y[4:])
    ) / 2
    expected_test = (
        _mse(model, test_data.x[:4], test_data.y[:4])
        + _mse(model, test_data.x[4:], test_data.y[4:])
    ) / 2
    assert metrics == {"eval_loss": pytest.approx(expected_eval, rel=1e-6)}
    assert test_metrics == {"test_loss": pytest.approx(expected_test, rel=1e-6)}
    per_batch = ["on_eval_step_start", "on_eval_step_end"]
    assert eval_events == ["on_eval_start", *per_batch, *per_batch, "on_eval_end"]
    assert test_events == [e.replace("eval", "test") for e in eval_events]
    assert trainer.state.last_eval == metrics  # test() does not overwrite it


def test_evaluate_accepts_data_and_honours_eval_batch_size(make_trainer, make_config):
    cfg = make_config(max_steps=1)
    cfg.data.eval_batch_size = 8
    rec = RecordingCallback(events=["on_eval_step_end"])
    trainer = make_trainer([rec], cfg=cfg)
    metrics = trainer.evaluate(ToyData(16, seed=3))
    assert len(rec.events) == 2
    assert metrics["eval_loss"] > 0


def test_evaluate_and_test_without_data_explain_what_is_missing(make_trainer):
    trainer = make_trainer(max_steps=1)
    with pytest.raises(ValueError, match="eval_data"):
        trainer.evaluate()
    with pytest.raises(ValueError, match="test_data"):
        trainer.test()


# -- logging -------------------------------------------------------------------------------


def test_log_averages_the_steps_since_the_last_log(make_trainer):
    step_losses: list[float] = []
    logs: list[dict] = []
    manager = CallbackManager()
    manager.register(
        "on_train_step_end", lambda ctx: step_losses.append(float(ctx.loss_dict["loss"]))
    )
    manager.register("on_log", lambda ctx: logs.append(dict(ctx.logs)))

    result = make_trainer(manager, max_steps=4, log_every=2).train()

    assert [log["loss"] for log in logs] == pytest.approx(
        [sum(step_losses[:2]) / 2, sum(step_losses[2:]) / 2], rel=1e-6
    )
    assert set(logs[0]) == {"loss", "grad_norm", "lr", "epoch", "skipped_steps"}
    assert logs[0]["epoch"] == pytest.approx(0.5)
    assert result.logs == logs[-1]


def test_before_log_producers_feed_on_log_consumers(make_trainer):
    seen: list[float] = []
    manager = CallbackManager()
    manager.register("on_before_log", lambda ctx: ctx.logs.update(custom=ctx.state.step * 1.5))
    manager.register("on_log", lambda ctx: seen.append(ctx.logs["custom"]))
    make_trainer(manager, max_steps=4, log_every=2).train()
    assert seen == [3.0, 6.0]


# -- non-finite steps ----------------------------------------------------------------------


def _poisoned_step(bad_steps):
    def forward_step(state, data_iterator, model):
        x, y = next(data_iterator)
        out = model(x)
        scale = float("nan") if state.step in bad_steps else 1.0
        return out, lambda out: (torch.nn.functional.mse_loss(out, y) * scale, {})

    return forward_step


class ParamWatch(Callback):
    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}
        self.skipped: list[bool] = []

    def on_train_step_start(self, ctx):
        self.before[ctx.state.step] = _params(ctx.model)

    def on_train_step_end(self, ctx):
        self.after[ctx.state.step] = _params(ctx.model)
        self.skipped.append(ctx.skipped_iter)


def test_a_nan_loss_skips_that_step_and_training_continues(make_config):
    watch = ParamWatch()
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),
        config=make_config(max_steps=6),
        callbacks=[watch],
        forward_step=_poisoned_step({3}),
    )
    result = trainer.train()

    assert _same(watch.before[3], watch.after[3])
    assert not _same(watch.before[4], watch.after[4])
    assert watch.skipped == [False, False, True, False, False, False]
    assert trainer.state.skipped_steps == 1
    assert result.step == 6
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_finite_loss_with_non_finite_gradients_is_skipped(make_config, clip):
    def forward_step(state, data_iterator, model):
        x, y = next(data_iterator)
        out = model(x)

        def loss_func(out):
            loss = torch.nn.functional.mse_loss(out, y)
            if state.step == 2:  # sqrt'(0) is inf and 0 * inf is nan: the value stays finite
                loss = loss + 0.0 * torch.sqrt(out.sum() * 0.0)
            return loss, {}

        return out, loss_func

    watch = ParamWatch()
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),
        config=make_config(max_steps=3, clip_grad_norm=clip),
        callbacks=[watch],
        forward_step=forward_step,
    )
    trainer.train()
    assert watch.skipped == [False, True, False]
    assert _same(watch.before[2], watch.after[2])


def test_a_skipped_nan_step_does_not_poison_the_logged_loss(make_config):
    step_losses: dict[int, float] = {}
    logs: list[dict] = []
    manager = CallbackManager()
    manager.register(
        "on_train_step_end",
        lambda ctx: step_losses.update({ctx.state.step: float(ctx.loss_dict["loss"])}),
    )
    manager.register("on_log", lambda ctx: logs.append(dict(ctx.logs)))
    Trainer(
        TinyModel(),
        train_data=ToyData(16),
        config=make_config(max_steps=2, log_every=2),
        callbacks=manager,
        forward_step=_poisoned_step({1}),
    ).train()
    assert logs[0]["skipped_steps"] == 1
    assert logs[0]["loss"] == pytest.approx(step_losses[2])  # only the applied step


def test_too_many_skipped_steps_raise_naming_the_setting(make_config):
    rec = RecordingCallback(events=["on_exception"])
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),
        config=make_config(max_steps=8, max_skipped_steps=2),
        callbacks=[rec],
        forward_step=_poisoned_step({2, 3, 4, 5}),
    )
    with pytest.raises(FloatingPointError, match=r"train\.max_skipped_steps=2"):
        trainer.train()
    assert trainer.state.step == 3
    assert rec.events == [("on_exception", 3, 0)]


def test_without_the_guard_a_nan_step_corrupts_the_weights(make_config):
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(16),
        config=make_config(max_steps=2, skip_nonfinite=False),
        forward_step=_poisoned_step({2}),
    )
    trainer.train()
    assert trainer.state.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())


# -- iterations_to_skip and exits ----------------------------------------------------------


def test_iterations_to_skip_consumes_the_data_without_computing(make_config):
    batches = [(torch.full((4, 4), float(i)), torch.zeros(4, 1)) for i in range(6)]
    calls: list[tuple[int, int]] = []

    def forward_step(state, data_iterator, model):
        x, y = next(data_iterator)
        calls.append((state.step, int(x[0, 0])))
        out = model(x)
        return out, lambda out: (torch.nn.functional.mse_loss(out, y), {})

    trainer = Trainer(
        TinyModel(),
        train_data=batches,
        config=make_config(max_steps=4, iterations_to_skip=[2]),
        forward_step=forward_step,
    )
    result = trainer.train()

    assert calls == [(1, 0), (3, 2), (4, 3)]  # batch 1 went with the skipped step 2
    assert trainer.state.samples == 16
    assert result.step == 4


def test_every_schedule_acts_at_its_own_steps_when_several_interleave(make_config, tmp_path):
    """Logs, evaluations, saves and the exit interval each at their own multiples (the
    boundary skips the steps in between without looking), and a request filed on a step
    between them is still served at that step."""
    cfg = make_config(max_steps=14, log_every=5, eval_every=3, exit_interval=13)
    cfg.train.eval_at_epoch_end = False
    cfg.checkpoint.every, cfg.checkpoint.save_on_end = 4, False
    rec = RecordingCallback(events=["on_log", "on_eval_end", "on_checkpoint_save"])
    manager = CallbackManager([rec])
    manager.register("on_train_step_end", lambda ctx: ctx.control.request_log(), once=7)
    trainer = Trainer(
        TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=8, seed=1),
        loss_fn=TinyModel.loss_fn, config=cfg, callbacks=manager, out_dir=tmp_path,
    )  # fmt: skip
    result = trainer.train()
    steps = {e: [s for name, s, _ in rec.events if name == e] for e in rec.only}
    assert steps == {
        "on_log": [5, 7, 10],
        "on_eval_end": [3, 6, 9, 12],
        "on_checkpoint_save": [4, 8, 12, 13],  # a stop (the exit interval) saves too
    }
    assert (result.step, result.stop_reason) == (13, "exit_interval")


def test_exit_interval_stops_at_the_first_multiple(make_trainer):
    result = make_trainer(max_steps=10, exit_interval=3).train()
    assert (result.step, result.stop_reason, result.exit_code) == (3, "exit_interval", ExitCode.OK)


def test_exit_duration_stops_after_the_first_step(make_trainer):
    result = make_trainer(max_steps=10, exit_duration_minutes=1e-6).train()
    assert (result.step, result.stop_reason, result.exit_code) == (1, "exit_duration", ExitCode.OK)


# -- constructor errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "not a model"}, TypeError, r"torch\.nn\.Module"),
        ({"optimizer": "adam"}, TypeError, r"torch\.optim\.Optimizer"),
        ({"forward_step": lambda it, m: None}, ValueError, "forward_step or loss_fn, not both"),
        ({"loss_fn": "mse"}, TypeError, "loss_fn must be callable"),
        (
            {"train_data": 42},
            TypeError,
            r"must be a dataset \(an object with __getitem__ and __len__.*"
            "a DataLoader or an iterable of batches",
        ),
        ({"eval_data": 3.5}, TypeError, "eval/test data"),
        ({"config": {"max_steps": 3}}, TypeError, "Config or TrainConfig"),
        ({"callbacks": print}, TypeError, "register"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_constructor_arguments_raise_clear_errors(make_config, kwargs, error, match):
    args = {
        "model": TinyModel(),
        "optimizer": None,
        "train_data": ToyData(8),
        "config": make_config(),
        "loss_fn": TinyModel.loss_fn,
    }
    args.update(kwargs)
    model, optimizer = args.pop("model"), args.pop("optimizer")
    with pytest.raises(error, match=match):
        Trainer(model, optimizer, **args)


def test_train_without_train_data_explains(make_config):
    trainer = Trainer(TinyModel(), config=make_config(), loss_fn=TinyModel.loss_fn)
    with pytest.raises(ValueError, match="train_data"):
        trainer.train()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_cuda_is_refused(make_config):
    with pytest.raises(ValueError, match="CUDA is not available"):
        Trainer(
            TinyModel(),
            train_data=ToyData(8),
            config=make_config(device="cuda"),
            loss_fn=TinyModel.loss_fn,
        )


# -- data order ----------------------------------------------------------------------------


def _sample_order(make_config, seed: int, shuffle: bool = True, epochs: int = 2):
    cfg = make_config(max_epochs=epochs)
    cfg.seed, cfg.data.shuffle = seed, shuffle
    order: dict[int, list[int]] = {}
    manager = CallbackManager()
    manager.register(
        "on_micro_step_start",
        lambda ctx: order.setdefault(ctx.state.epoch, []).extend(
            ctx.batch[0][:, 0].long().tolist()
        ),
    )
    Trainer(
        TinyModel(),
        train_data=IndexData(16),
        config=cfg,
        callbacks=manager,
        loss_fn=TinyModel.loss_fn,
    ).train()
    return order


def test_same_seed_gives_the_same_data_order(make_config):
    assert _sample_order(make_config, seed=5) == _sample_order(make_config, seed=5)


def test_shuffle_differs_per_epoch_and_covers_every_sample(make_config):
    order = _sample_order(make_config, seed=5)
    assert sorted(order[0]) == sorted(order[1]) == list(range(16))
    assert order[0] != order[1]
    assert order[0] != list(range(16))


def test_another_seed_gives_another_order(make_config):
    assert _sample_order(make_config, seed=5)[0] != _sample_order(make_config, seed=6)[0]


def test_without_shuffle_the_order_is_the_dataset_order(make_config):
    assert _sample_order(make_config, seed=5, shuffle=False) == {
        0: list(range(16)),
        1: list(range(16)),
    }


def test_epoch_sampler_start_yields_the_tail_of_the_same_order():
    sampler = EpochSampler(10, seed=3)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=4)
    assert list(sampler) == full[4:]
    assert sorted(full) == list(range(10))
    sampler.set_epoch(3)
    assert list(sampler) != full
    assert len(sampler) == 10


def test_epoch_sampler_gives_ranks_disjoint_equal_shares():
    shares = [list(EpochSampler(11, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 5
    assert not set(shares[0]) & set(shares[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"length": 0}, "non-empty"), ({"length": 4, "rank": 2, "world_size": 2}, "rank must lie")],
)
def test_epoch_sampler_rejects_impossible_settings(kwargs, match):
    length = kwargs.pop("length")
    with pytest.raises(ValueError, match=match):
        EpochSampler(length, **kwargs)
