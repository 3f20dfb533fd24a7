"""hookloop next to the other training loops, on bench/loop.py's problem and clock.

The same tiny MLP, batch, optimizer and pre-generated data as ``bench/loop.py``; each
contender's ``x raw`` is its run over the mean of the two raw PyTorch runs around it,
in a fresh random order each round (medians over rounds). What each contender is:

- ``hookloop-bare`` / ``hookloop-default``: as in ``bench/loop.py``;
- ``ignite-bare``: ``create_supervised_trainer(model, opt, mse)`` run for one epoch;
- ``ignite-handlers``: the same plus what ``hookloop-default`` does in Ignite's terms:
  ``TerminateOnNan``, its tqdm ``ProgressBar`` and a TensorBoard ``OutputHandler`` every
  10 iterations (the bar and the event files go to a scratch directory);
- ``accelerate``: the raw loop through ``Accelerator.prepare`` and ``accelerator.backward``;
- ``hf-trainer``: ``transformers.Trainer`` with its defaults (gradient clipping at 1.0,
  the linear schedule, a log every 10 steps) on the same pre-made batches, no reports,
  no saves, no tqdm;
- ``lightning-lean``: ``lightning.Trainer`` with logger, checkpointing, progress bar and
  model summary off;
- ``lightning-default``: ``lightning.Trainer`` as it comes (progress bar, TensorBoard
  logger, the end-of-training checkpoint) and ``self.log("loss", ...)`` each step.

A contender whose package is not installed is left out and named under the table
(``pip install -e '.[bench]' -c constraints.txt`` installs them all). Each framework
builds its trainer before the clock starts; only its fit/run call is timed.

    python bench/frameworks.py               # 25 rounds of 2000 steps, ~7 min
    python bench/frameworks.py --quick       # 3 rounds of 500 steps
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

from _timing import CLOCKS, environment, format_table, median, quartiles, shuffled, time_ns
from loop import Prepared, Problem, prepare

HOOKLOOP = ("hookloop-bare", "hookloop-default")


def installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# -- the contenders ---------------------------------------------------------------------------


def prepare_other(name: str, problem: Problem, scratch: Path) -> Prepared:
    """Build ``name``'s trainer around a fresh copy of the problem's model; time nothing."""
    model, opt = problem.fresh()
    return OTHERS[name][1](name, problem, model, opt, scratch)


def _ignite(name: str, problem: Problem, model: nn.Module, opt: Any, scratch: Path) -> Prepared:
    from ignite.engine import Events, create_supervised_trainer
    from ignite.handlers import TerminateOnNan

    engine = create_supervised_trainer(model, opt, nn.MSELoss())
    close: Callable[[], None] = lambda: None  # noqa: E731
    if name == "ignite-handlers":
        from ignite.handlers import ProgressBar
        from ignite.handlers.tensorboard_logger import OutputHandler, TensorboardLogger

        engine.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
        bar_file = open(scratch / "ignite-bar.txt", "w")  # noqa: SIM115 (closed by close())
        ProgressBar(file=bar_file).attach(engine)
        board = TensorboardLogger(log_dir=str(scratch / "ignite-tb"))
        board.attach(
            engine,
            OutputHandler(tag="train", output_transform=lambda loss: {"loss": loss}),
            Events.ITERATION_COMPLETED(every=10),
        )

        def close() -> None:
            board.close()
            bar_file.close()

    return Prepared(lambda: engine.run(problem.data, max_epochs=1), model, close)


def _accelerate(name: str, problem: Problem, model: nn.Module, opt: Any, scratch: Path) -> Prepared:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    mse = nn.MSELoss()
    data = problem.data

    def loop() -> None:
        for x, y in data:
            loss = mse(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

    return Prepared(loop, model)


class _WithLoss(nn.Module):
    """What transformers.Trainer expects: keyword inputs in, ``{"loss": ...}`` out."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net, self.mse = net, nn.MSELoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.mse(self.net(x), labels)}


