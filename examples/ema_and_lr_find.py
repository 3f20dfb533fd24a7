"""Find a learning rate with the range test, then train with it and an EMA of the weights,
logging to MLflow.

    python examples/ema_and_lr_find.py [OUT_DIR]

Sweeps the rate of a small regression model on the CPU (the model is left as it was),
trains 60 steps at the suggested rate with EMA(decay=0.9), evaluating with the averaged
weights, and writes the sweep's plot, the run's checkpoints and its MLflow store
(OUT_DIR/mlruns: `mlflow ui --backend-store-uri OUT_DIR/mlruns`) under OUT_DIR (a
temporary directory when none is given).
"""

import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from hookloop import Config, Trainer
from hookloop.callbacks import EMA
from hookloop.tune import lr_find


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) / 2 + 0.05 * torch.randn(n, 1, generator=g))


def make_config(max_steps: int, lr: float) -> Config:
    config = Config()
    config.train.max_steps, config.train.eval_every, config.train.log_every = max_steps, 20, 0
    config.data.batch_size, config.optimizer.lr = 16, lr
    return config


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    train, evaluate = make_data(512, seed=0), make_data(64, seed=1)

    def sweep_trainer() -> Trainer:  # no out_dir: the sweep writes no run files
        return Trainer(model, train_data=train, loss_fn=torch.nn.functional.mse_loss,
                       config=make_config(200, 1e-3), default_callbacks=False)  # fmt: skip

    found = lr_find(sweep_trainer, min_lr=1e-5, max_lr=10.0, steps=80,
                    plot=Path(out_dir) / "lr_find.png")  # fmt: skip
    print(f"lr-find: suggested {found.suggestion:.3g} after {len(found.lrs)} steps "
          f"({found.stop_reason})")  # fmt: skip

    ema, config = EMA(decay=0.9), make_config(60, found.suggestion)
    config.logging.mlflow = True  # params, metrics by step, config.yaml: OUT_DIR/mlruns
    trainer = Trainer(model, train_data=train, eval_data=evaluate, callbacks=[ema],
                      loss_fn=torch.nn.functional.mse_loss, config=config,
                      out_dir=out_dir)  # fmt: skip
    result = trainer.train()
    print(f"trained {result.step} steps: eval_loss with the EMA weights "
          f"{result.metrics['eval_loss']:.4f} ({ema.updates} averaging updates)")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-ema-"))
