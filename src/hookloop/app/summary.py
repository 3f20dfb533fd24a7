"""``hookloop summary --recipe NAME [KEY=VALUE ...]``: the model's table, without training.

Builds the recipe's parts from the resolved config (as ``hookloop train`` would, seeded,
on the CPU) and prints :func:`hookloop.callbacks.model_summary.format_summary` of its
model: the table ``hookloop train`` prints at the start of a run.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_summary_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop summary``; the parser's ``run`` default runs it."""
    from hookloop.app.cli import COMMANDS

    summary = subparsers.add_parser("summary", help=COMMANDS["summary"][0])
    summary.add_argument("--recipe", help="recipe name (see `hookloop recipes`)")
    summary.add_argument("--config", help="YAML file with config values")
    summary.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model.n_layer=4")
    summary.set_defaults(run=_summary)
    return summary


def _summary(args: argparse.Namespace) -> int:
    from hookloop.callbacks.model_summary import format_summary, summarize
    from hookloop.entry import seed_everything
    from hookloop.recipes import get_recipe, resolve_config

    cfg = resolve_config(args.recipe, args.config, args.overrides)
    cfg.validate()
    seed_everything(cfg.seed)
    model = get_recipe(cfg.recipe).build(cfg).model
    print(f"model summary of recipe {cfg.recipe}:")
    print(format_summary(summarize(model)))
    return 0
