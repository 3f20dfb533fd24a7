"""transformers' example scripts, in miniature, run on transformers' Trainer and on the
dialect: the same command line, the only difference the import of the Trainer and its
arguments (``tests/_hf_example_tasks.py`` says what each script does).

Each task trains a tiny local model for 6 steps, evaluating and saving every 3, then
evaluates and predicts. Both runs must exit alike and leave the same files:
``all_results.json`` (timings aside), ``trainer_state.json`` at the end and in each
``checkpoint-N`` folder, the same ``checkpoint-N`` folders, the same predictions and
the same model card (``README.md``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

SCRIPT = Path(__file__).with_name("_hf_example_tasks.py")
ARGV = ["--do_train", "--do_eval", "--do_predict", "--max_steps", "6",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--logging_steps", "2", "--save_steps", "3", "--eval_strategy", "steps",
        "--eval_steps", "3", "--learning_rate", "5e-3", "--report_to", "none", "--use_cpu",
        "--seed", "0", "--disable_tqdm", "true"]  # fmt: skip

#: The tasks, with what each adds to the command line. The masked LM's collator draws
#: its masks from the generator dropout and evaluations draw from: its numbers match
#: only because the dialect, as transformers' loader, fetches each batch ahead.
TASKS = {"clm": [], "mlm": [], "glue": [], "ner": [],
         "summarization": ["--predict_with_generate"]}  # fmt: skip


def _timing(key: str) -> bool:
    return key.endswith(("_runtime", "_per_second"))


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not _timing(k)}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _run(kind: str, task: str, root: Path, *extra: str) -> tuple[int, Path, str]:
    out = root / kind / "out"  # the same folder name: the model card is named after it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    argv = [sys.executable, str(SCRIPT), kind, task, "--output_dir", str(out), *ARGV,
            *TASKS[task], *extra]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, out, done.stdout[-3000:] + done.stderr[-3000:]


def _json(path: Path) -> Any:
    return _without_timings(json.loads(path.read_text()))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_an_example_script_runs_alike_on_the_dialect(task: str, tmp_path: Path):
    (hf_rc, hf_out, hf_log), (our_rc, our_out, our_log) = (
        _run(kind, task, tmp_path) for kind in ("hf", "hookloop")
    )
    assert hf_rc == 0, hf_log
    assert our_rc == 0, our_log
    assert _json(our_out / "all_results.json") == pytest.approx(_json(hf_out / "all_results.json"))
    for name in ("train_results.json", "eval_results.json", "predict_results.json"):
        assert _json(our_out / name).keys() == _json(hf_out / name).keys(), name
    folders = sorted(p.name for p in hf_out.glob("checkpoint-*"))
    assert folders == ["checkpoint-3", "checkpoint-6"]
    assert sorted(p.name for p in our_out.glob("checkpoint-*")) == folders
    for where in ["", *folders]:
        theirs, ours = (
            _json(hf_out / where / "trainer_state.json"),
            _json(our_out / where / "trainer_state.json"),
        )
        assert ours.pop("log_history") == [pytest.approx(e) for e in theirs.pop("log_history")]
        assert ours == theirs, where
        # the model's config as transformers' Trainer leaves it: the class and dtype a
        # model's save records, the tokenizer's special tokens aligned before training,
        # and after generating (summarization) the generation config holding generate()'s
        # defaults
        for name in ("config.json", "generation_config.json"):
            assert (our_out / where / name).exists() == (hf_out / where / name).exists()
            if (hf_out / where / name).exists():
                assert _json(our_out / where / name) == _json(hf_out / where / name), name
    assert (our_out / "predictions.txt").read_text() == (hf_out / "predictions.txt").read_text()
    assert (our_out / "README.md").read_text() == (hf_out / "README.md").read_text()
    _same_weights(hf_out / "model.safetensors", our_out / "model.safetensors")
    if task == "mlm":
        _resumed_alike(tmp_path)


def _resumed_alike(root: Path) -> None:
    """Stopped after checkpoint-3 and run again with ``--resume_from_checkpoint``: the
    masked LM's collator draws its masks from the global generator, which transformers
    restores only after fetching the resumed epoch's first batches; the dialect does the
    same, so the resumed steps log transformers' losses and end on its weights."""
    outs = {}
    for kind in ("hf", "hookloop"):
        out = root / kind / "out"
        for path in out.iterdir():  # as if stopped right after the save at step 3
            if path.name not in ("checkpoint-3", "checkpoints"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        if (out / "checkpoints").exists():  # hookloop's own copy of the checkpoints
            shutil.rmtree(out / "checkpoints" / "step-00000006")
            (out / "checkpoints" / "latest").unlink()
            (out / "checkpoints" / "latest").symlink_to("step-00000003")
        rc, outs[kind], log = _run(kind, "mlm", root, "--resume_from_checkpoint",
                                   str(out / "checkpoint-3"))  # fmt: skip
        assert rc == 0, log
    theirs, ours = (_json(outs[k] / "trainer_state.json") for k in ("hf", "hookloop"))
    assert ours["log_history"] == [pytest.approx(e) for e in theirs["log_history"]]
    _same_weights(outs["hf"] / "model.safetensors", outs["hookloop"] / "model.safetensors")


def _same_weights(theirs: Path, ours: Path) -> None:
    """Equal tensors under every name both files hold; a name only one holds is a tied
    weight kept under another of its names (the same tensor)."""
    from safetensors.torch import load_file

    their, our = load_file(theirs), load_file(ours)
    shared = their.keys() & our.keys()
    assert len(shared) >= len(their) - 1, (sorted(their), sorted(our))
    assert all(torch.equal(their[name], our[name]) for name in shared)


def test_num_examples_counts_as_transformers_counts(tmp_path: Path):
    import torch
    import transformers

    from hookloop.compat import hf
    from hookloop.testing import TinyModel, ToyData

    args = hf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3)
    ours = hf.Trainer(TinyModel(), args, train_dataset=ToyData(n=8), loss_fn=TinyModel.loss_fn)
    loaders = [
        torch.utils.data.DataLoader(ToyData(n=7), batch_size=2),
        torch.utils.data.DataLoader(list(range(5)), batch_size=2),
    ]
    for loader in loaders:
        assert ours.num_examples(loader) == transformers.Trainer.num_examples(ours, loader)
    with pytest.raises(TypeError, match="create_model_card\\(\\) got licence"):
        ours.create_model_card(licence="mit")
