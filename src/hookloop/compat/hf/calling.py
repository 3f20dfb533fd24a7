"""HF handlers: which methods of a callback are handlers, and how each is called.

Both are decided once, when the callback is wrapped (never per call). A handler is an
``on_<event>`` method for one of the HF dialect's events that is not a base class's
no-op; an ``on_*`` method matching no event is warned about (it would never run). A
handler is called with ``(args, state, control, **kwargs)`` positionally when its
first three parameters are ``args, state, control`` or carry other names; by keyword
when it names some of them elsewhere (Forgather's ``on_log_step(self, state, logs,
**kwargs)``). A handler without ``**kwargs`` is given only the keywords it names.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from hookloop.compat._toolkit import scan_hooks, stray_message
from hookloop.compat.hf.callback import TrainerCallback
from hookloop.compat.hf.types import TrainerState
from hookloop.compat.mapping import dialect_event_names
from hookloop.state import CallbackContext

HF_EVENTS = dialect_event_names("hf")

#: Keywords every handler gets, and the extra ones of some events.
COMMON_KWARGS = (
    "model",
    "processing_class",
    "optimizer",
    "lr_scheduler",
    "train_dataloader",
    "eval_dataloader",
    "trainer",
)
EXTRA_KWARGS: dict[str, tuple[str, ...]] = {
    "on_log_step": ("logs",),
    "on_log": ("logs",),
    "on_evaluate": ("metrics",),
    "on_predict": ("metrics",),
    "on_train_metrics": ("metrics",),
}

#: Methods of HF base classes that are no-ops: not handlers of a subclass.
_HF_BASES = {
    (TrainerCallback.__module__, "TrainerCallback"),
    ("transformers.trainer_callback", "TrainerCallback"),
}
#: HF events that exist in transformers but have no place in this loop.
_KNOWN_UNUSED = frozenset({"on_push_begin"})


Caller = Callable[[Any, Any, Any, dict[str, Any]], Any]


def caller(handler: Callable[..., Any], event: str, owner: Any) -> Caller:
    """How to call one handler, decided from its signature once."""
    where = f"{type(owner).__name__}.{event}"
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): assume HF's
        return lambda args, state, control, kw: handler(args, state, control, **kw)
    kinds = inspect.Parameter
    takes_any = any(p.kind is kinds.VAR_KEYWORD for p in params)
    positional = [
        p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    named = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    offered = {"args", "state", "control", *COMMON_KWARGS, *EXTRA_KWARGS.get(event, ())}
    first_three = [p.name for p in positional[:3]]
    by_position = first_three == ["args", "state", "control"] or not (
        named & {"args", "state", "control"}
    )
    if by_position:
        if len(positional) < 3 and not any(p.kind is kinds.VAR_POSITIONAL for p in params):
            raise TypeError(
                f"{where} takes {len(positional)} positional parameter(s); an HF handler takes "
                "(args, state, control, **kwargs), or names the ones it wants (state, logs, ...)"
            )
        rest = positional[3:] + [p for p in params if p.kind is kinds.KEYWORD_ONLY]
        _check_required(rest, offered, where)
        if takes_any:
            return lambda args, state, control, kw: handler(args, state, control, **kw)
        wanted = named - set(first_three)
        return lambda args, state, control, kw: handler(
            args, state, control, **{k: v for k, v in kw.items() if k in wanted}
        )
    _check_required(params, offered, where)
    if takes_any:
        return lambda args, state, control, kw: handler(
            args=args, state=state, control=control, **kw
        )
    return lambda args, state, control, kw: handler(
        **{
            k: v
            for k, v in {"args": args, "state": state, "control": control, **kw}.items()
            if k in named
        }
    )


def _check_required(params: list[inspect.Parameter], offered: set[str], where: str) -> None:
    missing = [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and p.name not in offered
    ]
    if missing:
        passed = ", ".join(sorted(offered))
        raise TypeError(
            f"{where} requires {', '.join(map(repr, missing))}, which this event does not "
            f"pass; it passes {passed}"
        )


def extra_kwargs(
    event: str, native_event: str, ctx: CallbackContext, state: TrainerState
) -> dict[str, Any]:
    if event == "on_log" and native_event == "on_eval_end":  # HF logs evaluation metrics too
        # A fresh dict per handler, as HF's Trainer.log builds: the metrics plus the epoch
        # (a handler that pops from it, like PrinterCallback, leaves the metrics alone).
        return {"logs": {**(ctx.metrics or {}), "epoch": state.epoch}}
    if event in ("on_log_step", "on_log"):
        return {"logs": ctx.logs}
    if event in ("on_evaluate", "on_predict"):
        return {"metrics": ctx.metrics}
    if event == "on_train_metrics":
        return {"metrics": _step_metrics(ctx)}
    return {}


def _step_metrics(ctx: CallbackContext) -> dict[str, float]:
    """The step's losses, grad norm and learning rate as floats.

    Reading them back is a host sync each step: paid only when some callback
    handles ``on_train_metrics``.
    """
    metrics = {key: float(value) for key, value in (ctx.loss_dict or {}).items()}
    if ctx.grad_norm is not None:
        metrics["grad_norm"] = float(ctx.grad_norm)
    if ctx.optimizer is not None:
        metrics["lr"] = float(ctx.optimizer.param_groups[0]["lr"])
    return metrics


def last_micro_step(ctx: CallbackContext) -> bool:
    return ctx.state.micro_step == ctx.config.train.grad_accum - 1


# -- recognising HF callbacks ----------------------------------------------------
def handled_events(cb: Any) -> list[str]:
    """The dialect events ``cb`` really handles (not the base class's no-ops).

    Warns about ``on_*`` methods that match no dialect event: they would never run.
    """
    handled, stray = scan_hooks(cb, HF_EVENTS, _is_hf_base)
    for name in stray:
        if name not in _KNOWN_UNUSED:
            warnings.warn(
                stray_message(type(cb).__name__, name, HF_EVENTS, "HF dialect"), stacklevel=4
            )
    return handled


def _is_hf_base(owner: type) -> bool:
    return (owner.__module__, owner.__name__) in _HF_BASES


def is_hf_callback(cb: Any) -> bool:
    """An instance of an HF base class (which may handle no event at all)."""
    return any(_is_hf_base(k) for k in type(cb).__mro__)
