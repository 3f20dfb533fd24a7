"""hookloop's own API: a Trainer, a model of yours, and a callback of your own.

    python examples/native.py [OUT_DIR]

Trains a small regression model on the CPU for 40 steps, evaluates every 10, and stops
early once the evaluation loss is below a target. Its checkpoints go to
OUT_DIR (a temporary directory when none is given).
"""

import sys
import tempfile

import torch
from torch.utils.data import TensorDataset

from hookloop import Callback, Config, DataConfig, OptimizerConfig, TrainConfig, Trainer


class StopWhenGoodEnough(Callback):
    """Prints each log and evaluation, and asks for a stop once eval_loss < target."""

    priority = 60  # lower runs earlier; the built-in loggers run at 100 and later

    def __init__(self, target: float) -> None:
        self.target = target

    def on_log(self, ctx):
        print(f"step {ctx.state.step}: loss {ctx.logs['loss']:.4f}")

    def on_eval_end(self, ctx):
        loss = ctx.metrics["eval_loss"]
        print(f"step {ctx.state.step}: eval_loss {loss:.4f}")
        if loss < self.target:
            ctx.control.request_stop(f"eval_loss {loss:.4f} < {self.target}")


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) / 2)  # y = sum(x) / 2


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = Config(
        train=TrainConfig(max_steps=40, log_every=10, eval_every=10),
        data=DataConfig(batch_size=16),
        optimizer=OptimizerConfig(lr=0.01),
    )
    trainer = Trainer(
        model,
        train_data=make_data(256, seed=0),
        eval_data=make_data(64, seed=1),
        loss_fn=torch.nn.functional.mse_loss,
        config=config,
        callbacks=[StopWhenGoodEnough(target=0.05)],
        out_dir=out_dir,
    )
    result = trainer.train()
    print(f"stopped at step {result.step}: {result.stop_reason} (exit code {result.exit_code})")
    print(f"run files in {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-native-"))
