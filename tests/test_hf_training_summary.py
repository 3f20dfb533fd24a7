"""transformers' start-of-training summary (``***** Running training *****`` and its
lines, on the ``transformers.trainer`` logger) says the same on the dialect, numbers
included: with ``max_steps`` the epochs are those the steps reach into."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hookloop.compat import hf  # noqa: E402
from test_hf_training_differential import BASE, RegressionDataset, RegressionModel  # noqa: E402

FACTORIES = {"hf": transformers.Trainer, "hookloop": hf.Trainer}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("budget", [{"max_steps": 3}, {"num_train_epochs": 2}])
def test_the_training_summary_says_what_transformers_says(budget: dict, tmp_path: Path):
    said = {}
    hf_logger = logging.getLogger("transformers.trainer")
    try:
        for kind, factory in FACTORIES.items():
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / kind), **{**BASE, **budget},
                per_device_train_batch_size=4, log_level="info",
            )  # fmt: skip
            seen = Lines()
            hf_logger.addHandler(seen)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    factory(RegressionModel(), args, train_dataset=RegressionDataset(7)).train()
            finally:
                hf_logger.removeHandler(seen)
            start = seen.lines.index("***** Running training *****")
            said[kind] = seen.lines[start : start + 9]
    finally:
        logging.getLogger("transformers").setLevel(logging.WARNING)
    assert said["hookloop"] == said["hf"]
