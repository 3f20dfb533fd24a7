"""The native recipes log one name per metric, with no space in any key or TensorBoard
tag, and an evaluation's record is dated with the same fractional epoch as the train
record beside it. (The Megatron-Bridge dialect keeps its original's ``lm loss``: see
tests/test_compat_megatron_bridge.py.)"""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hookloop.callbacks.defaults import default_callbacks
from hookloop.entry import build_trainer
from hookloop.recipes import resolve_config

TINY_GPT = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16",
    "data.max_bytes=40000", "data.batch_size=8", "data.eval_batch_size=8",
    "train.max_steps=6", "train.log_every=2", "train.eval_every=3", "train.eval_max_batches=2",
    "train.device=cpu", "callbacks.textgen=false", "logging.progress=false",
    "checkpoint.async_save=false", "scheduler.warmup_steps=0",
]  # fmt: skip


def test_the_default_recipe_logs_each_metric_once_and_no_key_has_a_space(tmp_path):
    cfg = resolve_config("gpt-stdlib", None, TINY_GPT)
    trainer = build_trainer(cfg, callbacks=default_callbacks(cfg, tmp_path), out_dir=tmp_path)
    result = trainer.train()
    assert set(result.metrics) == {"eval_loss"}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert train and all("loss" in r and "lm loss" not in r for r in train)
    assert [sorted(k for k in r if "loss" in k) for r in evals] == [["eval_loss"]] * 2
    assert not [k for r in records for k in r if " " in k]
    tags = EventAccumulator(str(tmp_path / "tb")).Reload().Tags()["scalars"]
    assert "train/loss" in tags and not [t for t in tags if " " in t]
    assert not [t for t in tags if "lm" in t]


def test_an_evaluation_is_dated_with_the_fractional_epoch_of_its_step(tmp_path):
    cfg = resolve_config("gpt-stdlib", None, [*TINY_GPT, "train.log_every=3"])
    trainer = build_trainer(cfg, callbacks=default_callbacks(cfg, tmp_path), out_dir=tmp_path)
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["epoch"] for r in records if r["kind"] == "train"}
    evals = {r["step"]: r["epoch"] for r in records if r["kind"] == "eval"}
    assert set(evals) == {3, 6}
    assert evals == {step: train[step] for step in evals}
    assert 0 < evals[3] < 1  # a fraction of the first epoch, not 0
