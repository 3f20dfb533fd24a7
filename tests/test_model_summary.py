"""The model summary printed at the start of a run and by `hookloop summary`, and
callbacks.torch_profile=START:END writing torch.profiler traces of those steps."""

from __future__ import annotations

import json

import pytest
import torch

from hookloop.app.cli import main
from hookloop.callbacks.model_summary import format_summary, summarize
from hookloop.config import Config, apply_overrides
from hookloop.errors import ConfigError

QUIET = ["logging.progress=false", "logging.tensorboard=false", "control.enabled=false"]


class TiedLM(torch.nn.Module):
    """An embedding whose weight the output layer shares, and a frozen encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.encoder = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.encoder.requires_grad_(False)


def test_totals_count_a_tied_weight_once_and_split_trainable_from_frozen():
    model = TiedLM()
    rows = {r.name: r for r in summarize(model)}

    assert sum(r.params for r in rows.values()) == sum(p.numel() for p in model.parameters())
    assert (rows["embed"].params, rows["head"].params) == (40, 0)  # the shared weight once
    assert (rows["encoder"].trainable, rows["encoder"].frozen) == (0, 20)
    assert rows["(own)"].params == 1  # held by the model itself, in no child
    assert sum(r.bytes for r in rows.values()) == 61 * 4
    text = format_summary(list(rows.values()))
    total = text.splitlines()[-1].split("|")
    assert [cell.strip() for cell in total] == ["", "Total", "", "61", "41", "20", "244"]


def test_a_run_prints_the_summary_once_and_the_key_turns_it_off(tmp_path, capsys):
    args = ["train", "--recipe", "mlp-regression", *QUIET, "train.max_steps=2"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().err.count("model summary:") == 1

    assert main([*args, "--out", str(tmp_path / "b"), "callbacks.model_summary=false"]) == 0
    assert "model summary:" not in capsys.readouterr().err


def test_hookloop_summary_prints_the_table_without_training(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["summary", "--recipe", "gpt-stdlib", "model.n_layer=1"]) == 0
    out = capsys.readouterr().out
    assert "| tok_emb | Embedding" in out
    assert "| head    | Linear     | 0 " in out  # tied to tok_emb: counted there
    assert not (tmp_path / "runs").exists()


def test_torch_profile_traces_the_steps_it_names(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--recipe", "mlp-regression", "--out", str(out), *QUIET]
    assert main([*args, "train.max_steps=8", "callbacks.torch_profile=3:5"]) == 0

    files = sorted(p.name for p in (out / "profile").iterdir())
    assert files == ["summary_step5_rank0.txt", "trace_step5_rank0.json"]
    trace = json.loads((out / "profile" / "trace_step5_rank0.json").read_text())
    marks = {e["name"] for e in trace["traceEvents"] if e["name"].startswith("hookloop step")}
    assert marks == {"hookloop step 3", "hookloop step 4", "hookloop step 5"}  # not 2: warm-up


@pytest.mark.parametrize("value", ["5:3", "0:4", "4:4", "a:b", "7"])
def test_a_bad_profile_window_is_one_line_naming_the_form(value):
    cfg = apply_overrides(Config(), [f"callbacks.torch_profile={value}"])
    with pytest.raises(ConfigError, match=r"must be START:END with 1 <= START < END") as err:
        cfg.validate()
    assert "\n" not in str(err.value)
