"""``hookloop lr-find --recipe NAME [KEY=VALUE ...]``: the learning-rate range test of a
recipe (:mod:`hookloop.tune.lr_find`), printing the suggestion and drawing the curve."""

from __future__ import annotations

import argparse
from typing import Any


def add_lr_find_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``hookloop lr-find`` to argparse sub-parsers."""
    parser = subparsers.add_parser("lr-find", help="sweep a recipe's learning rate, suggest one")
    parser.add_argument("--recipe", required=True, help="recipe name (see `hookloop recipes`)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config values")
    parser.add_argument("--min-lr", type=float, default=1e-7, help="first rate (1e-7)")
    parser.add_argument("--max-lr", type=float, default=1.0, help="last rate (1)")
    parser.add_argument("--steps", type=int, default=100, help="steps at most (100)")
    parser.add_argument("--plot", help="PNG file to draw the smoothed loss and suggestion in")
    parser.set_defaults(run=main_lr_find)
    return parser


def main_lr_find(args: argparse.Namespace) -> int:
    """Build the recipe's Trainer (no run directory: a sweep leaves nothing), sweep, print."""
    from hookloop.config import apply_overrides
    from hookloop.entry import build_trainer
    from hookloop.recipes import default_config
    from hookloop.tune.lr_find import lr_find

    cfg = default_config(args.recipe)
    apply_overrides(cfg, list(args.overrides))
    cfg.train.max_steps = max(cfg.train.max_steps or 0, args.steps)  # room for the sweep
    cfg.train.max_epochs = None
    result = lr_find(
        lambda: build_trainer(cfg),
        min_lr=args.min_lr,
        max_lr=args.max_lr,
        steps=args.steps,
        plot=args.plot,
    )
    print(f"swept {len(result.lrs)} rates from {result.lrs[0]:.3g} to {result.lrs[-1]:.3g} "
          f"({result.stop_reason})")  # fmt: skip
    if result.suggestion is None:
        print("no suggestion: too few steps before the loss rose (widen --min-lr/--max-lr)")
    else:
        print(f"suggested learning rate: {result.suggestion:.3g}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
