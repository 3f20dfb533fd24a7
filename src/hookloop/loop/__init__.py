"""The training loop and the parts it is composed of.

- :mod:`~hookloop.loop.trainer`: the :class:`Trainer`, the loop itself, read top to bottom.
- :mod:`~hookloop.loop.parts`: :func:`~hookloop.loop.parts.build_parts`, which builds
  every part once, and the :class:`~hookloop.loop.parts.Dialect` a reproduced system
  uses to bring parts of its own.
- :mod:`~hookloop.loop.records`: what several parts share (the event channel, the trained
  objects, how a batch is computed, the loop's timing);
  :mod:`~hookloop.loop.contents`: the states a checkpoint names;
  :mod:`~hookloop.loop.inputs`: what the Trainer was given, checked.
- :mod:`~hookloop.loop.stepper`: one optimizer step (micro-steps, gradients, the update).
- :mod:`~hookloop.loop.schedule`: what is due at a step's or an epoch's end.
- :mod:`~hookloop.loop.logbook`: the log event.
- :mod:`~hookloop.loop.evaluation`: evaluation, test and prediction passes.
- :mod:`~hookloop.loop.live`: live settings, changed while a run trains.
- :mod:`~hookloop.loop.actions`: handlers for request kinds added to the vocabulary.
"""

from hookloop.loop.parts import Dialect
from hookloop.loop.trainer import Trainer

__all__ = ["Dialect", "Trainer"]
