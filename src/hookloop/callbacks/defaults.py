"""The callback set `hookloop train` runs with, each switchable by a config key.

=====================  ========  ==================================
callback               priority  config key
=====================  ========  ==================================
InfoCallback                  1  callbacks.info
ModelSummary                  1  callbacks.model_summary
ProfilerCallback             15  callbacks.torch_profile (START:END; off by default)
NaNDetection                  5  callbacks.nan_detection
DefaultMetrics               20  callbacks.metrics (callbacks.peak_flops for MFU)
TextgenCallback              60  callbacks.textgen (text recipes)
DivergenceDetector           80  callbacks.divergence
EarlyStopping                90  callbacks.early_stopping_patience
EMA                          12  callbacks.ema_decay (off by default), callbacks.ema_eval
StragglerDetection            2  callbacks.straggler_every (off by default)
DiLoCoCallback               15  callbacks.diloco (on when DILOCO_SERVER is set)
JsonLogger                  100  logging.json
CSVLogger                   100  logging.csv (metrics.csv; off by default)
MLflowLogger                100  logging.mlflow (off by default)
ProgressLog                 100  logging.progress_log (progress.txt: writes only at saves)
TBLogger                    100  logging.tensorboard
WandbLoggingCallback         80  logging.wandb
ProgressBar                 110  logging.progress
ResumeNotice                110  (always)
=====================  ========  ==================================

The Python :class:`hookloop.Trainer` given an ``out_dir`` adds the same set beside
the user's callbacks (:mod:`hookloop.trainer`).

Two more pieces are not in this list: ``hookloop train`` adds the HTTP control
server (``hookloop.control.ControlServer``, key ``control.enabled``) itself, and
checkpointing is not a callback: ``--out`` gives the Trainer its checkpoint
directory and the ``checkpoint.*`` keys set the policy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hookloop.callback import Callback
from hookloop.config import Config
from hookloop.errors import ConfigError
from hookloop.rundir import RunDir
from hookloop.state import CallbackContext

#: Fixed prompts for sampling from the default recipe's model.
TEXT_PROMPTS = ("def ", "import ", "class Parser:\n    ")


def default_callbacks(cfg: Config, run_dir: str | Path | None) -> list[Callback]:
    """Build the default set for ``cfg`` writing under ``run_dir`` (None: no files)."""
    from hookloop.callbacks.divergence import DivergenceDetector
    from hookloop.callbacks.info import InfoCallback
    from hookloop.callbacks.metrics import DefaultMetrics
    from hookloop.callbacks.nan_detection import NaNDetection

    run = RunDir(run_dir) if run_dir is not None else None
    on = cfg.callbacks
    callbacks: list[Callback] = []
    if on.info:
        callbacks.append(InfoCallback())
    if on.model_summary:
        from hookloop.callbacks.model_summary import ModelSummary

        callbacks.append(ModelSummary())
    if on.torch_profile is not None:
        callbacks.append(_torch_profiler(on.torch_profile, run))
    if on.nan_detection:
        callbacks.append(NaNDetection())
    if on.metrics:
        callbacks.append(DefaultMetrics(peak_flops=on.peak_flops))
    if on.textgen and _generates_text(cfg):
        from hookloop.callbacks.textgen import TextgenCallback

        samples = run.samples if run is not None else None
        callbacks.append(TextgenCallback(list(TEXT_PROMPTS), path=samples, max_new_tokens=48))
    if on.divergence:
        callbacks.append(
            DivergenceDetector(
                action=on.divergence_action,
                skip_batches=on.rewind_skip_batches,
                lr_factor=on.rewind_lr_factor,
                lr_steps=on.rewind_lr_steps,
                max_rewinds=on.max_rewinds,
            )
        )
    if on.early_stopping_patience is not None:
        from hookloop.callbacks.early_stopping import EarlyStopping

        callbacks.append(EarlyStopping(patience=on.early_stopping_patience))
    if on.straggler_every is not None:
        from hookloop.callbacks.straggler import StragglerDetection

        callbacks.append(
            StragglerDetection(every=on.straggler_every, threshold=on.straggler_threshold)
        )
    if on.ema_decay is not None:
        from hookloop.callbacks.ema import EMA

        callbacks.append(EMA(on.ema_decay, eval_with_ema=on.ema_eval))
    if _diloco_wanted(on.diloco):
        from hookloop.diloco.callback import DiLoCoCallback

        callbacks.append(DiLoCoCallback())  # server, sync period, ... from DILOCO_* variables
    callbacks += _loggers(cfg, run)
    callbacks.append(ResumeNotice())
    return callbacks


def _loggers(cfg: Config, run: RunDir | None) -> list[Callback]:
    """The ``logging.*`` part of the set: files under ``run`` (None: none), W&B, progress."""
    from hookloop.callbacks.jsonlog import JsonLogger
    from hookloop.callbacks.progress import ProgressBar

    log = cfg.logging
    callbacks: list[Callback] = []
    if log.json and run is not None:
        callbacks.append(JsonLogger(run.metrics))
    if log.progress_log and run is not None:
        from hookloop.callbacks.progress_log import ProgressLog

        callbacks.append(ProgressLog(run.progress_log))
    if log.csv and run is not None:
        from hookloop.callbacks.csv_logger import CSVLogger

        callbacks.append(CSVLogger(run.metrics_csv))
    if log.mlflow:
        from hookloop.callbacks.mlflow_logger import MLflowLogger

        uri = log.mlflow_uri or (run.mlruns.resolve().as_uri() if run is not None else None)
        callbacks.append(MLflowLogger(tracking_uri=uri, experiment=log.mlflow_experiment))
    if log.tensorboard and run is not None:
        from hookloop.callbacks.tensorboard import TBLogger

        callbacks.append(TBLogger(run.tensorboard))
    if log.wandb:
        from hookloop.callbacks.wandb_logger import WandbLoggingCallback

        # wandb.init(dir=D) writes under D/wandb: D is the parent of the run's wandb part.
        wandb_dir = run.wandb.parent if run is not None else None
        callbacks.append(WandbLoggingCallback(project=log.wandb_project, dir=wandb_dir))
    if log.progress:
        callbacks.append(ProgressBar(min_interval=log.progress_interval))
    return callbacks


def _torch_profiler(window: str, run: RunDir | None) -> Callback:
    """``callbacks.torch_profile=START:END``: steps START..END (counted from 1) traced,
    after a warm-up step where there is one; the files are named after step END."""
    from hookloop.callbacks.profiler import ProfilerCallback
    from hookloop.config_sections import profile_window

    first, last = profile_window(window)
    output_dir = run.profile if run is not None else None
    return ProfilerCallback(start_step=first - 1, num_steps=last - first + 1, output_dir=output_dir)


class ResumeNotice(Callback):
    """One line on stderr where a resume starts: the step and the checkpoint's path
    (a rewind says its own)."""

    priority = 110

    def on_checkpoint_load(self, ctx: CallbackContext) -> None:
        if ctx.rewind is None and ctx.state.is_rank_zero:
            print(
                f"hookloop: resumed at step {ctx.state.step} from {ctx.checkpoint_path}",
                file=sys.stderr,
                flush=True,
            )


def _diloco_wanted(setting: bool | None) -> bool:
    """``callbacks.diloco``: null follows DILOCO_SERVER; true without it is an error."""
    server = os.environ.get("DILOCO_SERVER", "").strip()
    if setting and not server:
        raise ConfigError(
            "callbacks.diloco=true needs DILOCO_SERVER=host:port, the address of a "
            "`hookloop diloco serve` (or leave callbacks.diloco null: on when it is set)"
        )
    return bool(server) if setting is None else setting


def _generates_text(cfg: Config) -> bool:
    from hookloop.recipes.gpt import GPTConfig

    return isinstance(cfg.model, GPTConfig)
