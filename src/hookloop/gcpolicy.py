"""Garbage collection on the loop's schedule instead of the interpreter's.

Python's cyclic collector runs when allocation counters cross a threshold, so
a full collection (which walks every tracked object: the model, the data
index, the tokenizer …) lands on whichever step happens to cross it, and with
several ranks on a different step on each rank — every other rank then waits
for it at the next collective. With ``train.gc_every=N`` the loop instead:

1. collects once after set-up and freezes what survives (``gc.freeze()``): the
   long-lived set-up objects move to a permanent generation later collections skip;
2. switches automatic collection off for the training loop;
3. collects every N steps, on every rank at the same step, and (``around_eval``,
   Megatron's ``--manual-gc-eval``) before and after each evaluation in training,
   which makes and drops many tensors at once;
4. restores automatic collection (and unfreezes) when training ends, also after an
   exception.

Reference cycles made during training are reclaimed only at those collections,
so memory held by cyclic garbage can grow for up to N steps.
"""

from __future__ import annotations

import gc


class GCPolicy:
    """``every=None`` leaves the interpreter's collector alone (every method is a no-op)."""

    __slots__ = ("_froze", "_was_enabled", "around_eval", "every")

    def __init__(self, every: int | None, *, around_eval: bool = True) -> None:
        bad = isinstance(every, bool) or not isinstance(every, int) or every < 1
        if every is not None and bad:
            raise ValueError(f"gc every must be an int >= 1 or None (off), got {every!r}")
        self.every = every
        self.around_eval = around_eval
        self._was_enabled: bool | None = None  # set while the policy is in force
        self._froze = False

    def begin(self) -> None:
        """After set-up: collect, freeze the survivors, switch automatic collection off."""
        if self.every is None or self._was_enabled is not None:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        self._froze = gc.get_freeze_count() == 0  # someone else's freeze is theirs to undo
        gc.freeze()
        gc.disable()

    def after_step(self, step: int) -> None:
        """Collect when ``step`` is a multiple of ``every`` (steps agree across ranks)."""
        if self.every is not None and step % self.every == 0:
            gc.collect()

    def at_eval(self) -> None:
        """Before and after an evaluation in training: collect (with ``around_eval``)."""
        if self.every is not None and self.around_eval:
            gc.collect()

    def end(self) -> None:
        """Give the collector back as it was found (safe to call when not begun)."""
        if self._was_enabled is None:
            return
        if self._froze:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled, self._froze = None, False
