"""The forward-step protocol and the three loss patterns, checked against hand-computed numbers."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset

from hookloop import Callback, Config, TrainConfig, Trainer
from hookloop.loop.logbook import LossWindow, row_means
from hookloop.loop.stepper import FiniteCheck, gradient_clearer
from hookloop.step import LossReducer, default_forward_step
from hookloop.testing import TinyModel, ToyData


class Linear3(torch.nn.Module):
    """y = x @ w + b with fixed, distinct weights (3 features -> 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([[0.5, -1.0, 0.25]]))
            self.lin.bias.fill_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Capture(Callback):
    """Keeps each step's loss_dict (as floats) and the parameters before the first step."""

    def __init__(self) -> None:
        self.losses: list[dict[str, float]] = []
        self.start: list[torch.Tensor] = []

    def on_train_start(self, ctx):
        self.start = [p.detach().clone() for p in ctx.model.parameters()]

    def on_train_step_end(self, ctx):
        self.losses.append({k: float(v) for k, v in ctx.loss_dict.items()})


def _cpu_config(**train):
    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device = "cpu"
    cfg.train.handle_signals = False
    cfg.train.log_every = 0
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _one_step(model, batches, forward_step):
    """Train one optimizer step over ``batches`` (accumulated) with SGD lr=1, no clipping."""
    capture = Capture()
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        train_data=batches,
        config=_cpu_config(max_steps=1, grad_accum=len(batches), clip_grad_norm=None),
        callbacks=[capture],
        forward_step=forward_step,
    ).train()
    deltas = [
        before - p.detach() for before, p in zip(capture.start, model.parameters(), strict=True)
    ]
    return capture.losses[0], deltas


def _expected_grads(loss_of_model) -> list[torch.Tensor]:
    reference = Linear3()
    loss = loss_of_model(reference)
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    return [g.detach() for g in grads]


def _assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.allclose(a, e, atol=1e-6, rtol=1e-5), (a, e)


# -- pattern 1: (loss, meta) ---------------------------------------------------------------


def _mean_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]


def _mean_step(data_iterator, model):
    x, y = next(data_iterator)
    out = model(x)

    def loss_func(out):
        return torch.nn.functional.mse_loss(out, y), {"mae": (out - y).abs().mean()}

    return out, loss_func


def test_mean_pattern_with_accumulation_reports_and_descends_the_mean_loss():
    batches = _mean_batches()
    losses, deltas = _one_step(Linear3(), batches, _mean_step)

    def mean_loss(model):
        parts = [torch.nn.functional.mse_loss(model(x), y) for x, y in batches]
        return (parts[0] + parts[1]) / 2

    with torch.no_grad():
        ref = Linear3()
        per_batch = [torch.nn.functional.mse_loss(ref(x), y).item() for x, y in batches]
        mae = [(ref(x) - y).abs().mean().item() for x, y in batches]
    assert losses["loss"] == pytest.approx(sum(per_batch) / 2, rel=1e-6)
    assert losses["mae"] == pytest.approx(sum(mae) / 2, rel=1e-6)
    _assert_all_close(deltas, _expected_grads(mean_loss))  # SGD lr=1: delta == gradient


# -- pattern 2: (loss_sum, num_tokens, meta) -----------------------------------------------


def _token_batches():
    """Two micro-batches of 2 sequences x 6 positions, with 3 and 9 valid tokens."""
    g = torch.Generator().manual_seed(5)
    masks = [torch.zeros(2, 6), torch.zeros(2, 6)]
    masks[0][0, :3] = 1
    masks[1][0, :6] = 1
    masks[1][1, :3] = 1
    return [
        (torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 1, generator=g), mask)
        for mask in masks
    ]


def _token_losses(model, batch):
    x, y, mask = batch
    per_token = ((model(x) - y) ** 2).sum(-1) * mask
    return per_token.sum(), mask.sum()


