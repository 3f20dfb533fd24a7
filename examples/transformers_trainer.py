"""transformers' Trainer on hookloop: the same Trainer, TrainingArguments and callbacks.

    python examples/transformers_trainer.py [OUT_DIR]

Code written for ``transformers.Trainer`` runs once ``from transformers import ...``
reads ``from hookloop.compat.hf import ...`` (transformers itself is not needed). The
model returns its loss the way transformers' models do (``model(**batch)["loss"]``), and a
``TrainerCallback`` stops the run from ``on_evaluate``. HF's ``checkpoint-N`` folders go
to OUT_DIR (a temporary directory when none is given).
"""

import sys
import tempfile

import torch

from hookloop.compat.hf import Trainer, TrainerCallback, TrainingArguments


class Regressor(torch.nn.Module):
    """A model with transformers' calling convention: keyword inputs, ``"loss"`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, x, labels=None):
        out = self.net(x)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


class StopBelow(TrainerCallback):
    """transformers' callback API: (args, state, control, **kwargs), flags on control."""

    def __init__(self, target: float) -> None:
        self.target = target

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        print(f"step {state.global_step}: eval_loss {metrics['eval_loss']:.4f}")
        if metrics["eval_loss"] < self.target:
            control.should_training_stop = True


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return [{"x": xi, "labels": xi.sum(dim=0, keepdim=True) / 2} for xi in x]


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=16,
        learning_rate=0.01,
        max_steps=60,
        eval_strategy="steps",
        eval_steps=10,
        logging_steps=10,
        save_steps=20,
        disable_tqdm=True,  # PrinterCallback: one plain line per log
    )
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=make_data(256, seed=0),
        eval_dataset=make_data(64, seed=1),
        callbacks=[StopBelow(target=0.05)],
    )
    output = trainer.train()
    print(f"global_step {output.global_step}, train_loss {output.training_loss:.4f}")
    print(f"log_history: {len(trainer.state.log_history)} entries; files in {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hookloop-hf-"))
