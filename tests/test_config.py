"""Config: nested dataclasses, YAML files and dotted overrides, with errors that teach."""

from __future__ import annotations

import pytest
import yaml

from hookloop.config import Config, TrainConfig, apply_overrides, describe, dump_yaml, load_yaml
from hookloop.recipes import default_config

#: Every settable key of the base Config. Growing this set should be a deliberate choice:
#: add the new key here in the same change that adds it to hookloop.config.
BASE_KEYS = {
    "train.parallel",
    "train.watchdog_seconds",
    "logging.tensorboard",
    "logging.wandb",
    "logging.wandb_project",
    "logging.progress_interval",
    "callbacks.profile",
    "callbacks.diloco",
    "callbacks.ema_decay",
    "callbacks.ema_eval",
    "train.compile",
    "train.activation_checkpointing",
    "callbacks.info",
    "callbacks.metrics",
    "callbacks.peak_flops",
    "callbacks.nan_detection",
    "callbacks.divergence",
    "callbacks.textgen",
    "callbacks.early_stopping_patience",
    "control.allow_remote_without_auth",
    "control.disable_auth",
    "control.enabled",
    "control.host",
    "control.port",
    "recipe",
    "seed",
    "data.batch_size",
    "data.eval_batch_size",
    "data.shuffle",
    "data.num_workers",
    "data.ledger",
    "data.auto_batch_start",
    "optimizer.name",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.betas",
    "optimizer.eps",
    "optimizer.momentum",
    "optimizer.kwargs",
    "scheduler.name",
    "scheduler.warmup_steps",
    "scheduler.min_lr_ratio",
    "scheduler.kwargs",
    "train.max_steps",
    "train.max_epochs",
    "train.grad_accum",
    "train.clip_grad_norm",
    "train.precision",
    "train.device",
    "train.log_every",
    "train.eval_every",
    "train.eval_at_epoch_end",
    "train.eval_max_batches",
    "train.skip_nonfinite",
    "train.max_skipped_steps",
    "train.max_skipped_fraction",
    "train.exit_interval",
    "train.exit_duration_minutes",
    "train.iterations_to_skip",
    "train.handle_signals",
    "train.deterministic",
    "callbacks.straggler_every",
    "callbacks.straggler_threshold",
    "train.flops_per_sample",
    "train.gc_every",
    "train.gc_eval",
    "train.timers",
    "train.log_timers",
    "train.log_num_zeros_in_grad",
    "logging.progress_log",
    "checkpoint.every",
    "checkpoint.keep_last",
    "checkpoint.save_on_end",
    "checkpoint.monitor",
    "checkpoint.mode",
    "checkpoint.keep_best",
    "checkpoint.strict_resume",
    "checkpoint.allow_restart",
    "checkpoint.pretrained",
    "checkpoint.async_save",
    "checkpoint.local_every",
    "checkpoint.local_dir",
    "callbacks.divergence_action",
    "callbacks.rewind_skip_batches",
    "callbacks.rewind_lr_factor",
    "callbacks.rewind_lr_steps",
    "callbacks.max_rewinds",
    "logging.progress",
    "logging.json",
    "logging.csv",
    "logging.mlflow",
    "logging.mlflow_uri",
    "logging.mlflow_experiment",
    "callbacks.model_summary",
    "callbacks.torch_profile",
}


def test_the_set_of_config_keys_is_pinned():
    assert {key for key, _, _ in describe(Config())} == BASE_KEYS


def test_every_key_has_a_doc_line():
    undocumented = [key for key, _, doc in describe(Config()) if not doc.strip()]
    assert undocumented == []


def test_recipe_config_adds_its_model_and_data_keys():
    keys = {key for key, _, _ in describe(default_config("mlp-regression"))}
    assert {"model.inputs", "model.hidden", "data.train_samples", "data.noise"} <= keys
    assert keys >= BASE_KEYS


def test_defaults_validate():
    cfg = Config()
    assert cfg.validate() is cfg
    assert default_config("mlp-regression").validate().recipe == "mlp-regression"


# -- dotted overrides ----------------------------------------------------------------------


def test_dotted_overrides_set_typed_values():
    cfg = apply_overrides(
        Config(),
        [
            "train.max_steps=20",
            "optimizer.lr=1e-3",
            "optimizer.betas=[0.8, 0.95]",
            "train.clip_grad_norm=2",
            "train.eval_at_epoch_end=false",
            "train.iterations_to_skip=[3, 5]",
            "seed=7",
            "checkpoint.monitor=eval_loss",
        ],
    )
    assert cfg.train.max_steps == 20
    assert cfg.optimizer.lr == 0.001 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == (0.8, 0.95)
    assert cfg.train.clip_grad_norm == 2.0 and isinstance(cfg.train.clip_grad_norm, float)
    assert cfg.train.eval_at_epoch_end is False
    assert cfg.train.iterations_to_skip == [3, 5]
    assert cfg.seed == 7
    assert cfg.checkpoint.monitor == "eval_loss"


