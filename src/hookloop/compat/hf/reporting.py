"""``report_to``: HF's integration names mapped onto hookloop's loggers.

``"tensorboard"`` is :class:`hookloop.callbacks.TBLogger` writing to
``$TENSORBOARD_LOGGING_DIR``, else ``args.logging_dir``, else
``<output_dir>/runs``; ``"wandb"`` is :class:`hookloop.callbacks.WandbLoggingCallback`
with HF's project (``$WANDB_PROJECT``, default ``"huggingface"``) and
``run_name``, offline unless ``$WANDB_MODE`` says otherwise; ``"none"`` (HF's
default in transformers 5) or an empty list adds nothing; ``"all"`` is every
one of the two whose package is installed. Any other name is an error.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from hookloop.callback import Callback
from hookloop.compat.hf.optim import arg

REPORTERS = ("tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def normalize(report_to: Any) -> list[str]:
    """``report_to`` as a list of integration names (``"all"`` expanded, ``"none"`` empty)."""
    if report_to is None:
        return []
    names = [report_to] if isinstance(report_to, str) else report_to
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"report_to must be a name or a list of names ({', '.join(REPORTERS)}, 'all', "
            f"'none'), got {report_to!r}"
        )
    if list(names) in (["none"], []):
        return []
    if list(names) == ["all"]:
        return [n for n in REPORTERS if importlib.util.find_spec(_PACKAGES[n]) is not None]
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:
        raise ValueError(
            f"report_to names {', '.join(map(repr, unknown))}, which hookloop.compat.hf does not "
            f"report to; allowed: {', '.join(REPORTERS)}, 'all' or 'none'"
        )
    return list(dict.fromkeys(names))


def loggers(args: Any) -> list[Callback]:
    """The hookloop loggers ``args.report_to`` asks for, in HF's order."""
    made: list[Callback] = []
    for name in normalize(arg(args, "report_to", "none")):
        if name == "tensorboard":
            from hookloop.callbacks.tensorboard import TBLogger

            made.append(TBLogger(_tb_dir(args)))
        else:
            from hookloop.callbacks.wandb_logger import WandbLoggingCallback

            made.append(
                WandbLoggingCallback(
                    os.environ.get("WANDB_PROJECT", "huggingface"), name=arg(args, "run_name", None)
                )
            )
    return made


def _tb_dir(args: Any) -> str:
    where = os.environ.get("TENSORBOARD_LOGGING_DIR") or arg(args, "logging_dir", None)
    if where:
        return os.path.expanduser(str(where))
    output_dir = arg(args, "output_dir", None)
    if not output_dir:
        raise ValueError(
            "report_to='tensorboard' needs a directory: set TrainingArguments.output_dir or "
            "logging_dir (or $TENSORBOARD_LOGGING_DIR)"
        )
    return os.path.join(str(output_dir), "runs")
