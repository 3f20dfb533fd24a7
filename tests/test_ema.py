"""The EMA callback: its averages by hand, evaluation with them, exact resume, two ranks
(DDP, and FSDP2 with the averages kept as shards)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from _dist_launch import torchrun
from hookloop import Callback, Trainer
from hookloop.callbacks import EMA, default_callbacks
from hookloop.errors import ConfigError
from hookloop.testing import TinyModel, ToyData

JOB = str(Path(__file__).with_name("_ema_job.py"))


class WeightLog(Callback):
    """The weights after each optimizer step (and at the start), as float32 copies."""

    priority = 11  # before EMA: the weights are the same either side of it

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.skipped: list[bool] = []

    def on_train_start(self, ctx):
        self.weights.append(snapshot(ctx.model))

    def on_after_optimizer_step(self, ctx):
        self.weights.append(snapshot(ctx.model))
        self.skipped.append(bool(ctx.skipped_iter))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def by_hand(weights: list[dict[str, torch.Tensor]], decay: float, counted: list[int]):
    """The average starting from the first weights, moved at the ``counted`` updates."""
    avg = {n: w.double() for n, w in weights[0].items()}
    for i in counted:
        avg = {n: decay * avg[n] + (1 - decay) * weights[i][n].double() for n in avg}
    return avg


def assert_close(ema: EMA, expected: dict[str, torch.Tensor]) -> None:
    got = ema.averaged_state_dict()
    assert got.keys() == expected.keys()
    for name in got:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name].double(), expected[name], rtol=0, atol=1e-6)


def test_the_average_over_three_steps_is_the_hand_computation(make_trainer):
    ema, log = EMA(0.5), WeightLog()
    make_trainer([ema, log], max_steps=3).train()
    assert ema.updates == 3
    assert_close(ema, by_hand(log.weights, 0.5, [1, 2, 3]))
    # the average lies strictly between the start and the last weights: it did move
    assert not torch.equal(ema.averages["net.0.weight"], log.weights[3]["net.0.weight"])


def test_every_two_steps_and_half_life(make_trainer):
    ema, log = EMA(half_life=1.0, every=2), WeightLog()
    make_trainer([ema, log], max_steps=5).train()
    assert ema.decay == 0.5 and ema.updates == 2  # steps 2 and 4
    assert_close(ema, by_hand(log.weights, 0.5, [2, 4]))


def test_start_step_copies_the_weights_until_it(make_trainer):
    ema, log = EMA(0.9, start_step=2), WeightLog()
    make_trainer([ema, log], max_steps=4).train()
    # steps 1-2 copy, so the average starts from step 2's weights; 3 and 4 average
    assert_close(ema, by_hand(log.weights[2:], 0.9, [1, 2]))


class SkipStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, ctx):
        if ctx.state.step == self.step:
            ctx.control.skip_step()


def test_a_skipped_step_is_not_averaged(make_trainer):
    ema, log = EMA(0.5), WeightLog()
    make_trainer([ema, log, SkipStep(2)], max_steps=3).train()
    assert log.skipped == [False, True, False]
    assert ema.updates == 2
    assert_close(ema, by_hand(log.weights, 0.5, [1, 3]))


def test_evaluation_uses_the_averages_and_restores_the_weights(make_trainer):
    ema = EMA(0.8)
    trainer = make_trainer([ema], max_steps=6, eval_n=16)
    trainer.train()
    before = snapshot(trainer.model)
    averaged = TinyModel()
    averaged.load_state_dict(ema.averaged_state_dict())
    data = ToyData(n=16, seed=1)
    expected = TinyModel.loss_fn(averaged(data.x), data.y).item()
    trained = TinyModel.loss_fn(trainer.model(data.x), data.y).item()

    metrics = trainer.evaluate()

    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["eval_loss"] != pytest.approx(trained, rel=1e-3)  # not the trained weights
    after = snapshot(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # restored, bit for bit
    assert trainer.test(ToyData(n=8, seed=2))["test_loss"] > 0
    assert all(torch.equal(before[n], p) for n, p in snapshot(trainer.model).items())


def test_eval_with_ema_off_evaluates_the_trained_weights(make_trainer):
    trainer = make_trainer([EMA(0.8, eval_with_ema=False)], max_steps=4, eval_n=16)
    trainer.train()
    data = ToyData(n=16, seed=1)
    trained = TinyModel.loss_fn(trainer.model(data.x), data.y).item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(trained, rel=1e-6)


def test_swap_at_end_leaves_the_averages_in_the_model(make_config, tmp_path):
    ema, log = EMA(0.7, swap_at_end=True), WeightLog()
    cfg = make_config(max_steps=4)
    trainer = Trainer(TinyModel(), train_data=ToyData(n=16), loss_fn=TinyModel.loss_fn,
                      config=cfg, callbacks=[ema, log], out_dir=tmp_path)  # fmt: skip
    trainer.train()
    held = snapshot(trainer.model)
    assert all(torch.equal(held[n], ema.averages[n]) for n in held)
    # the last checkpoint keeps the training weights (a resume goes on exactly)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert torch.equal(saved["net.0.weight"], log.weights[-1]["net.0.weight"])


def run_to(tmp_path: Path, max_steps: int, exit_interval: int | None, resume: str | None):
    from hookloop.config import Config

    cfg = Config()
    cfg.data.batch_size = 4
    cfg.train.device, cfg.train.handle_signals, cfg.train.log_every = "cpu", False, 0
    cfg.train.max_steps, cfg.train.exit_interval = max_steps, exit_interval
    cfg.train.eval_every = 3
    cfg.optimizer.lr = 0.05
    ema = EMA(0.9, every=2, start_step=1)
    trainer = Trainer(TinyModel(), train_data=ToyData(n=64), eval_data=ToyData(n=8, seed=1),
                      loss_fn=TinyModel.loss_fn, config=cfg, callbacks=[ema],
                      out_dir=tmp_path, resume=resume)  # fmt: skip
    return trainer.train(), ema, trainer


def test_a_stopped_and_resumed_run_ends_with_the_same_averages_bit_for_bit(tmp_path):
    _, whole, whole_trainer = run_to(tmp_path / "a", 12, None, None)
    first, _, _ = run_to(tmp_path / "b", 12, 7, None)
    assert (first.step, first.stop_reason) == (7, "exit_interval")
    _, resumed, resumed_trainer = run_to(tmp_path / "b", 12, None, "auto")
    assert resumed_trainer.state.step == 12 and resumed.updates == whole.updates == 5
    a, b = whole.averaged_state_dict(), resumed.averaged_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(  # and the training weights too (evaluations swapped them back exactly)
        torch.equal(p, q)
        for p, q in zip(
            whole_trainer.model.parameters(), resumed_trainer.model.parameters(), strict=True
        )
    )


class Trajectory(WeightLog):
    """The weights the run kept: a rewind drops the steps of the branch it abandoned."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def on_after_optimizer_step(self, ctx):
        super().on_after_optimizer_step(ctx)
        self.steps.append(ctx.state.step)

    def on_checkpoint_load(self, ctx):
        if ctx.rewind is not None:
            kept = 1 + self.steps.index(ctx.rewind.to_step)  # weights[0]: the start
            del self.weights[kept + 1 :], self.steps[kept:]


