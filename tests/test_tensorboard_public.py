"""TensorBoard logging through torch's public ``SummaryWriter``, TensorBoard left as it was.

hookloop's TensorBoard writer changes nothing of TensorBoard's for the rest of the
process: another ``SummaryWriter`` (transformers' ``TensorBoardCallback`` among them)
writes with TensorBoard's own record functions. What TBLogger writes is read back with
TensorBoard's own reader.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hookloop import TrainConfig, Trainer
from hookloop.callbacks import JsonLogger, read_jsonl

pytest.importorskip("tensorboard")


def _train(callbacks, *, steps: int, log_every: int) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(steps)]
    config = TrainConfig(max_steps=steps, log_every=log_every, handle_signals=False, device="cpu")
    Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        loss_fn=nn.MSELoss(),
        config=config,
        callbacks=callbacks,
    ).train()


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_tensorboard_logging_leaves_tensorboards_record_writer_as_it_found_it(tmp_path):
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer
    from torch.utils.tensorboard import SummaryWriter

    from hookloop.callbacks.tensorboard import TBLogger

    checksum, writer_type = record_writer.masked_crc32c, record_writer.RecordWriter
    _train([TBLogger(tmp_path / "tb")], steps=4, log_every=2)
    # The same functions as before the run, TensorBoard's own: nothing was swapped in.
    assert record_writer.masked_crc32c is checksum is pywrap_tensorflow.masked_crc32c
    assert record_writer.RecordWriter is writer_type
    # Another writer in the process (as transformers' callback would make) writes as usual.
    other = SummaryWriter(str(tmp_path / "other"))
    other.add_scalar("loss", 0.25, 3)
    other.close()
    assert _scalars(tmp_path / "other") == {"loss": [(3, 0.25)]}


def test_every_logged_number_reaches_tensorboard_at_its_step_as_json_logs_it(tmp_path):
    from hookloop.callbacks.tensorboard import TBLogger

    path, tb_dir = tmp_path / "metrics.jsonl", tmp_path / "tb"
    _train([JsonLogger(path), TBLogger(tb_dir, log_config=False)], steps=6, log_every=2)
    logs = [r for r in read_jsonl(path) if r["kind"] == "train"]
    scalars = _scalars(tb_dir)
    numeric = {
        key for r in logs for key, v in r.items() if key not in ("kind", "step", "epoch", "time")
        and isinstance(v, (int, float)) and not isinstance(v, bool)
    }  # fmt: skip
    assert "loss" in numeric and len(numeric) >= 3
    for key in sorted(numeric):
        expected = [(r["step"], r[key]) for r in logs if key in r]
        shown = scalars[f"train/{key}"]
        assert [step for step, _ in shown] == [step for step, _ in expected] == [2, 4, 6], key
        for (_, got), (_, want) in zip(shown, expected, strict=True):
            # TensorBoard keeps a float32; NaN and Inf would be written as they are.
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-30), (key, got, want)


def _events(log_dir) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (path,) = log_dir.glob("events.out.tfevents.*")
    return [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]


def test_a_logs_scalars_are_one_event_that_reads_back_as_add_scalars_values(tmp_path):
    """Several values at a step go into one event (one checksum, not one per value);
    TensorBoard reads back what ``add_scalar`` per value gives, at one wall time."""
    from torch.utils.tensorboard import SummaryWriter

    from hookloop.callbacks.tensorboard import ResumableSummaryWriter

    logs = {
        2: {"train/loss": 0.5, "train/lr": 1e-3, "train/grad_norm": 7.0},
        4: {"train/loss": 0.25},
    }
    ours = ResumableSummaryWriter(tmp_path / "ours")
    plain = SummaryWriter(str(tmp_path / "plain"))
    for step, values in logs.items():
        ours.add_scalars_at(values, step)
        for tag, value in values.items():
            plain.add_scalar(tag, value, global_step=step)
    ours.close()
    plain.close()
    assert _scalars(tmp_path / "ours") == _scalars(tmp_path / "plain")
    events = _events(tmp_path / "ours")
    assert [(e.step, [v.tag for v in e.summary.value]) for e in events] == [
        (2, ["train/loss", "train/lr", "train/grad_norm"]),
        (4, ["train/loss"]),
    ]
    # each value carries the scalars plugin's metadata, as add_scalar's do
    plain_meta = {v.tag: v.metadata for e in _events(tmp_path / "plain") for v in e.summary.value}
    assert all(v.metadata == plain_meta[v.tag] for e in events for v in e.summary.value)
