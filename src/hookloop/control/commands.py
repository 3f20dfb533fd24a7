"""The commands ``POST /jobs/{id}/control`` takes, and how a request body names one.

A command (:class:`Command`) says which requests it files on the loop's
:class:`~hookloop.state.Control` and which values it takes; :data:`SERVER_COMMANDS`
holds them by name and :func:`register_command` adds one. :func:`parse_request` reads
a body, in hookloop's form ``{"command", "values"}`` or Forgather's ``{"command",
"data"}``, and refuses anything else with a :class:`CommandError`, which the server
answers with its status and the list of valid commands.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hookloop.control.bodies import BodyError, check_tree, text
from hookloop.control.service import HttpError

_BODY_HELP = 'send a JSON object such as {"command": "graceful_stop"}'


@dataclass(frozen=True)
class Command:
    """One command of ``POST /jobs/{id}/control``: what it files on the loop's Control.

    ``requests(values)`` returns the requests to file, each ``(kind, values)`` of the
    request vocabulary (:mod:`hookloop.requests`), filed together. ``takes`` names the
    values the command reads from the body's ``"values"`` object (none: it takes none)
    and ``check(values)`` refuses bad ones with a :class:`CommandError`. ``needs`` is
    what the job must have (``"checkpoints"``, ``"eval data"``); ``ends``: the job
    is ending once it is filed (no command is taken after it). A command that files
    nothing (``status``) is acknowledged in any phase.
    """

    doc: str
    requests: Callable[[dict[str, Any]], list[tuple[str, dict[str, Any]]]]
    takes: tuple[str, ...] = ()
    check: Callable[[dict[str, Any]], None] | None = None
    needs: str | None = None
    ends: bool = False
    #: The command takes any keys (``set``: the job checks them against what it can change).
    any_values: bool = False


#: Every command the server takes, by name (:func:`register_command` adds one).
SERVER_COMMANDS: dict[str, Command] = {
    "graceful_stop": Command(
        "finish the current step, save a checkpoint (when the job has an output directory) "
        "and exit 0",
        lambda v: [("stop", {"reason": "graceful_stop requested over HTTP"})],
        ends=True,
    ),
    "save_checkpoint": Command(
        "write a checkpoint at the end of the current step and go on",
        lambda v: [("save", {})],
        needs="checkpoints",
    ),
    "save_and_stop": Command(
        "write a checkpoint at the end of the current step, then exit 0",
        lambda v: [("save", {}), ("stop", {"reason": "save_and_stop requested over HTTP"})],
        needs="checkpoints",
        ends=True,
    ),
    "abort": Command(
        "end after the current step without saving anything (exit code 3)",
        lambda v: [("abort", {"reason": "abort requested over HTTP"})],
        ends=True,
    ),
    "evaluate_now": Command(
        "run an evaluation at the end of the current step and go on",
        lambda v: [("evaluate", {})],
        needs="eval data",
    ),
    "set": Command(
        "change live settings (lr, lr_scale, weight_decay, clip_grad_norm, log_every, ...) "
        "at the end of the current step, on every rank, recorded and replayed on resume",
        lambda v: [("set", v)],
        needs="live settings",
        any_values=True,
    ),
    "pause": Command(
        "hold the job at the end of the current step on every rank (process, data position "
        "and device memory kept) until a resume; recorded in changes.jsonl",
        lambda v: [("pause", v)],
        needs="live settings",
    ),
    "resume": Command(
        "go on after a pause, on every rank at the same moment",
        lambda v: [("resume", v)],
        needs="live settings",
    ),
    "unset": Command(
        "cancel a change scheduled for a later step (set with at_step), by its id",
        lambda v: [("unset", v)],
        takes=("id",),
        needs="live settings",
    ),
    # Forgather's clients may post it; it changes nothing (GET .../status reads the status)
    "status": Command("change nothing: acknowledge (GET /jobs/{id}/status reads it)", lambda v: []),
}
#: The commands ``POST /jobs/{id}/control`` accepts, with what each does.
COMMANDS: dict[str, str] = {name: c.doc for name, c in SERVER_COMMANDS.items()}


def register_command(name: str, command: Command) -> None:
    """Let the server take ``name``: a new command, typically filing a request kind added
    with :func:`hookloop.requests.register_kind` (its handler: ``register_action``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a command name must be an identifier, got {name!r}")
    if name in SERVER_COMMANDS and SERVER_COMMANDS[name] != command:
        raise ValueError(f"command {name!r} is already registered")
    SERVER_COMMANDS[name] = command
    COMMANDS[name] = command.doc


class CommandError(HttpError):
    """A control request that cannot be carried out; ``status`` is its HTTP code."""

    def reply(self) -> dict[str, Any]:
        """The answer's body: what was wrong, and every command the server takes."""
        return {"error": str(self), "valid_commands": list(COMMANDS)}


def parse_command(body: bytes) -> str:
    """The command named by a request body, or :class:`CommandError` saying what is wrong."""
    return parse_request(body)[0]


def parse_request(body: bytes) -> tuple[str, dict[str, Any]]:
    """``(command, values)`` from a request body ``{"command": ..., "values": {...}}``, the
    values checked against what the command takes; :class:`CommandError` otherwise."""
    valid = ", ".join(COMMANDS)
    if not body.strip():
        raise CommandError(f"empty request body; {_BODY_HELP}. Valid commands: {valid}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # includes UnicodeDecodeError and JSONDecodeError
        raise CommandError(
            f"the request body is not valid JSON; {_BODY_HELP}. Valid commands: {valid}"
        ) from None
    if not isinstance(data, dict):
        raise CommandError(
            f"the request body must be a JSON object, got {type(data).__name__}; {_BODY_HELP}. "
            f"Valid commands: {valid}"
        )
    try:  # no NaN, huge integer, long string or deep nesting anywhere, a printable client
        check_tree(data)
        if "client" in data:
            text("client", data["client"])
    except BodyError as err:
        raise CommandError(str(err)) from None
    if "command" not in data:
        raise CommandError(f'missing "command"; valid commands: {valid}')
    command = data["command"]
    if not isinstance(command, str) or command not in SERVER_COMMANDS:
        shown = repr(command) if len(repr(command)) <= 60 else repr(command)[:57] + "..."
        raise CommandError(f"unknown command {shown}; valid commands: {valid}")
    key = "values"
    if "data" in data:  # Forgather's clients send {"command", "data": {}}
        if "values" in data:
            raise CommandError('send the command\'s values as "values" or as "data", not both')
        key = "data"
    return command, _values(command, data.get(key), key)


def _values(command: str, values: Any, key: str = "values") -> dict[str, Any]:
    spec = SERVER_COMMANDS[command]
    if values is None or (values == {} and not spec.takes):
        values = {}
    elif not isinstance(values, dict):
        raise CommandError(f'"{key}" must be a JSON object, got {type(values).__name__}')
    unknown = sorted(set(values) - set(spec.takes))
    if unknown and not spec.any_values:
        takes = ", ".join(spec.takes) if spec.takes else "none"
        raise CommandError(f"{command} takes no value {unknown[0]!r}; it takes: {takes}")
    if spec.any_values and not values:
        raise CommandError(f'{command} needs at least one value in "{key}", e.g. {{"lr": 3e-4}}')
    missing = [k for k in spec.takes if k not in values]
    if missing:
        raise CommandError(f'{command} needs the value {missing[0]!r} in "values"')
    if spec.check is not None:
        spec.check(values)
    return values


def client_of(body: bytes, user_agent: str, remote: str | None) -> str:
    """Who sent a command, for the record of a change: the body's ``"client"`` (printable,
    cut to 80 characters) or the User-Agent, and the address it came from."""
    named: Any = None
    with contextlib.suppress(ValueError, RecursionError, AttributeError):
        named = json.loads(body).get("client")
    text = named if isinstance(named, str) and named.strip() else user_agent or "unknown"
    text = "".join(ch for ch in text if ch.isprintable())[:80] or "unknown"
    return f"{text} ({remote})" if remote else text
