"""The HF dialect trains to the same numbers as the real ``transformers.Trainer``.

Each schedule trains one model through ``transformers.Trainer`` and through
``hookloop.compat.hf.Trainer`` with the same ``TrainingArguments``, data and
starting weights, logging every step: the per-step ``loss``,
``learning_rate`` and ``grad_norm``, the evaluation metrics (``compute_metrics``
included), the ``TrainOutput`` and the final weights must agree. The models are
a small regression network (a plain map-style dataset that is not a torch
``Dataset``, a model returning a tuple) and a one-layer ``GPT2LMHeadModel``
(token batches padded by ``DataCollatorForLanguageModeling``, so HF's
``num_items_in_batch`` scaling matters). A ``datasets.Dataset`` run records
the batches each model's ``forward`` receives.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")

from hookloop.compat import hf  # noqa: E402
from hookloop.compat.hf.optim import decay_parameter_names  # noqa: E402

RTOL = 1e-5
SPEED_KEYS = ("_runtime", "_per_second")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """These models are tiny: one intra-op thread is faster on a small, shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- models and data ---------------------------------------------------------------
class RegressionDataset:
    """``y = 2x0 - x1 + 3`` plus noise as ``{"input_x", "labels"}`` of numpy floats:
    sized and indexable, not a torch ``Dataset`` (as HF's test dataset)."""

    def __init__(self, length: int, seed: int = 42) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(length, 2)).astype(np.float32)
        noise = 0.1 * rng.normal(size=length)
        self.y = (2 * self.x[:, 0] - self.x[:, 1] + 3 + noise).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModel(torch.nn.Module):
    """A LayerNorm and biases (no weight decay for them) between two linears;
    returns a tuple, the loss first when there are labels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(2, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        y = self.head(torch.relu(self.norm(self.hidden(input_x)))).squeeze(-1)
        if labels is None:
            return (y,)
        return torch.nn.functional.mse_loss(y, labels), y


def regression_metrics(pred: Any) -> dict[str, float]:
    predictions, labels = pred
    return {"mse": float(((predictions - labels) ** 2).mean())}


VOCAB = 40


def tokenizer() -> Any:
    """A word-level tokenizer built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]"
    )


