"""The HPO trainer's callbacks on hookloop: TrainingCallback, CallbackRunner, built-ins.

    python examples/hpo_trainer.py [OUT_DIR]

Callbacks written for the HPO trainer (``TrainingCallback`` with hooks
``(self, trainer, **fields)`` and a ``priority``) run in a hookloop ``Trainer`` through
``CallbackRunner(...).native()``, interleaved by priority with native callbacks. Here a
callback of your own keeps the best validation loss on the trainer, and the HPO
trainer's ``EarlyStoppingCallback`` ends the run once it stops improving. Checkpoints
go to OUT_DIR (a temporary directory when none is given).
"""

import sys
import tempfile

import torch
from torch.utils.data import TensorDataset

from hookloop import Config, DataConfig, OptimizerConfig, TrainConfig, Trainer
from hookloop.compat.hpo import CallbackRunner, EarlyStoppingCallback, TrainingCallback


class BestVal(TrainingCallback):
    """Keeps the best val_loss as ``trainer._best_val_loss`` (saved in checkpoints)."""

    priority = 60

    def on_val_end(self, trainer, epoch, val_loss, metrics, **kwargs):
        if val_loss < getattr(trainer, "_best_val_loss", float("inf")):
            trainer._best_val_loss = val_loss

    def on_epoch_end(self, trainer, epoch, train_loss, val_loss, metrics, lr, **kwargs):
        best = trainer._best_val_loss
        print(f"epoch {epoch}: train_loss {train_loss:.4f} val_loss {val_loss:.4f} best {best:.4f}")


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    noise = 0.2 * torch.randn(n, 1, generator=g)  # so the val loss levels off
    return TensorDataset(x, x.sum(dim=1, keepdim=True) / 2 + noise)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    stopper = EarlyStoppingCallback(patience=2, min_delta=0.05)  # 5 % better than the best
    runner = CallbackRunner([BestVal(), stopper])
    config = Config(
        train=TrainConfig(max_epochs=40, log_every=0),
        data=DataConfig(batch_size=32),
        optimizer=OptimizerConfig(lr=0.01),
    )
    trainer = Trainer(
        model,
        train_data=make_data(128, 0),
        eval_data=make_data(64, 1),
        loss_fn=torch.nn.functional.mse_loss,
        config=config,
        callbacks=runner.native(),
        out_dir=out_dir,
    )
    result = trainer.train()
    print(f"ended after epoch {result.epoch} (step {result.step}): {result.stop_reason}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-hpo-"))
