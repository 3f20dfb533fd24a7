"""The learning-rate range test: the suggestion on a problem whose best rate is known,
the caller's model and optimizer untouched, the plot, the command."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from hookloop import Config, Trainer
from hookloop.tune.lr_find import lr_find, smooth, steepest_descent, sweep_rates

N, D = 256, 8


def quadratic() -> TensorDataset:
    """Least squares with orthogonal, equally scaled features: the loss's Hessian is
    ``2/N X^T X = 2 I``, so every direction has curvature L = 2 and SGD's best rate
    (one full-batch step lands on the minimum) is 1/L = 0.5."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(N, D, generator=g))
    x = q * N**0.5
    return TensorDataset(x, x @ torch.randn(D, 1, generator=g))


def sgd_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Trainer:
    cfg = Config()
    cfg.data.batch_size = N  # full batch: the step is exact gradient descent
    cfg.train.device, cfg.train.handle_signals, cfg.train.log_every = "cpu", False, 0
    cfg.train.max_steps, cfg.train.clip_grad_norm = 500, None
    return Trainer(model, optimizer, train_data=quadratic(),
                   loss_fn=torch.nn.functional.mse_loss, config=cfg)  # fmt: skip


def test_the_hessian_is_what_the_test_says():
    x = quadratic().tensors[0]
    assert torch.linalg.eigvalsh(2 * x.T @ x / N).max().item() == pytest.approx(2.0, rel=1e-4)


def test_the_suggestion_is_within_three_of_the_best_rate_and_nothing_is_changed(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.123, momentum=0.9)
    model(torch.ones(1, D)).sum().backward()  # give the optimizer a momentum buffer ...
    optimizer.step()
    optimizer.zero_grad()  # ... so that its state is worth comparing
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    momentum = optimizer.state[model.weight]["momentum_buffer"].clone()
    rng = torch.get_rng_state()
    plain = torch.optim.SGD(model.parameters(), lr=0.123)  # the sweep's own: no momentum

    result = lr_find(lambda: sgd_trainer(model, plain), min_lr=1e-4, max_lr=10.0,
                     steps=100, plot=tmp_path / "plots" / "lr.png")  # fmt: skip

    assert result.stop_reason == "diverged" and len(result.lrs) < 100
    assert result.suggestion is not None
    assert 0.5 / 3 < result.suggestion < 0.5 * 3, result.suggestion
    assert len(result.lrs) == len(result.losses) == len(result.smoothed)
    assert result.lrs == sorted(result.lrs) and result.lrs[0] == pytest.approx(1e-4)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name  # bit for bit
    assert torch.equal(optimizer.state[model.weight]["momentum_buffer"], momentum)
    assert plain.param_groups[0]["lr"] == 0.123 and not plain.state
    assert torch.equal(torch.get_rng_state(), rng)
    png = (tmp_path / "plots" / "lr.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_the_pure_parts():
    assert sweep_rates(1e-3, 1.0, 4) == pytest.approx([1e-3, 1e-2, 1e-1, 1.0])
    # bias correction: a constant loss stays itself from the first step
    assert smooth([2.0] * 5, 0.98) == pytest.approx([2.0] * 5)
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 + 1.5) / 0.75])
    assert steepest_descent([1, 2], [1.0, 0.5]) is None  # too few points to read a slope
    curve = [math.exp(-k) if k < 6 else 1.0 for k in range(10)]  # falls, then flat
    # equal falls of log(loss) over ever closer log(lr): the last fall is the steepest
    assert steepest_descent(list(range(1, 11)), curve) == 5


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"min_lr": 1.0, "max_lr": 0.1}, "0 < min_lr < max_lr"),
        ({"steps": 5000}, "steps must be an integer from 3 to 500"),
        ({"beta": 1.0}, r"beta must be in \[0, 1\)"),
        ({"diverge": 1.0}, "diverge must be > 1"),
    ],
)
def test_arguments_are_checked(kwargs, says):
    with pytest.raises(ValueError, match=says):
        lr_find(lambda: None, **kwargs)


def test_a_trainer_itself_is_refused_with_what_to_pass():
    trainer = sgd_trainer(torch.nn.Linear(D, 1), None)
    with pytest.raises(TypeError, match=r"lr_find\(lambda: Trainer\(\.\.\.\)\)"):
        lr_find(trainer)


def test_the_command_prints_the_suggestion_and_writes_the_plot(tmp_path):
    plot = tmp_path / "lr.png"
    done = subprocess.run(
        [sys.executable, "-m", "hookloop", "lr-find", "--recipe", "mlp-regression",
         "--min-lr", "1e-5", "--max-lr", "10", "--steps", "40", "--plot", str(plot),
         "data.batch_size=32"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "suggested learning rate:" in done.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"