def test_after_a_rewind_the_average_goes_on_from_the_checkpoints(tmp_path):
    from _rewind_job import build

    ema, kept = EMA(0.5), Trajectory()
    trainer, _ = build(tmp_path, callbacks=[ema, kept])
    trainer.train()
    (rewind,) = trainer.state.rewinds  # the loss spiked at step 8: back to step 6
    assert (rewind.from_step, rewind.to_step) == (8, 6) and kept.steps == list(range(1, 15))
    assert ema.updates == 14  # the count went back to step 6 with the averages
    assert_close(ema, by_hand(kept.weights, 0.5, list(range(1, 15))))


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ({"updates": 1}, "must hold 'updates' and 'averages'"),
        ([1, 2], "got list"),
        ({"updates": -1, "averages": {}}, "'updates' must be an integer >= 0"),
        ({"updates": 1, "averages": {"w": [0.0]}}, "must be a float32 tensor, got list"),
        ({"updates": 1, "averages": {"w": torch.zeros(2, dtype=torch.int64)}}, "torch.int64"),
    ],
)
def test_a_hostile_saved_state_is_refused_in_one_line(state, says):
    with pytest.raises(ValueError, match="EMA state") as err:
        EMA(0.9).load_state_dict(state)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_saved_averages_of_another_model_are_refused_at_the_start(make_trainer):
    wrong = {"updates": 1, "averages": snapshot(TinyModel(hidden=3))}
    ema = EMA(0.9)
    ema.load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"EMA state for 'net.0.weight' has shape \(3, 4\)"):
        make_trainer([ema], max_steps=1).train()
    missing = {"updates": 1, "averages": {"net.0.weight": torch.zeros(8, 4)}}
    ema = EMA(0.9)
    ema.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"does not match .*missing \['net.0.bias'"):
        make_trainer([ema], max_steps=1).train()