def _token_step(tokens_as):
    def forward_step(state, data_iterator, model):
        x, y, mask = next(data_iterator)
        out = model(x)

        def loss_func(out):
            loss_sum = (((out - y) ** 2).sum(-1) * mask).sum()
            tokens = mask.sum()
            n = int(tokens.item())
            # [numerator, denominator] is a ratio of sums; a scalar is token-weighted
            meta = {"hits": torch.tensor([n // 3, n]), "scale": torch.tensor(n / 3.0)}
            return loss_sum, tokens if tokens_as == "tensor" else n, meta

        return out, loss_func

    return forward_step


@pytest.mark.parametrize("tokens_as", ["tensor", "int"])
def test_token_pattern_weights_micro_batches_by_their_tokens(tokens_as):
    batches = _token_batches()
    assert [int(b[2].sum()) for b in batches] == [3, 9]

    losses, deltas = _one_step(Linear3(), batches, _token_step(tokens_as))

    def token_loss(model):
        sums = [_token_losses(model, b)[0] for b in batches]
        return (sums[0] + sums[1]) / 12

    with torch.no_grad():
        ref = Linear3()
        s1, s2 = (_token_losses(ref, b)[0].item() for b in batches)
    assert losses["loss"] == pytest.approx((s1 + s2) / 12, rel=1e-6)
    assert losses["loss"] != pytest.approx((s1 / 3 + s2 / 9) / 2, rel=1e-3)  # not mean of means
    assert losses["hits"] == pytest.approx((1 + 3) / (3 + 9))
    assert losses["scale"] == pytest.approx((3 * 1.0 + 9 * 3.0) / 12)
    _assert_all_close(deltas, _expected_grads(token_loss))


def test_token_pattern_in_evaluation_is_total_sum_over_total_tokens():
    batches = _token_batches()
    trainer = Trainer(
        Linear3(), train_data=batches, config=_cpu_config(), forward_step=_token_step("tensor")
    )
    metrics = trainer.evaluate(batches)
    with torch.no_grad():
        ref = Linear3()
        s1, s2 = (_token_losses(ref, b)[0].item() for b in batches)
    assert metrics["eval_loss"] == pytest.approx((s1 + s2) / 12, rel=1e-6)
    assert metrics["eval_hits"] == pytest.approx(4 / 12)


# -- the reducer on its own ----------------------------------------------------------------


def test_reducer_mean_pattern_averages_loss_and_meta():
    reducer = LossReducer()
    reducer.add((torch.tensor(1.0), {"acc": 0.5, "pair": torch.tensor([1.0, 2.0])}))
    reducer.add((torch.tensor(3.0), {"acc": 1.0, "pair": torch.tensor([3.0, 6.0])}))
    result = reducer.result()
    assert float(result["loss"]) == 2.0
    assert float(result["acc"]) == 0.75
    assert float(result["pair"]) == pytest.approx(4 / 8)
    assert reducer.count == 2 and reducer.tokens is None


def test_reducer_accepts_a_bare_scalar_tensor():
    reducer = LossReducer()
    loss, tokens = reducer.add(torch.tensor(2.5))
    assert float(loss) == 2.5 and tokens is None
    assert set(reducer.result()) == {"loss"}


def test_reducer_two_element_meta_is_a_ratio_of_sums_not_a_mean_of_ratios():
    reducer = LossReducer()
    reducer.add((torch.tensor(2.0), 4, {"acc": torch.tensor([3.0, 4.0])}))
    reducer.add((torch.tensor(6.0), 6, {"acc": torch.tensor([1.0, 6.0])}))
    result = reducer.result()
    assert float(result["loss"]) == pytest.approx(8 / 10)
    assert float(result["acc"]) == pytest.approx(4 / 10)
    assert reducer.tokens == 10


def _window_of_ten_steps() -> tuple[LossWindow, list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(3)
    steps = [{"loss": torch.rand((), generator=gen) * 7, "acc": torch.rand((), generator=gen)}
             for _ in range(10)]  # fmt: skip
    window = LossWindow(torch.device("cpu"))
    for d in steps:
        window.add(d, None)
    return window, steps


def test_the_window_mean_of_each_key_equals_that_keys_own_mean_to_the_bit():
    """``LossWindow.means()``, on the device (the HF dialect logs HF's keys from it)."""
    window, steps = _window_of_ten_steps()
    keys, means = window.means()
    assert keys == ["loss", "acc"]
    for key, mean in zip(keys, means, strict=True):
        assert mean.item() == torch.stack([d[key] for d in steps]).mean().item()
    window.add({"loss": torch.tensor(1.0)}, None)  # the latest step's keys are logged
    keys, means = window.means()
    losses = [*(d["loss"] for d in steps), torch.tensor(1.0)]
    assert keys == ["loss"] and means.tolist() == [torch.stack(losses).mean().item()]


def test_a_logged_loss_is_the_exact_mean_of_the_steps_losses_since_the_last_log(make_config):
    """The log reads every step's loss back in one transfer and averages on the host:
    each logged value is the exactly summed mean of its steps' float32 values."""
    import math

    window, steps = _window_of_ten_steps()
    keys, values, n = window.stacked()
    assert keys == ["loss", "acc"] and n == 10
    means = row_means(values.tolist(), n)
    for key, mean in zip(keys, means, strict=True):
        assert mean == math.fsum(d[key].item() for d in steps) / 10
    window.add({"loss": torch.tensor(1.0, dtype=torch.float64)}, None)  # mixed: means on device
    keys, values, n = window.stacked()
    assert keys == ["loss"] and n == 1 and values.shape == (1,)

    recorded: list[float] = []
    logged: list[float] = []

    class Record(Callback):
        def on_train_step_end(self, ctx) -> None:
            recorded.append(ctx.loss_dict["loss"].item())

        def on_log(self, ctx) -> None:
            logged.append(ctx.logs["loss"])

    Trainer(
        TinyModel(),
        train_data=torch.utils.data.DataLoader(ToyData(n=48), batch_size=4),
        loss_fn=torch.nn.functional.mse_loss,
        config=make_config(max_steps=12, log_every=5),
        callbacks=[Record()],
    ).train()
    assert logged == [math.fsum(recorded[i : i + 5]) / 5 for i in (0, 5)]


def test_the_default_forward_steps_loss_func_returns_loss_and_meta_for_wrappers():
    # Code that wraps it (e.g. to poison one step's loss) indexes the (loss, meta) pair.
    model, mse = torch.nn.Linear(3, 1), torch.nn.MSELoss()
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    step = default_forward_step(mse, torch.device("cpu"))
    output, loss_func = step(None, iter([(x, y)]), model)
    loss, meta = loss_func(output)
    assert meta == {} and torch.equal(loss, mse(model(x), y))


def test_reducer_refuses_mixed_patterns():
    reducer = LossReducer()
    reducer.add((torch.tensor(1.0), {}))
    with pytest.raises(TypeError, match="mixed"):
        reducer.add((torch.tensor(1.0), 3, {}))


def test_empty_reducer_has_no_result():
    assert LossReducer().result() == {}


@pytest.mark.parametrize(
    "garbage",
    [
        "a string",
        [torch.tensor(1.0), {}],
        (1.0, {}),
        (torch.tensor(1.0), "meta"),
        (torch.tensor(1.0), 2, 3, {}),
        None,
    ],
    ids=["str", "list", "float-loss", "str-meta", "4-tuple", "None"],
)
def test_loss_func_returning_garbage_raises_a_type_error_naming_the_patterns(garbage, make_config):
    def forward_step(data_iterator, model):
        x, _ = next(data_iterator)
        return model(x), lambda out: garbage

    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(8),
        config=make_config(max_steps=1),
        forward_step=forward_step,
    )
    patterns = r"\(loss, meta_dict\), \(loss_sum, num_tokens, meta_dict\)"
    with pytest.raises(TypeError, match=patterns):
        trainer.train()


def test_a_non_scalar_loss_is_refused_with_the_patterns_message(make_config):
    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(8),
        config=make_config(max_steps=1),
        loss_fn=lambda out, target: (out - target) ** 2,  # forgot the .mean()
    )
    with pytest.raises(TypeError, match="loss_func"):
        trainer.train()


# -- pattern 3: inference via predict() ----------------------------------------------------


def test_predict_collects_whatever_loss_func_returns(make_config):
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.5))
    modes: list[bool] = []

    def forward_step(data_iterator, model):
        x, _ = next(data_iterator)
        modes.append(model.training)
        out = model(x)
        return out, lambda out: {"label": out.argmax(dim=1), "n": len(out)}

    trainer = Trainer(model, train_data=ToyData(8), config=make_config(), forward_step=forward_step)
    model.train()
    results = trainer.predict(ToyData(n=10, seed=4))  # eval batch size 4: 4 + 4 + 2

    assert [r["n"] for r in results] == [4, 4, 2]
    with torch.no_grad():
        model.eval()
        expected = model(ToyData(n=10, seed=4).x).argmax(dim=1)
    assert torch.equal(torch.cat([r["label"] for r in results]), expected)
    assert modes == [False, False, False]  # evaluation mode, no dropout
    assert trainer.predict([(torch.ones(1, 4), None)])[0]["n"] == 1  # plain iterables too