def token_rows(n: int, seed: int) -> list[list[int]]:
    """``n`` sequences of 4 to 12 tokens with a learnable pattern (each token is
    the previous one plus a step)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        length, start, step = rng.integers(4, 13), rng.integers(2, VOCAB), rng.integers(1, 4)
        rows.append([int(2 + (start - 2 + step * j) % (VOCAB - 2)) for j in range(length)])
    return rows


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, pad_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def token_accuracy(pred: Any) -> dict[str, float]:
    logits, labels = pred
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = target != -100
    return {"accuracy": float((predicted[mask] == target[mask]).mean())}


# -- schedules ----------------------------------------------------------------------
BASE = {
    "use_cpu": True,
    "report_to": "none",
    "disable_tqdm": True,
    "save_strategy": "no",
    "logging_strategy": "steps",
    "logging_steps": 1,
}


def regression(overrides: dict[str, Any], n_train: int = 66) -> dict[str, Any]:
    return {
        "model": RegressionModel,
        "train": lambda: RegressionDataset(n_train),
        "eval": lambda: RegressionDataset(20, seed=7),
        "collator": lambda: None,
        "metrics": regression_metrics,
        "args": {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, **overrides},
    }


def language_model(overrides: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": gpt2,
        "train": lambda: [{"input_ids": r} for r in token_rows(44, seed=1)],
        "eval": lambda: [{"input_ids": r} for r in token_rows(10, seed=2)],
        "collator": lambda: transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
        "metrics": token_accuracy,
        "args": {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, **overrides},
    }


SCHEDULES = {
    # 17 batches, 3 per step: 6 steps an epoch, the last on a partial group of 2.
    "regression_linear_warmup_accumulation_epochs": regression(
        {
            "num_train_epochs": 5,
            "gradient_accumulation_steps": 3,
            "learning_rate": 0.05,
            "warmup_steps": 5,
            "weight_decay": 0.1,
            "eval_strategy": "epoch",
        }
    ),
    "regression_cosine_warmup_ratio_drop_last_data_seed": regression(
        {
            "max_steps": 34,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 0.1,
            "learning_rate": 0.03,
            "dataloader_drop_last": True,
            "data_seed": 7,
            "max_grad_norm": 0.5,
            "eval_strategy": "steps",
            "eval_steps": 10,
        }
    ),
    "regression_constant_with_warmup_no_clipping": regression(
        {
            "max_steps": 30,
            "lr_scheduler_type": "constant_with_warmup",
            "warmup_steps": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": 0.02,
            "max_grad_norm": 0.0,
            "seed": 3,
        }
    ),
    "regression_constant_fractional_epochs": regression(
        {"num_train_epochs": 2.5, "lr_scheduler_type": "constant", "learning_rate": 0.01},
        n_train=50,
    ),
    # 11 batches, 2 per step: 6 steps an epoch (the last on one batch); 5 epochs.
    "gpt2_linear_warmup_accumulation_token_scaling": language_model(
        {
            "num_train_epochs": 5,
            "gradient_accumulation_steps": 2,
            "learning_rate": 0.01,
            "warmup_steps": 3,
            "weight_decay": 0.01,
            "eval_strategy": "epoch",
        }
    ),
}


def _train(kind: str, spec: dict[str, Any], out: Path) -> dict[str, Any]:
    args = transformers.TrainingArguments(output_dir=str(out), **{**BASE, **spec["args"]})
    factory = transformers.Trainer if kind == "hf" else hf.Trainer
    model = spec["model"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = factory(
            model,
            args,
            train_dataset=spec["train"](),
            eval_dataset=spec["eval"](),
            data_collator=spec["collator"](),
            compute_metrics=spec["metrics"],
        )
        output = trainer.train()
    history = trainer.state.log_history
    return {
        "steps": [e for e in history if "loss" in e],
        "evals": [e for e in history if any(k.startswith("eval_") for k in e)],
        "output": tuple(output),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def both(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    spec = SCHEDULES[request.param]
    return _train("hf", spec, root / "hf"), _train("hookloop", spec, root / "hookloop")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_each_step_logs_transformers_loss_learning_rate_and_grad_norm(both: Any):
    theirs, ours = both
    assert len(theirs["steps"]) >= 30
    assert [e["step"] for e in ours["steps"]] == [e["step"] for e in theirs["steps"]]
    for mine, real in zip(ours["steps"], theirs["steps"], strict=True):
        assert sorted(mine) == sorted(real)
        for key in ("loss", "learning_rate", "grad_norm"):
            assert _rel(mine[key], real[key]) <= RTOL, (real["step"], key, mine[key], real[key])
        assert mine["epoch"] == pytest.approx(real["epoch"], rel=1e-9)


def test_evaluations_give_transformers_metrics(both: Any):
    theirs, ours = both
    assert [e["step"] for e in ours["evals"]] == [e["step"] for e in theirs["evals"]]
    for mine, real in zip(ours["evals"], theirs["evals"], strict=True):
        assert sorted(mine) == sorted(real)
        for key, value in real.items():
            if not key.endswith(SPEED_KEYS):
                assert _rel(mine[key], value) <= RTOL, (real["step"], key, mine[key], value)


def test_train_returns_transformers_train_output(both: Any):
    theirs, ours = both
    (step, loss, metrics), (real_step, real_loss, real_metrics) = ours["output"], theirs["output"]
    assert step == real_step
    assert _rel(loss, real_loss) <= RTOL
    # HF's summary, as transformers' (no total_flos: the PrinterCallback takes it out)
    assert set(metrics) == set(real_metrics)
    assert metrics["epoch"] == pytest.approx(real_metrics["epoch"])
    assert _rel(metrics["train_loss"], real_metrics["train_loss"]) <= RTOL


def test_final_weights_match_transformers(both: Any):
    theirs, ours = both
    assert list(ours["weights"]) == list(theirs["weights"])
    for name, real in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], real, rtol=1e-5, atol=1e-6, msg=name)


# -- a datasets.Dataset, batched as HF batches it ------------------------------------
class BatchRecorder:
    """The tensors each training forward receives, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches: list[dict[str, Any]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            self.batches.append(
                {k: v.tolist() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
            )
            self.keys = sorted(kwargs)


def _dataset_run(kind: str, out: Path) -> dict[str, Any]:
    rows = token_rows(30, seed=5)
    data = datasets.Dataset.from_dict(
        {
            "input_ids": rows,
            "topic": [f"row {i}" for i in range(len(rows))],  # not an argument of forward
            "length": [len(r) for r in rows],
        }
    )
    args = transformers.TrainingArguments(
        output_dir=str(out),
        **{**BASE, "logging_steps": 5},
        per_device_train_batch_size=4,
        num_train_epochs=2,
        seed=11,
        dataloader_drop_last=True,
    )
    model = gpt2()
    recorder = BatchRecorder(model)
    factory = transformers.Trainer if kind == "hf" else hf.Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        factory(
            model,
            args,
            train_dataset=data,
            data_collator=transformers.DataCollatorForLanguageModeling(tokenizer(), mlm=False),
        ).train()
    return {"batches": recorder.batches, "keys": recorder.keys}


def test_datasets_dataset_is_batched_exactly_as_transformers_batches_it(tmp_path: Path):
    theirs = _dataset_run("hf", tmp_path / "hf")
    ours = _dataset_run("hookloop", tmp_path / "hookloop")
    assert len(theirs["batches"]) == 2 * math.floor(30 / 4)
    assert ours["batches"] == theirs["batches"]
    # remove_unused_columns: the columns forward does not take never reach it
    assert ours["keys"] == theirs["keys"]
    assert "topic" not in ours["keys"] and "length" not in ours["keys"]


def _classification_run(kind: str, out: Path) -> dict[str, Any]:
    """A tokenizer as ``processing_class`` and no collator: HF pads with
    ``DataCollatorWithPadding`` and turns ``label`` into ``labels``."""
    rows = token_rows(18, seed=9)
    data = datasets.Dataset.from_dict(
        {
            "input_ids": rows,
            "label": [r[0] % 2 for r in rows],
            "text": [" ".join(f"w{t}" for t in r) for r in rows],
        }
    )
    args = transformers.TrainingArguments(
        output_dir=str(out), **BASE, per_device_train_batch_size=4, max_steps=6, data_seed=5
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, pad_token_id=0
    )
    model = transformers.GPT2ForSequenceClassification(config)
    recorder = BatchRecorder(model)
    factory = transformers.Trainer if kind == "hf" else hf.Trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = factory(model, args, train_dataset=data, processing_class=tokenizer())
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"batches": recorder.batches, "keys": recorder.keys, "losses": losses}


def test_a_tokenizer_pads_datasets_batches_as_transformers_pads_them(tmp_path: Path):
    theirs = _classification_run("hf", tmp_path / "hf")
    ours = _classification_run("hookloop", tmp_path / "hookloop")
    assert len(theirs["batches"]) == 6
    assert ours["batches"] == theirs["batches"]
    assert ours["keys"] == theirs["keys"]
    assert {"attention_mask", "labels"} <= set(ours["keys"]) and "text" not in ours["keys"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=RTOL)


def test_decay_exclusions_match_transformers_on_a_gpt2():
    model = gpt2()
    theirs = transformers.Trainer.get_decay_parameter_names(None, model)  # reads only model
    assert decay_parameter_names(model) == theirs
    assert "transformer.h.0.ln_1.weight" not in theirs and "lm_head.weight" in theirs


def _lm_losses(kind: str, out: Path, resume: str | None = None) -> dict[int, float]:
    spec = language_model({"num_train_epochs": 2, "save_strategy": "steps", "save_steps": 8})
    args = transformers.TrainingArguments(output_dir=str(out), **{**BASE, **spec["args"]})
    args.save_strategy = "steps"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        factory = transformers.Trainer if kind == "hf" else hf.Trainer
        trainer = factory(
            gpt2(), args, train_dataset=spec["train"](), data_collator=spec["collator"]()
        )
        trainer.train(resume_from_checkpoint=resume)
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def test_a_run_resumed_mid_epoch_logs_the_losses_of_an_uninterrupted_one(tmp_path: Path):
    theirs = _lm_losses("hf", tmp_path / "hf")  # uninterrupted, through transformers
    _lm_losses("hookloop", tmp_path / "run")  # 11 steps an epoch; saves at step 8 (and 16)
    resumed = _lm_losses("hookloop", tmp_path / "run", str(tmp_path / "run" / "checkpoint-8"))
    assert sorted(resumed) == list(range(1, 23))  # the log history comes back with the state
    for step, loss in resumed.items():  # after the resume too, dropout masks included
        assert _rel(loss, theirs[step]) <= RTOL, (step, loss, theirs[step])