def test_comma_separated_lists_are_accepted():
    cfg = apply_overrides(Config(), ["optimizer.betas=0.5,0.6", "train.iterations_to_skip=2,4"])
    assert cfg.optimizer.betas == (0.5, 0.6)
    assert cfg.train.iterations_to_skip == [2, 4]


def test_a_single_step_can_be_given_for_a_list_key():
    cfg = apply_overrides(Config(), ["train.iterations_to_skip=2"])
    assert cfg.train.iterations_to_skip == [2]


def test_later_overrides_win_and_values_may_contain_equals_signs():
    cfg = apply_overrides(
        Config(), ["train.max_steps=5", "train.max_steps=9", "checkpoint.pretrained=a=b.pt"]
    )
    assert cfg.train.max_steps == 9
    assert cfg.checkpoint.pretrained == "a=b.pt"


@pytest.mark.parametrize("raw", ["null", "None", "~"])
def test_null_sets_an_optional_key_to_none(raw):
    cfg = Config()
    cfg.train.max_steps = 10
    apply_overrides(cfg, [f"train.max_steps={raw}", f"train.clip_grad_norm={raw}"])
    assert cfg.train.max_steps is None
    assert cfg.train.clip_grad_norm is None


def test_null_for_a_required_key_names_the_key_and_type():
    with pytest.raises(ValueError, match=r"train\.grad_accum expects int, got None"):
        apply_overrides(Config(), ["train.grad_accum=null"])


def test_unknown_key_names_itself_and_lists_its_sections_keys():
    with pytest.raises(ValueError) as info:
        apply_overrides(Config(), ["train.max_step=3"])
    message = str(info.value)
    assert "'train.max_step'" in message
    assert "Did you mean 'max_steps'" in message
    assert "Valid keys in train:" in message
    for key in ("max_steps", "grad_accum", "log_every", "iterations_to_skip"):
        assert key in message
    assert "lr" not in message.split("Valid keys in train:")[1]  # only the train section


def test_unknown_section_suggests_the_right_one():
    with pytest.raises(ValueError, match="Did you mean 'train'") as info:
        apply_overrides(Config(), ["trian.max_steps=3"])
    assert "optimizer" in str(info.value)


def test_unknown_recipe_model_key_lists_the_recipes_model_keys():
    with pytest.raises(ValueError, match="Did you mean 'hidden'") as info:
        apply_overrides(default_config("mlp-regression"), ["model.hiden=3"])
    assert "inputs, hidden, outputs, dropout" in str(info.value)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.max_steps=abc", r"train\.max_steps expects int \| null, got 'abc'"),
        ("train.max_steps=2.5", r"train\.max_steps expects int"),
        ("train.max_steps=true", r"train\.max_steps expects int"),
        ("optimizer.lr=fast", r"optimizer\.lr expects float, got 'fast'"),
        ("train.handle_signals=maybe", r"train\.handle_signals expects bool"),
        ("optimizer.betas=[0.9]", r"optimizer\.betas expects tuple\[float, float\]"),
        ("seed=abc", r"seed expects int"),
    ],
)
def test_wrongly_typed_value_names_the_key_and_expected_type(override, expected):
    with pytest.raises(ValueError, match=expected):
        apply_overrides(Config(), [override])


def test_literal_choices_are_listed():
    with pytest.raises(ValueError) as info:
        apply_overrides(Config(), ["train.precision=fp8"])
    message = str(info.value)
    assert "train.precision" in message and "'fp8'" in message
    for choice in ("'fp32'", "'bf16'", "'fp16'"):
        assert choice in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train=3", "is a section"),
        ("train.max_steps.deep=1", "is a value, not a section"),
        ("max_steps", "must look like section.key=value"),
    ],
)
def test_malformed_overrides_explain_the_shape(override, expected):
    with pytest.raises(ValueError, match=expected):
        apply_overrides(Config(), [override])


# -- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("train.grad_accum=0", "train.grad_accum", ">= 1"),
        ("train.max_steps=0", "train.max_steps", ">= 1"),
        ("train.log_every=-1", "train.log_every", ">= 0"),
        ("train.clip_grad_norm=0", "train.clip_grad_norm", "> 0 or null"),
        ("train.exit_duration_minutes=0", "train.exit_duration_minutes", "> 0 or null"),
        ("train.iterations_to_skip=[0]", "train.iterations_to_skip", ">= 1"),
        ("train.device=tpu", "train.device", "'cuda:N'"),
        ("optimizer.lr=-1", "optimizer.lr", ">= 0"),
        ("optimizer.lr=.inf", "optimizer.lr", "finite"),
        ("optimizer.momentum=1", "optimizer.momentum", "[0, 1)"),
        ("optimizer.betas=[0.9, 1.0]", "optimizer.betas", "[0, 1)"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay", ">= 0"),
        ("scheduler.min_lr_ratio=1.5", "scheduler.min_lr_ratio", "[0, 1]"),
        ("scheduler.warmup_steps=-3", "scheduler.warmup_steps", ">= 0"),
        ("data.batch_size=0", "data.batch_size", ">= 1"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last", ">= 1"),
        ("seed=-1", "seed", ">= 0"),
    ],
)
def test_validate_names_the_key_and_the_allowed_range(override, key, allowed):
    cfg = apply_overrides(Config(), [override])  # the type is fine; the value is not
    with pytest.raises(ValueError) as info:
        cfg.validate()
    message = str(info.value)
    assert message.startswith(f"{key} ")
    assert allowed in message