def test_predict_restores_training_mode(make_config):
    model = TinyModel()

    def forward_step(data_iterator, model):
        x, _ = next(data_iterator)
        return model(x), lambda out: out

    trainer = Trainer(model, train_data=ToyData(8), config=make_config(), forward_step=forward_step)
    model.train()
    trainer.predict(ToyData(4))
    assert model.training


# -- forward_step signatures ---------------------------------------------------------------


def _two_arg(data_iterator, model):
    x, y = next(data_iterator)
    out = model(x)
    return out, lambda out: (torch.nn.functional.mse_loss(out, y), {})


def _three_arg(state, data_iterator, model):
    return _two_arg(data_iterator, model)


class CallableStep:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def __call__(self, state, data_iterator, model):
        self.steps.append(state.step)
        return _two_arg(data_iterator, model)


def _train_params(step, make_config):
    model = TinyModel()
    config = make_config(max_steps=3)
    Trainer(model, train_data=ToyData(16), config=config, forward_step=step).train()
    return [p.detach() for p in model.parameters()]


def test_both_forward_step_signatures_train_identically(make_config):
    two = _train_params(_two_arg, make_config)
    three = _train_params(_three_arg, make_config)
    via_loss_fn = TinyModel()
    Trainer(
        via_loss_fn,
        train_data=ToyData(16),
        config=make_config(max_steps=3),
        loss_fn=TinyModel.loss_fn,
    ).train()
    for a, b, c in zip(two, three, via_loss_fn.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c.detach())
    assert not torch.equal(two[0], next(TinyModel().parameters()))  # it did train


