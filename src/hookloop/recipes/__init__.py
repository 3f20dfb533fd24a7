"""Recipes: small ready-made configurations that build a model and its data.

A recipe has a name, a default :class:`~hookloop.config.Config` (with its own
``model`` and ``data`` sections) and a ``build(config)`` function returning
:class:`RecipeParts`. ``hookloop recipes`` lists them; ``hookloop train
--recipe NAME`` runs one. :func:`resolve_config` is the config a command runs
with: a recipe's defaults, then a YAML file, then dotted overrides.

A user's own recipe is named by import path, ``package.module:object`` (see
:func:`import_recipe`): every command that takes ``--recipe`` accepts it, the run's
``config.yaml`` records it as ``recipe:``, and each process (a ``hookloop tune`` worker,
a torchrun rank, a ``--resume auto``) imports it again by that path.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from hookloop.callback import Callback
from hookloop.config import Config, apply_overrides, load_yaml
from hookloop.errors import ConfigError


@dataclass
class RecipeParts:
    """What a recipe builds; the entry point adds the Trainer, and the optimizer and
    scheduler from the config unless the recipe brings its own."""

    model: torch.nn.Module
    train_data: Iterable[Any]
    eval_data: Iterable[Any] | None = None
    test_data: Iterable[Any] | None = None
    forward_step: Callable[..., Any] | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    callbacks: list[Callback] = field(default_factory=list)
    #: Training FLOPs per sample (forward + backward), when the recipe can estimate it.
    flops_per_sample: float | None = None
    #: The recipe's own optimizer, or a function of the model that makes one (called once
    #: the model is on its device, and sharded); None: ``config.optimizer``.
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], Any] | None = None
    #: The recipe's own LR scheduler, or a function of the optimizer that makes one;
    #: None: ``config.scheduler``.
    scheduler: Any = None


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


def is_import_path(name: str) -> bool:
    """Whether ``name`` names a recipe by import path (``package.module:object``)."""
    return ":" in name


def import_recipe(path: str) -> Recipe:
    """The recipe ``package.module:object`` names (imported once per process).

    ``object`` is a :class:`Recipe`, or any object (a module, a class, an instance) with
    ``default_config()`` returning a :class:`~hookloop.config.Config` and ``build(config)``
    returning :class:`RecipeParts`; its ``description`` or docstring's first line
    describes it. The module is imported as Python would, with the current directory
    tried last. Raises ``ValueError`` naming what is missing.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(
            f"--recipe {path!r}: an import path is package.module:object, e.g. mypkg.recipes:RECIPE"
        )
    try:
        module = _import(module_name)
    except ImportError as err:
        raise ConfigError(
            f"--recipe {path!r}: cannot import {module_name!r} ({err}); install the package "
            "or run from the directory that holds it"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"--recipe {path!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, Recipe):
        return Recipe(path, obj.description, obj.default_config, obj.build)
    missing = [n for n in ("default_config", "build") if not callable(getattr(obj, n, None))]
    if missing:
        raise ConfigError(
            f"--recipe {path!r}: {attr} is not a recipe (no callable {' or '.join(missing)}); "
            "give a hookloop.recipes.Recipe or an object with default_config() and "
            "build(config)"
        )
    doc = getattr(obj, "description", None) or (inspect.getdoc(obj) or "").split("\n")[0]
    return Recipe(path, str(doc or path), obj.default_config, obj.build)


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        here = os.getcwd()
        if err.name != module_name.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # `hookloop` as a console script does not look here
        return importlib.import_module(module_name)


def get_recipe(name: str) -> Recipe:
    _load_builtin()
    if name not in _RECIPES and is_import_path(name):
        _RECIPES[name] = import_recipe(name)
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, list(_RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown recipe {name!r}.{hint} Available recipes: {', '.join(sorted(_RECIPES))}"
        )
    return _RECIPES[name]


def default_config(name: str) -> Config:
    """A fresh copy of recipe ``name``'s default configuration."""
    cfg = get_recipe(name).default_config()
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"recipe {name!r}: default_config() must return a hookloop Config, "
            f"got {type(cfg).__name__}"
        )
    cfg.recipe = name
    return cfg


def recipe_slug(name: str) -> str:
    """``name`` as part of a directory name (an import path's ``:`` becomes ``-``)."""
    return name.replace(":", "-").replace("/", "-")


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