def test_recipe_sections_are_validated_too():
    cfg = apply_overrides(default_config("mlp-regression"), ["model.hidden=0"])
    with pytest.raises(ValueError, match=r"model\.hidden must be an int >= 1, got 0"):
        cfg.validate()


def test_trainer_rejects_an_invalid_config(make_config):
    from hookloop import Trainer
    from hookloop.testing import TinyModel, ToyData

    cfg = make_config(grad_accum=0)
    with pytest.raises(ValueError, match=r"train\.grad_accum"):
        Trainer(TinyModel(), train_data=ToyData(8), loss_fn=TinyModel.loss_fn, config=cfg)


# -- YAML ----------------------------------------------------------------------------------


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_file_sets_nested_values(tmp_path):
    path = _write(
        tmp_path,
        """
seed: 3
optimizer:
  name: sgd
  lr: 0.5
  betas: [0.7, 0.8]
train:
  max_steps: 40
  clip_grad_norm: null
  precision: bf16
model:
  hidden: 16
""",
    )
    cfg = load_yaml(path, default_config("mlp-regression"))
    assert cfg.seed == 3
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.betas) == ("sgd", 0.5, (0.7, 0.8))
    assert cfg.train.max_steps == 40
    assert cfg.train.clip_grad_norm is None
    assert cfg.train.precision == "bf16"
    assert cfg.model.hidden == 16
    assert cfg.model.inputs == 32  # untouched keys keep the recipe default


def test_unknown_key_in_a_yaml_section_names_the_dotted_key(tmp_path):
    path = _write(tmp_path, "train:\n  max_step: 5\n")
    with pytest.raises(ValueError) as info:
        load_yaml(path, Config())
    assert "'train.max_step'" in str(info.value)
    assert "Did you mean 'max_steps'" in str(info.value)
    assert "Valid keys in train:" in str(info.value)


def test_unknown_section_in_yaml_is_refused(tmp_path):
    path = _write(tmp_path, "trainer:\n  max_steps: 5\n")
    with pytest.raises(ValueError, match=r"unknown config key 'trainer'.*Did you mean 'train'"):
        load_yaml(path, Config())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("train:\n  max_steps: abc\n", r"train\.max_steps expects int \| null"),
        ("train:\n  precision: fp8\n", r"'fp32' \| 'bf16' \| 'fp16'"),
        ("train: 5\n", "train is a section; give it a mapping"),
        ("- a\n- b\n", "must hold a mapping of sections"),
        ("train: [unclosed\n", "is not valid YAML"),
    ],
)
def test_bad_yaml_content_is_reported(tmp_path, text, expected):
    with pytest.raises(ValueError, match=expected):
        load_yaml(_write(tmp_path, text), Config())


def test_missing_yaml_file_is_reported(tmp_path):
    with pytest.raises(ValueError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml", Config())


def test_empty_yaml_file_changes_nothing(tmp_path):
    cfg = load_yaml(_write(tmp_path, ""), Config())
    assert cfg.to_dict() == Config().to_dict()


def test_resolved_config_round_trips_through_yaml(tmp_path):
    original = apply_overrides(
        default_config("mlp-regression"),
        ["train.max_steps=30", "optimizer.betas=[0.5, 0.25]", "train.iterations_to_skip=[4]"],
    )
    path = _write(tmp_path, yaml.safe_dump(original.to_dict(), sort_keys=False))

    reloaded = load_yaml(path, default_config("mlp-regression"))

    assert reloaded == original
    assert reloaded.optimizer.betas == (0.5, 0.25)


def test_train_config_alone_is_accepted_by_the_trainer():
    from hookloop import Trainer
    from hookloop.testing import TinyModel, ToyData

    trainer = Trainer(
        TinyModel(),
        train_data=ToyData(64),  # the default batch size is 32
        loss_fn=TinyModel.loss_fn,
        config=TrainConfig(max_steps=2, handle_signals=False, device="cpu"),
    )
    assert trainer.config.train.max_steps == 2
    assert trainer.train().step == 2


def test_the_yaml_written_into_checkpoints_is_what_safe_dump_writes():
    cfg = Config()
    cfg.train.iterations_to_skip = [3, 5]
    cfg.checkpoint.monitor = "eval_loss — lower is better ✓"
    data = {**cfg.to_dict(), "notes": "a long line " * 20, "empty": {}, "none": None}
    assert dump_yaml(data) == yaml.safe_dump(data, sort_keys=False)
    assert yaml.safe_load(dump_yaml(data)) == data