def test_forward_step_receives_the_train_state(make_config):
    step = CallableStep()
    Trainer(
        TinyModel(), train_data=ToyData(16), config=make_config(max_steps=3), forward_step=step
    ).train()
    assert step.steps == [1, 2, 3]


@pytest.mark.parametrize("bad", [lambda model: None, lambda: None])
def test_forward_step_with_a_wrong_signature_is_refused_when_built(bad, make_config):
    signatures = r"\(state, data_iterator, model\) or \(data_iterator, model\)"
    with pytest.raises(TypeError, match=signatures):
        Trainer(TinyModel(), train_data=ToyData(8), config=make_config(), forward_step=bad)


def test_forward_step_must_be_callable(make_config):
    with pytest.raises(TypeError, match="forward_step must be callable"):
        Trainer(TinyModel(), train_data=ToyData(8), config=make_config(), forward_step=42)


# -- the default forward step --------------------------------------------------------------


class DictData(Dataset):
    """ToyData as dict samples {"x", "y"}."""

    def __init__(self, n: int) -> None:
        self.inner = ToyData(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return {"x": x, "y": y}


class LossInside(torch.nn.Module):
    """Computes its own loss; returns it as a tensor, a dict or an object with .loss."""

    def __init__(self, returns: str) -> None:
        super().__init__()
        self.net = TinyModel()
        self.returns = returns
        self.computed: list[float] = []

    def forward(self, x, y):
        pred = self.net(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        self.computed.append(loss.item())
        if self.returns == "tensor":
            return loss
        if self.returns == "dict":
            return {"loss": loss, "logits": pred}
        return SimpleNamespace(loss=loss, logits=pred)


@pytest.mark.parametrize("returns", ["tensor", "dict", "object"])
def test_default_step_with_dict_batches_uses_the_models_own_loss(returns, make_config):
    model = LossInside(returns)
    capture = Capture()
    trainer = Trainer(
        model, train_data=DictData(16), config=make_config(max_steps=3), callbacks=[capture]
    )
    trainer.train()
    assert [d["loss"] for d in capture.losses] == pytest.approx(model.computed)
    assert trainer.state.samples == 12


def test_default_step_unpacks_tuple_batches_without_loss_fn(make_config):
    model = LossInside("object")
    capture = Capture()
    Trainer(
        model, train_data=ToyData(16), config=make_config(max_steps=2), callbacks=[capture]
    ).train()
    assert [d["loss"] for d in capture.losses] == pytest.approx(model.computed)


def test_default_step_without_a_loss_explains_the_options(make_config):
    trainer = Trainer(TinyModel(), train_data=[torch.ones(2, 4)], config=make_config(max_steps=1))
    with pytest.raises(TypeError, match="could not find a loss"):
        trainer.train()


def test_loss_fn_needs_input_target_batches(make_config):
    trainer = Trainer(
        TinyModel(), train_data=DictData(8), config=make_config(max_steps=1), loss_fn=lambda o, t: o
    )
    with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
        trainer.train()


class _GraphWatch:
    """A forward step that keeps weak references to each step's loss and hidden activation,
    and records, at every forward, which of the previous step's are still alive."""

    def __init__(self) -> None:
        self.losses: list[weakref.ref] = []
        self.hidden: list[weakref.ref] = []
        self.seen: list[tuple[bool, bool]] = []  # (previous loss alive, previous hidden alive)

    def __call__(self, data_iterator, model):
        if self.losses:
            self.seen.append((self.losses[-1]() is not None, self.hidden[-1]() is not None))
        x, y = next(data_iterator)
        hidden = model.net[1](model.net[0](x))  # the activation ReLU's backward saves
        out = model.net[2](hidden)
        self.hidden.append(weakref.ref(hidden))

        def loss_func(output):
            loss = torch.nn.functional.mse_loss(output, y)
            self.losses.append(weakref.ref(loss))
            return loss, {}

        return out, loss_func


def test_the_last_loss_outlives_its_step_but_not_its_activations_nor_the_run():
    """The loop holds each step's loss (and so its graph) until the next forward, as a
    hand-written loop's `loss` variable does: autograd then reuses each parameter's gradient
    accumulator instead of building it again. Backward has already freed what the graph
    saved, so the step's activations are gone; after train() nothing is held."""
    watch = _GraphWatch()
    trainer = Trainer(
        TinyModel(),
        train_data=torch.utils.data.DataLoader(ToyData(n=40), batch_size=8),
        forward_step=watch,
        config=TrainConfig(max_steps=5, log_every=0, device="cpu"),
    )
    trainer.train()
    assert watch.seen == [(True, False)] * 4
    gc.collect()
    assert watch.losses[-1]() is None


# -- clearing gradients after the update ---------------------------------------------------------


def _with_gradients(params):
    for p in params:
        p.grad = torch.ones_like(p)


def test_the_gradient_clearer_sets_every_groups_gradients_to_none_after_load_and_add_group():
    """As zero_grad(set_to_none=True): every parameter of every group, including groups
    added later and the groups load_state_dict puts in place of the old list."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    first, second = list(model[0].parameters()), list(model[1].parameters())
    opt = torch.optim.SGD(first, lr=0.1)
    clear = gradient_clearer(opt)
    opt.add_param_group({"params": second, "lr": 0.01})
    _with_gradients(first + second)
    clear()
    assert all(p.grad is None for p in first + second)
    opt.load_state_dict(opt.state_dict())  # replaces opt.param_groups with a new list
    _with_gradients(first + second)
    clear()
    assert all(p.grad is None for p in first + second)


class _CountingSGD(torch.optim.SGD):
    """An optimizer with its own zero_grad, which records each call's set_to_none."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.calls: list[bool] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls.append(set_to_none)
        super().zero_grad(set_to_none=set_to_none)


def _train_three_steps(model, opt, make_config) -> None:
    Trainer(
        model,
        opt,
        train_data=torch.utils.data.DataLoader(ToyData(n=24), batch_size=8),
        loss_fn=torch.nn.functional.mse_loss,
        config=make_config(max_steps=3),
    ).train()


def test_an_optimizer_subclasss_own_zero_grad_is_called_after_every_step(make_config):
    model = TinyModel()
    opt = _CountingSGD(model.parameters(), lr=0.01)
    _train_three_steps(model, opt, make_config)
    assert opt.calls == [True, True, True]


def test_a_zero_grad_set_on_the_optimizer_instance_is_called_after_every_step(make_config):
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls: list[bool] = []
    stock = opt.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        calls.append(set_to_none)
        stock(set_to_none=set_to_none)

    opt.zero_grad = zero_grad  # type: ignore[method-assign]
    _train_three_steps(model, opt, make_config)
    assert calls == [True, True, True]


def test_a_profiled_run_shows_each_optimizer_step_in_its_trace(make_config):
    """The update is torch's public ``optimizer.step()``: a profiler's trace holds its
    range once per step."""
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _train_three_steps(model, opt, make_config)
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#SGD.step") == 3


def test_without_a_profiler_the_loop_clears_gradients_without_torchs_zero_grad(
    make_config, monkeypatch
):
    """The saving itself: torch's zero_grad (and its profiler range) is not called per step,
    yet every gradient ends the step as None."""
    stock, calls = torch.optim.Optimizer.zero_grad, []

    def counted(self, set_to_none: bool = True) -> None:
        calls.append(set_to_none)
        stock(self, set_to_none=set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", counted)
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train_three_steps(model, opt, make_config)
    assert calls == []
    assert all(p.grad is None for p in model.parameters())


# -- applying the update without torch's step wrapper ----------------------------------------------


def _raw_weights(steps: int = 3) -> list[torch.Tensor]:
    """TinyModel after ``steps`` SGD updates on ToyData in a hand-written loop."""
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(ToyData(n=24), batch_size=8)
    for x, y in list(data)[:steps]:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_the_update_calls_optimizer_step_and_lands_on_the_hand_written_loops_weights(
    make_config, monkeypatch
):
    """The loop updates through the optimizer's public step (torch's wrapper opens its
    record_function range on each call, as in the hand-written loop), to the same weights."""
    opened: list[str] = []
    stock = torch.autograd.profiler.record_function

    class Counted(stock):  # type: ignore[misc, valid-type]
        def __init__(self, name: str, *args, **kwargs) -> None:
            opened.append(name)
            super().__init__(name, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Counted)
    expected = _raw_weights()
    assert opened.count("Optimizer.step#SGD.step") == 3  # the hand-written loop opens them
    opened.clear()
    torch.manual_seed(0)
    model = TinyModel()
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        train_data=torch.utils.data.DataLoader(ToyData(n=24), batch_size=8),
        loss_fn=torch.nn.functional.mse_loss,
        config=make_config(max_steps=3, clip_grad_norm=None, skip_nonfinite=False),
    ).train()
    assert [n for n in opened if n.startswith("Optimizer.")] == ["Optimizer.step#SGD.step"] * 3
    for got, want in zip(model.parameters(), expected, strict=True):
        assert torch.equal(got.detach(), want)


def test_step_hooks_on_the_optimizer_and_global_ones_run_around_every_update(make_config):
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[str] = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: seen.append("pre")),
        opt.register_step_post_hook(lambda o, a, k: seen.append("post")),
    ]
    _train_three_steps(model, opt, make_config)
    assert seen == ["pre", "post"] * 3
    for handle in handles:
        handle.remove()
    seen.clear()
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: seen.append("global post")),
    ]
    try:
        _train_three_steps(model, opt, make_config)
    finally:
        for handle in handles:
            handle.remove()
    assert seen == ["global pre", "global post"] * 3


