"""The DiLoCo server's rounds: the global weights, the outer optimizer over them, and
when the contributions of a round become one outer step.

- **Sync mode**: a contribution waits (on a future) until every worker the round
  expects has sent one; the round expects the workers registered when it opened (its
  first contribution), less those excused from it (their contribution was refused,
  or they left). Each fragment has its own round counter and barrier.
- **Async mode**: each contribution is applied at once; with ``dn_buffer_size`` N > 0
  (Delayed Nesterov) only every N-th takes a momentum step over the buffered mean, the
  ones between a plain ``lr * g`` step.

An outer step is all or nothing: one that fails, or would make a weight non-finite,
leaves weights and optimizer as they were, and every worker waiting on the round gets
:class:`RoundFailed`. Nothing here knows HTTP or who the workers are:
:class:`~hookloop.diloco.server.DiLoCoServer` decides who may contribute.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Collection
from typing import Any

import torch

from hookloop.control.service import one_line
from hookloop.diloco.validate import norm

log = logging.getLogger("hookloop.diloco")

Contribution = dict[str, torch.Tensor]


class RoundFailed(RuntimeError):
    """The outer step of a round failed; the weights and the optimizer are unchanged."""


class OuterRounds:
    """The global model (float32, on CPU) and the rounds that step it.

    ``members()`` are the registered worker ids (a round opened now expects them),
    ``num_workers()`` how many a round expects before any has opened, and
    ``after_round()`` runs after each full-model or async round (the server saves).
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        optimizer_factory: Callable[[Any], torch.optim.Optimizer],
        *,
        async_mode: bool,
        dn_buffer_size: int,
        members: Callable[[], Collection[str]],
        num_workers: Callable[[], int],
        after_round: Callable[[], None],
    ) -> None:
        for name, value in weights.items():
            if not value.is_floating_point():
                raise ValueError(f"checkpoint tensor {name} is {value.dtype}, not floating point")
        self.names = list(weights)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.params = [
            torch.nn.Parameter(v.detach().clone().float().cpu(), requires_grad=False)
            for v in weights.values()
        ]
        self.optimizer = optimizer_factory(self.params)
        self.model_params = sum(v.numel() for v in weights.values())
        self.model_size_mb = sum(v.numel() * v.element_size() for v in weights.values()) / 2**20
        self.async_mode, self.dn_buffer_size = async_mode, dn_buffer_size
        self.members, self.num_workers, self.after_round = members, num_workers, after_round
        self.sync_round = 0
        self.total_submissions = 0
        self.fragment_submissions = 0
        self.pending: dict[str, Contribution] = {}
        self.round_done: dict[int, asyncio.Future[Contribution]] = {}
        self.expected: set[str] | None = None
        self.excused: dict[int | None, set[str]] = {}  # refused this round (None: full)
        self.frag_pending: dict[int, dict[str, Contribution]] = {}
        self.frag_rounds: dict[int, int] = {}
        self.frag_done: dict[tuple[int, int], asyncio.Future[Contribution]] = {}
        self.dn_buffer: list[Contribution] = []
        self.dirty = False  # changed since the last save
        self.norm_cache: float | None = None  # of the global weights; None: not known

    # -- the weights ----------------------------------------------------------------------
    @property
    def outer_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def global_params(self) -> Contribution:
        """A copy of the global weights (float32)."""
        return {n: p.detach().clone() for n, p in zip(self.names, self.params, strict=True)}

    def params_named(self, names: list[str]) -> Contribution:
        return {n: self.params[self.index[n]].detach().clone() for n in names}

    def view(self) -> Contribution:
        """The global weights themselves, by name (read them, never write them)."""
        return dict(zip(self.names, self.params, strict=True))

    def weights_norm(self) -> float:
        """The norm of all global weights, computed once after each change."""
        if self.norm_cache is None:
            self.norm_cache = norm(self.params)
        return self.norm_cache

    def load(self, state: dict[str, Any], where: str) -> None:
        """Continue from a saved server state (:meth:`state`); ValueError when it does not fit."""
        names = state.get("param_names")
        if names is not None and list(names) != self.names:
            raise ValueError(f"{where}: server_state.pt names other parameters")
        try:
            self.optimizer.load_state_dict(state["outer_optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(
                f"{where}: server_state.pt's outer_optimizer does not fit: {err}"
            ) from None
        self.sync_round = int(state["sync_round"])
        self.total_submissions = int(state.get("total_submissions", 0))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rounds (the server adds its own keys)."""
        return {
            "outer_optimizer": self.optimizer.state_dict(),
            "sync_round": self.sync_round,
            "param_names": list(self.names),
            "total_submissions": self.total_submissions,
        }

    # -- one outer step -------------------------------------------------------------------
    @torch.no_grad()
    def outer_step(self, contributions: list[Contribution]) -> None:
        """One outer step on the mean of ``contributions`` (their names only).

        All or nothing: when the step raises or leaves a weight non-finite, the weights
        and the optimizer's state are put back as they were and ``RuntimeError`` says why.
        """
        names = list(contributions[0])
        touched = [self.params[self.index[n]] for n in names]
        saved = [p.detach().clone() for p in touched]
        saved_opt = copy.deepcopy(self.optimizer.state_dict())
        try:
            for name, param in zip(names, touched, strict=True):
                total = contributions[0][name].float().clone()
                for other in contributions[1:]:
                    total.add_(other[name].float())
                param.grad = total.div_(len(contributions))
            self.optimizer.step()
            bad = [n for n, p in zip(names, touched, strict=True) if not p.isfinite().all()]
            if bad:
                raise RuntimeError(f"the step made {bad[:3]} non-finite")
        except Exception as err:
            for param, value in zip(touched, saved, strict=True):
                param.copy_(value)
            self.optimizer.load_state_dict(saved_opt)
            raise RuntimeError(
                f"the outer step failed ({' '.join(str(err).split())[:200]}); the global "
                "weights and the outer optimizer are unchanged"
            ) from None
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        self.dirty, self.norm_cache = True, None

    # -- async mode -----------------------------------------------------------------------
    @torch.no_grad()
    def apply_async(self, grads: Contribution) -> None:
        """Apply one full-model contribution now (RuntimeError: the weights are unchanged)."""
        if self.dn_buffer_size <= 0:
            self.outer_step([grads])
        else:
            self.dn_buffer.append(grads)
            if len(self.dn_buffer) >= self.dn_buffer_size:
                buffered, self.dn_buffer = self.dn_buffer, []
                self.outer_step(buffered)
            else:  # between momentum steps: plain descent, no momentum
                self.descend(grads)
        self.sync_round += 1
        self.total_submissions += 1
        self.after_round()

    def descend(self, grads: Contribution) -> None:
        lr = self.outer_lr
        for name, value in grads.items():
            param = self.params[self.index[name]]
            new = param - lr * value.float()
            if not new.isfinite().all():
                self.dn_buffer.pop()
                raise RuntimeError(
                    f"the step would make {name} non-finite; the global weights are unchanged"
                )
            param.copy_(new)
        self.dirty, self.norm_cache = True, None

    def apply_async_fragment(self, grads: Contribution) -> Contribution:
        """Apply one fragment's contribution now; the fragment's new weights."""
        self.outer_step([grads])
        self.sync_round += 1
        self.total_submissions += 1
        self.fragment_submissions += 1
        return self.params_named(list(grads))

    # -- sync mode: barriers --------------------------------------------------------------
    def enter(self, worker_id: str, grads: Contribution) -> asyncio.Future[Contribution]:
        """Add a full-model contribution to the open round; its future holds the new weights."""
        if self.expected is None:
            self.expected = set(self.members())
        my_round = self.sync_round
        self.pending[worker_id] = grads
        done = self.future(self.round_done, my_round)
        self.release_full()
        return done

    def enter_fragment(
        self, worker_id: str, frag: int, grads: Contribution
    ) -> asyncio.Future[Contribution]:
        """Add a contribution to fragment ``frag``'s open round."""
        my_round = self.frag_rounds.setdefault(frag, 0)
        self.frag_pending.setdefault(frag, {})[worker_id] = grads
        done = self.future(self.frag_done, (frag, my_round))
        self.release_fragment(frag)
        return done

    def expected_count(self, key: int | None = None) -> int:
        """How many submissions close the round ``key`` (None: full model, else a fragment):
        the expected workers less those whose contribution was refused in it."""
        excused = self.excused.get(key, set())
        if self.expected is None:
            return self.num_workers() - len(excused)
        return len(self.expected - excused)

    def release_full(self) -> None:
        """Close the full-model round when every expected worker has submitted."""
        if not self.pending or len(self.pending) < self.expected_count(None):
            return
        done_round = self.sync_round
        self.excused.pop(None, None)
        try:
            self.outer_step(list(self.pending.values()))
        except Exception as err:  # every waiter is answered; the next round starts clean
            log.error("diloco: round %d: %s", done_round, one_line(err))
            self.pending.clear()
            self.fail(self.round_done.pop(done_round, None), err)
            self.expected = set(self.members())
            return
        self.pending.clear()
        self.sync_round += 1
        log.info("diloco: outer step done, round %d", self.sync_round)
        self.future(self.round_done, done_round).set_result(self.global_params())
        self.expected = set(self.members())
        for old in [r for r in self.round_done if r < done_round - 1]:
            del self.round_done[old]
        self.after_round()

    def release_fragment(self, frag: int) -> None:
        """Close fragment ``frag``'s round when every expected worker has submitted it."""
        pending = self.frag_pending.get(frag) or {}
        if not pending or len(pending) < self.expected_count(frag):
            return
        self.excused.pop(frag, None)
        done_round = self.frag_rounds.get(frag, 0)
        contributions = list(pending.values())
        try:
            self.outer_step(contributions)
        except Exception as err:  # every waiter is answered; the next round starts clean
            log.error("diloco: fragment %d round %d: %s", frag, done_round, one_line(err))
            pending.clear()
            self.fail(self.frag_done.pop((frag, done_round), None), err)
            return
        result = self.params_named(list(contributions[0]))
        pending.clear()
        self.frag_rounds[frag] = done_round + 1
        self.fragment_submissions += len(contributions)
        self.sync_round += 1
        self.future(self.frag_done, (frag, done_round)).set_result(result)
        for key in [k for k in self.frag_done if k[0] == frag and k[1] < done_round - 1]:
            del self.frag_done[key]

    def excuse(self, worker_id: str, fragment: Any) -> None:
        """``worker_id``'s contribution was refused: the round goes on without it (it may
        still send a valid one). ``fragment`` as the worker sent it (None: full model)."""
        valid = fragment is None or (
            isinstance(fragment, int) and not isinstance(fragment, bool) and fragment >= 0
        )
        key = fragment if valid else None
        pending = self.pending if key is None else self.frag_pending.get(key, {})
        if valid and worker_id not in pending:
            self.excused.setdefault(key, set()).add(worker_id)
            if key is None:
                self.release_full()
            else:
                self.release_fragment(key)

    def drop(self, worker_id: str) -> None:
        """``worker_id`` is gone: forget what it sent, and release the rounds it held up."""
        self.pending.pop(worker_id, None)
        if self.expected is not None:
            self.expected.discard(worker_id)
        for excused in self.excused.values():
            excused.discard(worker_id)
        self.release_full()
        for frag, pending in self.frag_pending.items():
            pending.pop(worker_id, None)
            self.release_fragment(frag)

    def abandon_open(self, answer: Callable[[], BaseException]) -> int:
        """Drop the contributions of every open round (full model and fragments) and answer
        their waiters ``answer()`` (the outer loop was paused); returns how many waited.
        The rounds' counters stay: the next submissions open the same rounds afresh."""
        waiting = len(self.pending) + sum(len(p) for p in self.frag_pending.values())
        tables: list[dict[Any, asyncio.Future[Contribution]]] = [self.round_done, self.frag_done]
        for table in tables:
            for key in [k for k, f in table.items() if not f.done()]:
                future = table.pop(key)
                future.set_exception(answer())
                future.add_done_callback(lambda f: f.exception())  # retrieved: no warning
        self.pending.clear()
        self.frag_pending.clear()
        self.excused.clear()
        self.expected = None
        return waiting

    @staticmethod
    def fail(future: asyncio.Future[Any] | None, err: BaseException) -> None:
        if future is not None and not future.done():
            future.set_exception(RoundFailed(one_line(err)))
            future.add_done_callback(lambda f: f.exception())  # retrieved: no warning

    @staticmethod
    def future(table: dict[Any, asyncio.Future[Any]], key: Any) -> asyncio.Future[Any]:
        future = table.get(key)
        if future is None:
            future = table[key] = asyncio.get_running_loop().create_future()
        return future