def _first(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return items[0]  # the dataset's items are whole batches already


def _hf_trainer(name: str, problem: Problem, model: nn.Module, opt: Any, scratch: Path) -> Prepared:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(scratch / "hf"),
        max_steps=len(problem.data),
        per_device_train_batch_size=1,
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    batches = [{"x": x, "labels": y} for x, y in problem.data]
    trainer = Trainer(
        model=_WithLoss(model),
        args=args,
        train_dataset=batches,  # type: ignore[arg-type]
        data_collator=_first,
        optimizers=(opt, None),
    )
    return Prepared(trainer.train, model)


def _lightning(name: str, problem: Problem, model: nn.Module, opt: Any, scratch: Path) -> Prepared:
    import lightning

    log_loss = name == "lightning-default"

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.mse = model, nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = self.mse(self.net(x), y)
            if log_loss:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return opt

    if name == "lightning-lean":
        options: dict[str, Any] = {
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }
    else:
        options = {}
    trainer = lightning.Trainer(
        max_steps=len(problem.data),
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(scratch / "lightning"),
        num_sanity_val_steps=0,
        **options,
    )
    module = Module()
    loader = _Batches(problem.data)
    return Prepared(lambda: trainer.fit(module, train_dataloaders=loader), model)


class _Batches(torch.utils.data.IterableDataset):
    """The pre-made batches as an iterable Lightning accepts, with a length for its bar."""

    def __init__(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.data = data

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


#: Contender -> (the module it cannot run without, what builds it).
OTHERS: dict[str, tuple[str, Callable[..., Prepared]]] = {
    "ignite-bare": ("ignite", _ignite),
    "ignite-handlers": ("ignite", _ignite),
    "accelerate": ("accelerate", _accelerate),
    "hf-trainer": ("transformers", _hf_trainer),
    "lightning-lean": ("lightning", _lightning),
    "lightning-default": ("lightning", _lightning),
}


# -- the rounds -------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet(scratch: Path) -> Iterator[None]:
    """Progress bars and banners (which Lightning writes to stdout and stderr) into a file."""
    with (
        open(scratch / "output.txt", "a") as sink,
        contextlib.redirect_stdout(sink),
        contextlib.redirect_stderr(sink),
    ):
        yield


def run_rounds(
    problem: Problem, contenders: list[str], rounds: int, scratch: Path, seed: int = 0
) -> dict[str, dict[str, list[float]]]:
    """clock -> contender -> one ratio over its raw neighbours per round."""
    rng = random.Random(seed)
    ratios: dict[str, dict[str, list[float]]] = {k: {c: [] for c in contenders} for k in CLOCKS}

    def one(name: str) -> Any:
        if name == "raw" or name in HOOKLOOP:
            prepared = prepare(name, problem)
        else:
            prepared = prepare_other(name, problem, scratch)
        gc.collect()
        try:
            with quiet(scratch):
                return time_ns(prepared.run)
        finally:
            prepared.close()

    for name in contenders:  # a warm-up of each (first imports, lazy set-up)
        one(name)
    before = one("raw")
    for number in range(rounds):
        for name in shuffled(contenders, rng):
            spent = one(name)
            after = one("raw")
            for clock in CLOCKS:
                neighbours = (getattr(before, clock) + getattr(after, clock)) / 2
                ratios[clock][name].append(getattr(spent, clock) / neighbours)
            before = after
        print(f"round {number + 1}/{rounds} done", file=sys.stderr, flush=True)
    return ratios


def report(
    ratios: dict[str, dict[str, list[float]]], rounds: int, steps: int, left_out: list[str]
) -> str:
    rows = []
    for name, cpu in sorted(ratios["cpu"].items(), key=lambda kv: median(kv[1])):
        wall = ratios["wall"][name]
        lo, hi = quartiles(cpu)
        rows.append([name, f"{median(cpu):.3f}", f"{lo:.3f}-{hi:.3f}", f"{median(wall):.3f}"])
    table = format_table(["contender", "x raw, cpu", "IQR", "x raw, wall"], rows)
    lines = [
        f"Training loops vs a raw PyTorch loop: {rounds} interleaved rounds x {steps} steps "
        "(medians over rounds; each contender timed between two raw runs)",
        environment(),
        "",
        table,
    ]
    if left_out:
        lines += ["", "left out (package not installed): " + ", ".join(left_out)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 500 steps")
    parser.add_argument("--seed", type=int, default=0, help="the order contenders run in")
    parser.add_argument(
        "--only", default=None, help="comma-separated contenders (default: all installed)"
    )
    args = parser.parse_args(argv)
    rounds, steps = (3, 500) if args.quick else (args.rounds, args.steps)
    if rounds < 1 or steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    known = [*HOOKLOOP, *OTHERS]
    wanted = known if args.only is None else args.only.split(",")
    unknown = [c for c in wanted if c not in known]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {known}")
    left_out = [c for c in wanted if c in OTHERS and not installed(OTHERS[c][0])]
    contenders = [c for c in wanted if c not in left_out]

    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        problem = Problem.make(steps, scratch / "hookloop", io.StringIO())
        ratios = run_rounds(problem, contenders, rounds, scratch, args.seed)
    print(report(ratios, rounds, steps, left_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