def test_an_lr_scheduler_sees_its_optimizer_stepped_first_and_warns_nothing(make_config):
    """Torch's schedulers count optimizer.step() calls through a wrapper on the instance and
    warn when the scheduler steps first; the direct call keeps their mark."""
    import warnings

    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs: list[float] = []

    class Rates(Callback):
        def on_train_step_end(self, ctx) -> None:
            lrs.append(ctx.optimizer.param_groups[0]["lr"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        Trainer(
            model,
            opt,
            scheduler=scheduler,
            train_data=torch.utils.data.DataLoader(ToyData(n=24), batch_size=8),
            loss_fn=torch.nn.functional.mse_loss,
            config=make_config(max_steps=3),
            callbacks=[Rates()],
        ).train()
    assert lrs == [0.05, 0.025, 0.0125]
    assert opt._opt_called is True


class _StepCountingSGD(torch.optim.SGD):
    """An optimizer with its own step (torch wraps it too), which counts its calls."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.steps = 0

    def step(self, closure=None):  # type: ignore[override]
        self.steps += 1
        return super().step(closure)


def test_an_optimizer_subclasss_own_step_and_a_step_set_on_the_instance_are_called(make_config):
    model = TinyModel()
    opt = _StepCountingSGD(model.parameters(), lr=0.01)
    _train_three_steps(model, opt, make_config)
    assert opt.steps == 3
    plain = torch.optim.SGD(TinyModel().parameters(), lr=0.01)
    calls: list[int] = []
    stock = plain.step

    def step(closure=None):
        calls.append(1)
        return stock(closure)

    plain.step = step  # type: ignore[method-assign]
    _train_three_steps(TinyModel(), plain, make_config)
    assert calls == [1, 1, 1]


# -- the finiteness check ------------------------------------------------------------------


def _with(value: float, shape=(64, 32), at=(3, 4)) -> torch.Tensor:
    t = torch.randn(*shape)
    t[at] = value
    return t


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_finiteness_check_finds_one_bad_element_in_any_gradient(bad):
    check = FiniteCheck(torch.device("cpu"))
    finite = [torch.tensor(0.5), torch.randn(64, 32), torch.randn(64)]
    assert not check.any_nonfinite(finite, sharded=False)
    assert check.any_nonfinite([*finite, _with(bad)], sharded=False)
    assert check.any_nonfinite([torch.tensor(bad), *finite], sharded=False)
    assert check.any_nonfinite([_with(bad).t()], sharded=False)  # not contiguous
    assert check.any_nonfinite([_with(bad).to(torch.bfloat16)], sharded=False)  # by isfinite


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_steps_check_covers_its_loss_and_every_groups_gradients(bad):
    check = FiniteCheck(torch.device("cpu"))
    # The first group's parameters are float64: checked with isfinite, not summed.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt.add_param_group({"params": list(model[1].parameters()), "lr": 0.01})
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    loss = torch.tensor(0.5)
    assert not check.step_nonfinite(loss, None, opt, sharded=False)
    assert check.step_nonfinite(torch.tensor(bad), None, opt, sharded=False)
    model[1].bias.grad[0] = bad  # the second group's last gradient
    assert check.step_nonfinite(loss, None, opt, sharded=False)
    model[1].bias.grad = None  # a parameter without a gradient is left out
    assert not check.step_nonfinite(loss, None, opt, sharded=False)
    model[0].weight.grad[1, 1] = bad
    assert check.step_nonfinite(loss, None, opt, sharded=False)
    # A grad norm stands for the gradients: only it and the loss are read.
    assert not check.step_nonfinite(loss, torch.tensor(1.0), opt, sharded=False)
    assert check.step_nonfinite(loss, torch.tensor(bad), opt, sharded=False)


def test_the_finiteness_check_finds_inf_and_minus_inf_together_and_says_nothing():
    """Their sum is NaN, not 0: found, and no warning is raised on the way."""
    import warnings

    both = torch.randn(10)
    both[0], both[1] = float("inf"), -float("inf")
    check = FiniteCheck(torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        assert check.any_nonfinite([both], sharded=False)
        model = torch.nn.Linear(10, 1)
        model.weight.grad = both.view(1, 10).clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert check.step_nonfinite(torch.tensor(0.5), None, opt, sharded=False)
