"""The parts of a resume on another number of ranks, one process (no launch)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hookloop.checkpoint.state import RNGState
from hookloop.data import DataPosition, EpochSampler, check_resize
from hookloop.errors import ConfigError


class StatefulLoader(list):
    def state_dict(self):
        return {"served": 3}

    def load_state_dict(self, state):
        self.loaded = state


def saved(world: int, batch: int | None = 4, accum: int = 1) -> dict:
    return {"world_size": world, "batch_size": batch, "grad_accum": accum}


def test_the_global_order_of_a_step_does_not_depend_on_the_number_of_ranks():
    def global_batch(world: int, per_rank: int, step: int) -> list[int]:
        taken = []
        for rank in range(world):
            sampler = EpochSampler(64, seed=3, rank=rank, world_size=world)
            sampler.set_epoch(2, start=step * per_rank)
            taken += list(sampler)[:per_rank]
        return sorted(taken)

    for step in range(4):
        assert global_batch(4, 4, step) == global_batch(2, 8, step) == global_batch(1, 16, step)


def test_a_changed_global_batch_names_the_sizes_that_keep_it():
    with pytest.raises(ConfigError) as err:
        check_resize(saved(4), saved(2), exact=True, stateful=False)
    assert str(err.value) == (
        "resuming on 2 ranks a run saved on 4: the global batch was 16 (4 ranks x 4 per rank "
        "x 1 micro-batches), now 8; keep it with data.batch_size=8 with train.grad_accum=1; "
        "data.batch_size=4 with train.grad_accum=2; data.batch_size=2 with train.grad_accum=4"
    )
    check_resize(saved(4), saved(2, 4, 2), exact=True, stateful=False)  # 2 x 4 x 2 = 16


def test_batches_without_state_cannot_move_to_another_number_of_ranks():
    position = DataPosition([torch.zeros(2)] * 4, 1, world_size=1)
    with pytest.raises(ConfigError, match="cannot resume with 1 ranks x 1 micro-batches a run "
                       "saved with 2 x 1: its train data is a loader with no state"):  # fmt: skip
        position.load_state_dict({"layout": saved(2, None)})
    position.load_state_dict({"layout": saved(1, None)})  # the same layout: as before


def test_a_loader_with_its_own_state_is_restored_with_a_warning_on_another_world_size():
    loader = StatefulLoader([torch.zeros(2)] * 4)
    position = DataPosition(loader, 1, world_size=1)
    with pytest.warns(UserWarning, match="saved with 2 ranks, resuming with 1; the train loader"):
        position.load_state_dict({"layout": saved(2, None), "loader": {"served": 3}})
    assert loader.loaded == {"served": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataPosition(loader, 1, world_size=1).load_state_dict({"loader": {"served": 1}})


def test_each_rank_gets_its_own_rng_derived_the_same_way_every_time():
    state = RNGState().state_dict()
    first = [RNGState.for_rank(state, rank)["torch"] for rank in range(3)]
    again = [RNGState.for_rank(state, rank)["torch"] for rank in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


@pytest.fixture
def ledger_run(tmp_path):
    from hookloop.config import apply_overrides
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config

    cfg = default_config("mlp-regression")
    apply_overrides(cfg, ["data.train_samples=40", "data.batch_size=4", "train.max_steps=14",
                          "data.ledger=true", "train.eval_every=100"])  # fmt: skip
    build_trainer(cfg, out_dir=str(tmp_path / "run")).train()
    return tmp_path / "run"


def test_a_one_process_ledger_covers_every_step_across_an_epoch(ledger_run):
    from hookloop.ledger import verify_ledger

    assert verify_ledger(ledger_run).summary() == (
        "ledger ok: 14 steps, 56 samples, 0 lost, 0 repeated"
    )


@pytest.mark.parametrize(
    "tamper, found",
    [
        (lambda lines: lines[:3] + lines[4:], "1 lost, 0 repeated, 0 mismatched"),
        (lambda lines: [*lines[:4], lines[3], *lines[4:]], "0 lost, 1 repeated"),
        (
            lambda lines: [*lines[:2], lines[2].replace('"crc": ', '"crc": 1'), *lines[3:]],
            "0 lost, 0 repeated, 1 mismatched",
        ),
    ],
    ids=["a step removed", "a step doubled", "indices changed"],
)
def test_a_tampered_ledger_is_found_out(ledger_run, tamper, found, capsys):
    from hookloop.app.cli import main

    path = ledger_run / "ledger" / "rank-0.jsonl"
    path.write_text("\n".join(tamper(path.read_text().splitlines())) + "\n")
    assert main(["runs", str(ledger_run), "--verify-ledger"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ledger NOT ok: ") and found in err


def test_a_ledger_line_that_is_not_json_is_one_line_naming_it(ledger_run):
    from hookloop.ledger import verify_ledger

    path = ledger_run / "ledger" / "rank-0.jsonl"
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"rank-0.jsonl: line 16 is not JSON$"):
        verify_ledger(ledger_run)
