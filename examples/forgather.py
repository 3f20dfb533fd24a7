"""Forgather's built-in callbacks and callback forms on hookloop, in one process.

    python examples/forgather.py [OUT_DIR]

A configuration written for Forgather builds its built-ins by name with Forgather's
arguments: here ``ProgressCallback`` (a table row per log), ``JsonLogger``
(``trainer_logs.json``) and ``DivergenceDetector`` (stops a run whose loss spikes), next
to a callback of your own in Forgather's ``on_log_step(self, state, logs)`` form. They
run in the HF dialect's ``Trainer``. Logs and checkpoints go to OUT_DIR (a temporary
directory when none is given).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from hookloop.compat.forgather import DivergenceDetector, JsonLogger, ProgressCallback
from hookloop.compat.hf import Trainer, TrainerCallback, TrainingArguments


class LossTimesTen(TrainerCallback):
    """Forgather's handler form: only the arguments it names, ``logs`` mutable."""

    def on_log_step(self, state, logs, **kwargs):
        if "loss" in logs:  # training logs; the run's final summary has train_loss instead
            logs["loss_x10"] = 10 * logs["loss"]  # every logger's on_log sees it


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": xi, "labels": xi.sum(dim=0, keepdim=True) / 2} for xi in x]


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=out_dir,
        logging_dir=str(Path(out_dir) / "logs"),
        per_device_train_batch_size=16,
        learning_rate=0.05,
        max_steps=30,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=15,
    )
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=make_data(256, 0),
        eval_dataset=make_data(64, 1),
        callbacks=[LossTimesTen(), JsonLogger(), DivergenceDetector(threshold=1.0, warmup=2)],
    )
    trainer.pop_callback(ProgressCallback)  # the default progress display: Forgather's
    trainer.add_callback(ProgressCallback(use_tqdm=False, header_interval=10))
    trainer.train()

    records = json.loads((Path(args.logging_dir) / "trainer_logs.json").read_text())
    logs = [r for r in records if "loss" in r]
    print(f"{len(records)} records in trainer_logs.json, {len(logs)} training logs; the last:")
    print(f"step {logs[-1]['global_step']}: loss_x10 {logs[-1]['loss_x10']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-forgather-"))
