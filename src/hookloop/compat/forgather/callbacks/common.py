"""What Forgather's built-ins share: argument checks that answer in one line, the
logger they report on, and the markdown block their TensorBoard texts are written in."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hookloop.callbacks import info as _info

#: The logger Forgather's built-ins report on (the HF dialect's, whose level ``log_level`` sets).
log = logging.getLogger("hookloop.compat.hf")

__all__ = ["check_flag", "check_positive_int", "check_writer", "log", "markdown_block"]


def check_flag(name: str, value: Any) -> bool:
    """``value`` when it is True or False; a one-line ValueError naming ``name`` otherwise."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` when it is an int >= 1 (or None, when ``optional``)."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an int >= 1 or None" if optional else "an int >= 1"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def check_writer(name: str, writer: Any, *, optional: bool) -> Any:
    """``writer`` when it writes as a ``SummaryWriter`` does (or is None, when ``optional``)."""
    if writer is None and optional:
        return None
    if not callable(getattr(writer, "add_scalar", None)) or not callable(
        getattr(writer, "add_text", None)
    ):
        allowed = "a SummaryWriter-like object (add_scalar, add_text)"
        raise ValueError(
            f"{name} must be {allowed}{' or None' if optional else ''}, got {writer!r}"
        )
    return writer


def markdown_block(mapping: Mapping[str, Any]) -> str:
    """TensorBoard renders text as markdown: a code block keeps the columns aligned."""
    return "```\n" + _info.format_info(dict(mapping)) + "\n```"
