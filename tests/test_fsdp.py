"""FSDP2 (train.parallel=fsdp): equivalence, sharded checkpoints through DCP, exact resume."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

import _zygote as zygote
from _dist_launch import run_job, torchrun
from _quiet import SERVICES_OFF
from hookloop import TrainConfig, Trainer
from hookloop.checkpoint import FAULT_ENV, CheckpointError, CheckpointStorage
from hookloop.config import Config, apply_overrides
from hookloop.distributed import shard_units
from hookloop.entry import load_weights
from hookloop.recipes import default_config, get_recipe
from hookloop.testing import TinyModel, ToyData

BASE = ["data.train_samples=512", "data.eval_samples=64", "train.max_steps=24",
        "train.eval_every=8", "checkpoint.every=4", "train.parallel=fsdp"]  # fmt: skip
CLI_RUN = [
    "--recipe", "mlp-regression", "train.parallel=fsdp", "train.max_steps=12",
    "checkpoint.every=4", "train.log_every=2", "train.eval_every=4", "train.clip_grad_norm=1.0",
    "data.train_samples=256", "data.eval_samples=64", "data.batch_size=16",
    "logging.progress=false", *SERVICES_OFF,
]  # fmt: skip
TORCHRUN = torchrun(2)


def launch(mode: str, out: Path, *overrides: str, ranks: int = 2) -> list[dict]:
    return run_job(mode, out, *BASE, *overrides, ranks=ranks)


def hookloop_train(
    out: Path, *extra: str, ranks: int = 2, env: dict | None = None
) -> subprocess.CompletedProcess:
    cmd = [*torchrun(ranks), "-m", "hookloop", "train", "--out", str(out), *CLI_RUN, *extra]
    env = {**os.environ, **(env or {})}
    start = zygote.run if ranks == 1 else subprocess.run  # torchrun starts its own ranks
    return start(cmd, capture_output=True, text=True, timeout=240, env=env)


# -- fast: the choice and the sharding policy ----------------------------------------------


def test_an_unknown_parallel_mode_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"train\.parallel expects 'ddp' \| 'fsdp' \| 'local'"):
        apply_overrides(Config(), ["train.parallel=zero"])
    with pytest.raises(ValueError, match=r"one of 'ddp', 'fsdp', 'local', got 'zero'"):
        Trainer(TinyModel(), config=TrainConfig(parallel="zero"))


def test_fsdp_in_a_single_process_trains_exactly_like_the_plain_model(tmp_path):
    def train(parallel: str, out: Path) -> list[torch.Tensor]:
        cfg = TrainConfig(max_steps=5, parallel=parallel, log_every=0, handle_signals=False)
        model = TinyModel()
        trainer = Trainer(
            model, train_data=ToyData(), loss_fn=TinyModel.loss_fn, config=cfg, out_dir=str(out)
        )
        trainer.train()
        return [p.detach().clone() for p in model.parameters()]

    plain = train("ddp", tmp_path / "ddp")
    sharded = train("fsdp", tmp_path / "fsdp")
    assert all(torch.equal(a, b) for a, b in zip(plain, sharded, strict=True))
    # Nothing to shard with one rank: the checkpoint holds full weights, as without fsdp.
    assert (tmp_path / "fsdp" / "checkpoints" / "step-00000005" / "model.safetensors").is_file()


def test_sharding_groups_each_called_child_and_leaves_tied_weights_to_the_root():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.act = torch.nn.ReLU()
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert shard_units(model) == list(model.blocks)


# -- slow: real torchrun, two gloo ranks on CPU ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fsdp_on_two_ranks_matches_one_process_with_the_same_global_batch(tmp_path, grad_accum):
    # 2 ranks x 16 samples see the same 32 samples per step as 1 process x 32. FSDP2
    # reduce-scatters (averages) the gradients of the two per-rank means, so only the float
    # summation order differs: measured ~6e-8 after 24 SGD-momentum steps; 1e-5 leaves room
    # for other CPUs' kernels yet catches any real mistake (a missed or doubled reduction
    # moves the weights by 1e-2 or more). The 2-rank run passes its own optimizer, built
    # before sharding, so this also checks that it was pointed at the sharded parameters.
    # With grad_accum=2 each rank runs 2 micro-batches of 8 and reduces only after the second.
    accum = f"train.grad_accum={grad_accum}"
    single = launch("plain", tmp_path / "one", "data.batch_size=32", ranks=1)[0]
    ranks = launch("own-optimizer", tmp_path / "two", f"data.batch_size={16 // grad_accum}", accum)
    assert ranks[0]["params"] == ranks[1]["params"]  # the same shards gathered on each rank
    for a, b in zip(single["params"], ranks[0]["params"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-4)
    for step, loss in single["losses"].items():
        assert ranks[0]["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert ranks[0]["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)


@pytest.mark.slow
def test_fsdp_checkpoints_commit_atomically_with_every_rank_shard_in_the_manifest(tmp_path):
    run = tmp_path / "run"
    # Rank 0 dies after every rank wrote its shards for step 8, before the manifest.
    torn = hookloop_train(run, env={FAULT_ENV: "files_written@8"})
    assert torn.returncode != 0
    storage = CheckpointStorage(run / "checkpoints")
    assert storage.latest_name() == "step-00000004"
    assert [p.name for p in storage.complete()] == ["step-00000004"]
    assert not (run / "checkpoints" / "step-00000008").exists()

    manifest = storage.verify(run / "checkpoints" / "step-00000004")
    on_disk = {
        p.relative_to(run / "checkpoints" / "step-00000004").as_posix()
        for p in (run / "checkpoints" / "step-00000004").rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert set(manifest["files"]) == on_disk
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= on_disk
    assert "model.safetensors" not in on_disk  # no rank holds the whole model

    resumed = hookloop_train(run, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "max_steps at step 12" in resumed.stdout  # the result line
    assert storage.latest_name() == "step-00000012"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".staging")]

    shard = run / "checkpoints" / "step-00000012" / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp fails its checksum"):
        storage.verify(shard.parent.parent)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumed_without_fsdp_is_refused_with_the_reason(tmp_path):
    run = tmp_path / "run"
    assert hookloop_train(run, "train.max_steps=4").returncode == 0
    proc = hookloop_train(run, "train.parallel=ddp", "--resume", "auto", ranks=1)
    assert proc.returncode != 0
    assert "holds sharded weights but this run's model is full" in proc.stderr


@pytest.mark.slow
def test_stop_and_resume_of_a_two_rank_fsdp_run_gives_the_same_final_weights(tmp_path):
    args = ["data.batch_size=16", "model.dropout=0.3"]  # dropout: per-rank RNG must resume too
    reference = launch("plain", tmp_path / "ref", *args)
    launch("train", tmp_path / "run", *args, "train.exit_interval=10")
    resumed = launch("resume", tmp_path / "run", *args)
    assert [r["step"] for r in resumed] == [24, 24]
    for ref, res in zip(reference, resumed, strict=True):
        assert ref["params"] == res["params"]
        assert res["losses"] == {s: v for s, v in ref["losses"].items() if int(s) > 10}


@pytest.mark.slow
def test_text_samples_under_fsdp_are_generated_by_every_rank_and_written_once(tmp_path):
    # Each forward of a sharded model gathers weights from every rank: a callback that
    # generated on rank 0 alone would hang the run at its first evaluation.
    run = tmp_path / "run"
    gpt = [
        "--recipe", "gpt-stdlib", "train.parallel=fsdp", "train.max_steps=2",
        "train.eval_every=2", "train.eval_max_batches=1", "data.max_bytes=200000",
        "data.batch_size=4", "checkpoint.every=null", "callbacks.textgen=true",
        "logging.progress=false", *SERVICES_OFF,
    ]  # fmt: skip
    cmd = [*TORCHRUN, "-m", "hookloop", "train", "--out", str(run), *gpt]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = list(run.rglob("samples*"))
    assert len(samples) == 1, samples
    assert "step 2" in samples[0].read_text(encoding="utf-8").lower()


@pytest.mark.slow
def test_weights_of_a_sharded_checkpoint_load_into_a_plain_or_a_sharded_model(tmp_path):
    trained = launch("train", tmp_path / "run")[0]  # ends with a sharded checkpoint at step 24
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / CheckpointStorage(checkpoints).latest_name() / "sharded").is_dir()

    cfg = default_config("mlp-regression")
    apply_overrides(cfg, BASE)
    plain = get_recipe("mlp-regression").build(cfg).model
    load_weights(plain, checkpoints)  # one process, no process group
    assert [p.detach().flatten().tolist() for p in plain.parameters()] == trained["params"]

    # And from a full model.safetensors into a model sharded over two ranks.
    save_model(plain, str(tmp_path / "full.safetensors"))
    (tmp_path / "load").mkdir()
    (tmp_path / "load" / "weights-from").write_text(str(tmp_path / "full.safetensors"))
    for rank in launch("load-weights", tmp_path / "load"):
        assert rank["params"] == trained["params"]
    (tmp_path / "load" / "weights-from").write_text(str(checkpoints))
    for rank in launch("load-weights", tmp_path / "load"):
        assert rank["params"] == trained["params"]
