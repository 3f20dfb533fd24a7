"""``DiLoCoCallback``: make a training run one worker of a DiLoCo server.

Forgather's constructor, parameter for parameter; each ``None`` falls back to
an environment variable (``DILOCO_SERVER``, ``DILOCO_SYNC_EVERY``,
``DILOCO_WORKER_ID``, ``DILOCO_BF16_COMM``, ``DILOCO_DYLU``,
``DILOCO_HEARTBEAT_INTERVAL``, ``DILOCO_NUM_FRAGMENTS``) and then to the
default Forgather uses. Without a server address it does nothing at all, so one
configuration trains alone or as a worker. ``server_addr`` is kept as given
(``host:port`` or a URL). hookloop adds keyword-only
``token`` (``DILOCO_TOKEN``) and ``cafile`` (``DILOCO_CAFILE``) for a server
started with ``--token`` and HTTPS, and ``max_missed_syncs``
(``DILOCO_MAX_MISSED_SYNCS``, default 3; 0: no bound): after that many syncs in a
row that could not reach the server, the run stops with
:class:`~hookloop.diloco.worker.ServerLost` (one line, exit 1) instead of training
on alone.

A resumed run joins under the worker id its checkpoint saved; when the server
still holds that id for the crashed run (until its ``heartbeat_timeout``), it
joins under a new one (a warning says so). An id given explicitly is never
replaced: the server's refusal stops the run.

The all-reduce variant inside one ``torch.distributed`` job is
:class:`hookloop.callbacks.DiLoCo`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hookloop.callback import Callback
from hookloop.diloco.client import ServerRefused, parse_address
from hookloop.diloco.worker import (
    MAX_MISSED_SYNCS,
    DiLoCoWorker,
    check_heartbeat_interval,
    default_worker_id,
)
from hookloop.state import CallbackContext

log = logging.getLogger("hookloop.diloco")
#: The server's answer to a registration under an id another registration holds.
HELD = 403


def _env(name: str, kind: type, default: Any) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {kind.__name__}") from None


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be seconds > 0, got {value!r}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


class DiLoCoCallback(Callback):
    """A worker of a DiLoCo server (priority 15); a no-op when no server is configured.

    Stateful: a checkpoint keeps the sync counters and the (DyLU-adjusted)
    period, not the global weights: a resumed worker gets those from the
    server when it joins again. Its sync metrics (``diloco/...``) go into every
    log.
    """

    priority = 15

    def __init__(
        self,
        server_addr: str | None = None,
        sync_every: int | None = None,
        worker_id: str | None = None,
        bf16_comm: bool | None = None,
        dylu: bool | None = None,
        heartbeat_interval: float | None = None,
        num_fragments: int | None = None,
        timeout: float = 600,
        max_sync_retries: int = 3,
        *,
        token: str | None = None,
        cafile: str | None = None,
        max_missed_syncs: int | None = None,
    ) -> None:
        self.server_addr = server_addr or os.environ.get("DILOCO_SERVER", "").strip()
        if self.server_addr:
            parse_address(self.server_addr)  # refused now rather than at train start
        self.sync_every = _int(
            "sync_every", sync_every if sync_every is not None else
            _env("DILOCO_SYNC_EVERY", int, 500), 1
        )  # fmt: skip
        self.worker_id = worker_id or os.environ.get("DILOCO_WORKER_ID", "").strip() or None
        if bf16_comm is None:
            bf16_comm = _env("DILOCO_BF16_COMM", bool, True)
        self.bf16_comm = _bool("bf16_comm", bf16_comm)
        self.dylu = _bool("dylu", dylu if dylu is not None else _env("DILOCO_DYLU", bool, False))
        if heartbeat_interval is not None:
            self.heartbeat_interval = check_heartbeat_interval(heartbeat_interval)
        else:
            from_env = _env("DILOCO_HEARTBEAT_INTERVAL", float, 30.0)
            try:
                self.heartbeat_interval = check_heartbeat_interval(from_env)
            except ValueError as err:
                raise ValueError(
                    f"DILOCO_HEARTBEAT_INTERVAL={os.environ['DILOCO_HEARTBEAT_INTERVAL'].strip()}"
                    f": {err}"
                ) from None
        self.num_fragments = _int(
            "num_fragments",
            num_fragments if num_fragments is not None else _env("DILOCO_NUM_FRAGMENTS", int, 1),
            1,
        )
        self.timeout = _seconds("timeout", timeout)
        self.max_sync_retries = _int("max_sync_retries", max_sync_retries, 0)
        name = "max_missed_syncs" if max_missed_syncs is not None else "DILOCO_MAX_MISSED_SYNCS"
        if max_missed_syncs is None:
            max_missed_syncs = _env(name, int, MAX_MISSED_SYNCS)
        self.max_missed_syncs = _int(name, max_missed_syncs, 0)
        self.token = token or os.environ.get("DILOCO_TOKEN") or None
        self.cafile = cafile or os.environ.get("DILOCO_CAFILE") or None
        self._worker: DiLoCoWorker | None = None
        self._pending: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        """Whether a server is configured (otherwise every event is a no-op)."""
        return bool(self.server_addr)

    def on_train_start(self, ctx: CallbackContext) -> None:
        if not self.active:
            return
        if ctx.state.world_size > 1 and ctx.config.train.parallel != "ddp":
            raise ValueError(
                "a DiLoCo worker running on several ranks needs train.parallel='ddp' (its "
                f"ranks must hold the same weights); got {ctx.config.train.parallel!r}"
            )
        model = getattr(ctx.model, "module", ctx.model)  # the same names with or without DDP
        saved_id = (self._pending or {}).get("worker_id")  # a resumed worker keeps its id
        self._worker = self._new_worker(model, self.worker_id or saved_id or default_worker_id())
        try:
            self._worker.start()
        except ServerRefused as err:
            # A run resumed after a crash finds its old registration still held (until the
            # server's heartbeat_timeout): it joins under a new id rather than not at all.
            if err.status != HELD or self.worker_id or not saved_id:
                raise
            self._worker = self._new_worker(model, default_worker_id())
            log.warning("diloco: %s; joining as %s instead", err, self._worker.worker_id)
            self._worker.start()
        if self._pending is not None:  # after start(), which begins a period, as Forgather
            self._worker.load_state_dict(self._pending)
            self._pending = None
        if ctx.state.is_rank_zero:
            log.info("diloco: worker %s joined %s", self._worker.worker_id, self.server_addr)

    def _new_worker(self, model: Any, worker_id: str) -> DiLoCoWorker:
        return DiLoCoWorker(
            model,
            self.server_addr,
            sync_every=self.sync_every,
            worker_id=worker_id,
            bf16_comm=self.bf16_comm,
            dylu=self.dylu,
            heartbeat_interval=self.heartbeat_interval,
            num_fragments=self.num_fragments,
            timeout=self.timeout,
            max_sync_retries=self.max_sync_retries,
            token=self.token,
            cafile=self.cafile,
            max_missed_syncs=self.max_missed_syncs,
        )

    def on_train_step_end(self, ctx: CallbackContext) -> None:
        if self._worker is not None:
            self._worker.after_step()

    def on_before_log(self, ctx: CallbackContext) -> None:
        if self._worker is not None and ctx.logs is not None:
            ctx.logs.update(self._worker.sync_metrics)

    def on_train_end(self, ctx: CallbackContext) -> None:
        self._leave()

    def on_exception(self, ctx: CallbackContext) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._pending = self._worker.state_dict()  # a second fit() continues the counters
            self._worker = None

    @property
    def worker(self) -> DiLoCoWorker | None:
        """The running worker (between train start and end), for inspection."""
        return self._worker

    def state_dict(self) -> dict[str, Any]:
        if self._worker is not None:
            return self._worker.state_dict()
        return dict(self._pending or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Loaded before on_train_start creates the worker: keep it until then.
        self._pending = dict(state) if state else None
