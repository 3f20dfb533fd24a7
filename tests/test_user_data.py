"""A user's own data in the native Trainer: a ``datasets.Dataset`` (or any sized
indexable) is batched, shuffled and resumed like a torch map-style dataset; what the
loop cannot batch is refused by name."""

from __future__ import annotations

import datasets
import pytest
import torch
from safetensors.torch import load_file

from hookloop import Trainer
from hookloop.config import Config
from hookloop.data import collate_rows, is_map_style

ROWS = 40


def table(rows: int = ROWS) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {
            "x": [[float(i), float(i % 5), 1.0] for i in range(rows)],
            "y": [float(i % 3) for i in range(rows)],
            "idx": list(range(rows)),
        }
    )


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x.float()).squeeze(-1), y.float())


def config(max_steps: int, *, seed: int = 0, batch_size: int = 4) -> Config:
    cfg = Config(seed=seed)
    cfg.data.batch_size = batch_size
    cfg.train.device = "cpu"
    cfg.train.max_steps = max_steps
    cfg.train.log_every = 0
    cfg.checkpoint.async_save = False
    return cfg


def batches_seen(model: torch.nn.Module) -> list[list[int]]:
    """Every batch's ``idx`` column, as the model's forward received it."""
    seen: list[list[int]] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["idx"].tolist()), with_kwargs=True
    )
    return seen


def test_a_datasets_dataset_is_batched_by_data_batch_size_and_shuffled_by_seed():
    assert is_map_style(table())
    runs = []
    for seed in (0, 0, 1):
        model = Regressor()
        seen = batches_seen(model)
        Trainer(model, train_data=table(), config=config(15, seed=seed)).train()
        runs.append(seen)
    same_a, same_b, other = runs
    assert [len(b) for b in same_a] == [4] * 15  # data.batch_size, not one row a step
    first_epoch = [i for batch in same_a[:10] for i in batch]
    assert sorted(first_epoch) == list(range(ROWS))  # each row once per epoch
    assert first_epoch != list(range(ROWS))  # shuffled
    assert same_a == same_b  # the order is a function of the seed
    assert other != same_a


def test_stop_and_resume_equals_an_uninterrupted_run_bitwise(tmp_path):
    whole = Regressor()
    Trainer(whole, train_data=table(), config=config(14), out_dir=tmp_path / "whole").train()

    first = Regressor()
    seen_first = batches_seen(first)
    Trainer(first, train_data=table(), config=config(5), out_dir=tmp_path / "split").train()
    second = Regressor()
    seen_second = batches_seen(second)
    Trainer(
        second, train_data=table(), config=config(14), out_dir=tmp_path / "split", resume="auto"
    ).train()

    reference = Regressor()
    seen_reference = batches_seen(reference)
    Trainer(reference, train_data=table(), config=config(14)).train()
    assert seen_first + seen_second == seen_reference  # the same rows, in the same order
    a = load_file(tmp_path / "whole/checkpoints/step-00000014/model.safetensors")
    b = load_file(tmp_path / "split/checkpoints/step-00000014/model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_tiny_gpt2_trains_from_a_dataset_of_token_lists():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    ids = [[(7 * row + t) % 64 for t in range(12)] for row in range(32)]
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    shapes: list[tuple[int, ...]] = []

    def forward_step(state, data_iterator, model):
        batch = next(data_iterator)
        shapes.append(tuple(batch["input_ids"].shape))
        return model(**batch), lambda output: output.loss

    trainer = Trainer(
        model, train_data=data, config=config(16, batch_size=8), forward_step=forward_step
    )
    losses: list[float] = []
    trainer.callbacks.register(
        "on_train_step_end", lambda ctx: losses.append(float(ctx.loss_dict["loss"]))
    )
    result = trainer.train()
    assert result.step == 16 and shapes == [(8, 12)] * 16
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns the repeating sequences


def test_rows_of_different_lengths_are_refused_naming_the_field_and_the_fix():
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]] * 4})
    trainer = Trainer(Regressor(), train_data=data, config=config(2), forward_step=None)
    with pytest.raises(ValueError, match=r"field 'input_ids' differs in size .*\(2 and 3\); pad"):
        trainer.train()
    with pytest.raises(ValueError, match=r"or pass collate_fn=\.\.\. to the Trainer"):
        collate_rows([{"a": [1]}, {"a": []}])


def test_a_collate_fn_puts_rows_together_the_users_way():
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]] * 4})
    widths: list[int] = []

    def pad(rows):
        widths.append(max(len(r["input_ids"]) for r in rows))
        return torch.tensor([r["input_ids"] + [0] * (3 - len(r["input_ids"])) for r in rows])

    def forward_step(state, data_iterator, model):
        batch = next(data_iterator)
        return model(batch.float()), lambda out: out.mean()

    cfg = config(2, batch_size=2)
    Trainer(torch.nn.Linear(3, 1), train_data=data, config=cfg, forward_step=forward_step,
            collate_fn=pad).train()  # fmt: skip
    assert widths and all(w in (2, 3) for w in widths)


@pytest.mark.parametrize(
    "rows",
    [
        pytest.param(list(table(8)), id="a list of datasets rows"),
        pytest.param(
            iter(torch.utils.data.TensorDataset(torch.ones(8, 3), torch.ones(8))),
            id="an iterator of torch rows",
        ),
    ],
)
def test_an_iterable_of_single_rows_is_refused_not_fed_row_by_row(rows):
    trainer = Trainer(Regressor(), train_data=rows, config=config(2), loss_fn=None)
    with pytest.raises(TypeError, match=r"yields single rows .* pass the dataset itself"):
        trainer.train()


@pytest.mark.parametrize(
    "data", [{"x": [1.0, 2.0]}, torch.ones(4, 3), 42], ids=["a dict", "a tensor", "a number"]
)
def test_data_the_loop_cannot_batch_is_refused_by_name(data):
    with pytest.raises(
        TypeError, match=f"train data must be a dataset .* got {type(data).__name__}"
    ):
        Trainer(Regressor(), train_data=data, config=config(2))


def test_collate_rows_matches_torchs_default_for_tensors_numbers_and_arrays():
    import numpy as np

    rows = [(torch.ones(2) * i, i, np.full(3, i, dtype=np.float32)) for i in range(4)]
    x, y, z = collate_rows(rows)
    assert x.shape == (4, 2) and y.tolist() == [0, 1, 2, 3] and z.shape == (4, 3)
    assert z.dtype == torch.float32
    batch = collate_rows(
        [{"ids": [[1, 2], [3, 4]], "name": "a"}, {"ids": [[5, 6], [7, 8]], "name": "b"}]
    )
    assert batch["ids"].shape == (2, 2, 2) and batch["name"] == ["a", "b"]