def test_arguments_are_checked():
    assert EMA().decay == 0.999
    for kwargs, says in [
        ({"decay": 0.9, "half_life": 3}, "one of decay= and half_life=, not both"),
        ({"decay": 1.0}, r"decay must be a number in \[0, 1\)"),
        ({"half_life": 0}, "half_life must be"),
        ({"decay": 0.9, "every": 0}, "every must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=says):
            EMA(**kwargs)


def test_the_config_switch_adds_it(make_config):
    cfg = make_config()
    assert not any(isinstance(cb, EMA) for cb in default_callbacks(cfg, None))
    cfg.callbacks.ema_decay, cfg.callbacks.ema_eval = 0.99, False
    (ema,) = [cb for cb in default_callbacks(cfg, None) if isinstance(cb, EMA)]
    assert ema.decay == 0.99 and not ema.eval_with_ema
    cfg.callbacks.ema_decay = 1.5
    with pytest.raises(ConfigError, match=r"callbacks.ema_decay must be a number in \[0, 1\)"):
        cfg.callbacks.validate()


def test_two_ranks_end_with_equal_averages(tmp_path):
    proc = subprocess.run(
        [*torchrun(2), JOB, str(tmp_path)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"ema-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["world"] == 2
    assert ranks[0]["updates"] == ranks[1]["updates"] == 6
    assert ranks[0]["averages"] == ranks[1]["averages"]
    assert ranks[0]["averages"] != ranks[0]["weights"]  # an average, not the weights


# -- FSDP2: the averages sharded like the parameters -----------------------------------------
#
# One module-wide set of runs on two gloo ranks (tests/_ema_job.py): ``ref`` to step 12,
# ``run`` stopped at step 6 and resumed, ``plain`` saved at step 4 without EMA (its manifest
# re-signed as format 3, as an older hookloop wrote it) and resumed with EMA, and a copy of
# ``run``'s checkpoint resumed on three ranks. EMA(0.9, every=2, start_step=1) counts
# steps 3, 5, 7, 9 and 11.


def launch(mode: str, out: Path, *overrides: str, ranks: int = 2) -> str:
    proc = subprocess.run([*torchrun(ranks), JOB, mode, str(out), *overrides],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc.stderr


def legs(out: Path, leg: str, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"{leg}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ema-fsdp")
    stderr = launch("fsdp", root)  # the runs, then run and plain resumed (see the job)
    launch("resume", root / "three", "data.batch_size=4", ranks=3)  # the same 12 a step
    return {
        "root": root,
        "stderr": stderr,
        "ref": legs(root, "ref"),
        "resumed": legs(root, "run-resumed"),
        "plain": legs(root, "plain-resumed"),
        "three": legs(root / "three", "run-resumed", ranks=3),
    }


def one_process(*callbacks: Callback) -> Trainer:
    """The FSDP runs' recipe and samples (12 a step) in one process, unsharded."""
    from _ema_job import FSDP
    from hookloop.config import apply_overrides
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    cfg = default_config("mlp-regression")
    apply_overrides(cfg, [*FSDP, "train.parallel=ddp", "data.batch_size=12"])
    return build_trainer(cfg, callbacks=list(callbacks))


def close(a: dict[str, list[float]], b: dict[str, list[float]], atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(
        torch.allclose(torch.tensor(a[n]), torch.tensor(b[n]), atol=atol, rtol=1e-4) for n in a
    )


@pytest.mark.slow
def test_fsdp_averages_are_kept_as_shards_and_equal_the_update_on_whole_weights(fsdp):
    ref = fsdp["ref"]
    assert ref[0]["world"] == 2 and ref[0]["updates"] == ref[1]["updates"] == 5
    assert ref[0]["averages"] == ref[1]["averages"]  # gathered from the same shards
    # Elementwise, so the update on each rank's shards is the one on whole tensors, bit for
    # bit: the float32 lerp of tests/_ema_job.py's Recorder on the gathered weights.
    assert ref[0]["averages"] == ref[0]["by_hand"]
    assert ref[0]["averages"] != ref[0]["trained"]
    local = [r["sizes"]["0.weight"] for r in ref]  # [this rank's elements, the whole]
    assert local[0][0] + local[1][0] == local[0][1] and local[0][0] < local[0][1]


@pytest.mark.slow
def test_fsdp_averages_match_one_process_training_on_the_same_samples(fsdp):
    ema = EMA(0.9, every=2, start_step=1)
    one_process(ema).train()
    single = {n: t.flatten().tolist() for n, t in ema.averaged_state_dict().items()}
    # the weights differ by the float summation order of the reduce-scatter (~1e-8 here)
    assert ema.updates == 5 and close(single, fsdp["ref"][0]["averages"])


@pytest.mark.slow
def test_fsdp_evaluation_runs_with_the_averages_and_the_end_swaps_them_in(fsdp):
    ref = fsdp["ref"][0]
    assert ref["eval_weights"] == ref["averages"]  # the evaluation at step 12 ran on them
    assert ref["model"] == ref["averages"]  # swap_at_end, shard by shard

    def loss_of(weights: dict[str, list[float]]) -> float:
        trainer = one_process()
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                p.copy_(torch.tensor(weights[name]).view_as(p))
        return trainer.evaluate()["eval_loss"]

    assert ref["eval_loss"] == pytest.approx(loss_of(ref["averages"]), rel=1e-5)
    assert ref["eval_loss"] != pytest.approx(loss_of(ref["trained"]), rel=1e-3)


@pytest.mark.slow
def test_an_fsdp_run_stopped_and_resumed_ends_on_the_same_averages_bit_for_bit(fsdp):
    ref, resumed = fsdp["ref"][0], fsdp["resumed"]
    assert [r["step"] for r in resumed] == [12, 12] and resumed[0]["updates"] == 5
    for rank in resumed:
        assert rank["averages"] == ref["averages"]
        assert rank["trained"] == ref["trained"]  # evaluations swapped the weights back exactly
        assert rank["model"] == ref["model"]
    # Each rank's shards of the averages went into the same DCP save as the model's.
    import torch.distributed.checkpoint as dcp

    ckpt = fsdp["root"] / "run" / "checkpoints" / "step-00000006"
    keys = set(dcp.FileSystemReader(ckpt / "sharded").read_metadata().state_dict_metadata)
    assert {f"callbacks.EMA.{n}" for n in ref["averages"]} <= keys
    assert json.loads((ckpt / "manifest.json").read_text())["format"] == 4
    plain = torch.load(ckpt / "trainer_state.pt", weights_only=True)["callbacks"]["EMA"]
    assert plain == {"decay": 0.9, "updates": 2, "averages": {}, "sharded": True}


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_three_ranks_with_the_averages_resharded(fsdp):
    three = fsdp["three"]
    assert [r["world"] for r in three] == [3, 3, 3] and three[0]["updates"] == 5
    assert three[0]["sizes"]["0.weight"][0] * 2 < three[0]["sizes"]["0.weight"][1]
    assert three[0]["averages"] == three[2]["averages"]
    # torch.distributed.checkpoint reshards on load; the rest differs by summation order
    assert close(three[0]["averages"], fsdp["ref"][0]["averages"])
    assert close(three[0]["trained"], fsdp["ref"][0]["trained"])


@pytest.mark.slow
def test_a_format_3_fsdp_checkpoint_without_ema_resumes_with_fresh_averages(fsdp):
    plain = fsdp["plain"][0]
    assert plain["step"] == 12 and plain["updates"] == 4  # steps 5, 7, 9, 11
    assert plain["averages"] == plain["by_hand"]  # from the weights at step 4
    assert "stateful callback 'EMA' has no saved state (it starts fresh)" in fsdp["stderr"]


def test_a_sharded_state_whose_shards_never_came_is_refused_at_the_start(make_trainer):
    ema = EMA(0.9)
    ema.load_state_dict({"decay": 0.9, "updates": 3, "averages": {}, "sharded": True})
    with pytest.raises(ValueError, match="EMA state was saved with its averages in the chec"):
        make_trainer([ema], max_steps=1).train()
