"""Recipes: small ready-made configurations that build a model and its data.

A recipe has a name, a default :class:`~hookloop.config.Config` (with its own
``model`` and ``data`` sections) and a ``build(config)`` function returning
:class:`RecipeParts`. ``hookloop recipes`` lists them; ``hookloop train
--recipe NAME`` runs one. :func:`resolve_config` is the config a command runs
with: a recipe's defaults, then a YAML file, then dotted overrides.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from hookloop.callback import Callback
from hookloop.config import Config, apply_overrides, load_yaml


@dataclass
class RecipeParts:
    """What a recipe builds; the entry point adds optimizer, scheduler and Trainer."""

    model: torch.nn.Module
    train_data: Iterable[Any]
    eval_data: Iterable[Any] | None = None
    test_data: Iterable[Any] | None = None
    forward_step: Callable[..., Any] | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    callbacks: list[Callback] = field(default_factory=list)
    #: Training FLOPs per sample (forward + backward), when the recipe can estimate it.
    flops_per_sample: float | None = None


@dataclass
class Recipe:
    name: str
    description: str
    default_config: Callable[[], Config]
    build: Callable[[Config], RecipeParts]


_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    if recipe.name in _RECIPES:
        raise ValueError(f"a recipe named {recipe.name!r} is already registered")
    _RECIPES[recipe.name] = recipe
    return recipe


def _load_builtin() -> None:
    # Importing the modules registers their recipes.
    from hookloop.recipes import gpt, mlp  # noqa: F401


def recipe_names() -> list[str]:
    _load_builtin()
    return sorted(_RECIPES)


def get_recipe(name: str) -> Recipe:
    _load_builtin()
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, list(_RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown recipe {name!r}.{hint} Available recipes: {', '.join(sorted(_RECIPES))}"
        )
    return _RECIPES[name]


def default_config(name: str) -> Config:
    """A fresh copy of recipe ``name``'s default configuration."""
    cfg = get_recipe(name).default_config()
    cfg.recipe = name
    return cfg


def resolve_config(recipe: str | None, config_file: str | None, overrides: list[str]) -> Config:
    """Recipe defaults, then the YAML file, then the command-line overrides."""
    name = recipe
    if name is None and config_file:
        data = (
            yaml.safe_load(Path(config_file).read_text()) if Path(config_file).is_file() else None
        )
        if isinstance(data, dict) and isinstance(data.get("recipe"), str):
            name = data["recipe"]
    for item in overrides:
        if item.startswith("recipe="):
            name = item.split("=", 1)[1]
    cfg = default_config(name or Config().recipe)
    if config_file:
        load_yaml(config_file, cfg)
    apply_overrides(cfg, [o for o in overrides if not o.startswith("recipe=")])
    return cfg.validate()
