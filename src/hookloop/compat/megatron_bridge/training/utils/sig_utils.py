"""``DistributedSignalHandler``: a caught signal, agreed over ranks, as Megatron-Bridge's.

While the handler is entered (``with handler:`` or ``handler.__enter__()``) the signal
(``SIGTERM`` unless told otherwise) only sets a flag; :meth:`signals_received` then
gathers that flag from every rank, so all ranks see that one rank was told to stop.
``training.train`` enters it when ``cfg.train.exit_signal_handler`` is set, and
``checkpoint_and_decide_exit`` saves and exits once any rank caught the signal.

>>> import os, signal
>>> with DistributedSignalHandler(signal.SIGUSR1) as handler:
...     os.kill(os.getpid(), signal.SIGUSR1)
...     handler.signals_received()
[True]
"""

from __future__ import annotations

import logging
import signal
from types import FrameType, TracebackType
from typing import Any

import torch

logger = logging.getLogger("megatron.bridge.training.utils.sig_utils")


class DistributedSignalHandler:
    """Turns a signal into a flag while entered; puts the previous handler back on exit."""

    def __init__(self, sig: int = signal.SIGTERM) -> None:
        self.sig = sig
        self._signal_received = False
        self.released = False
        self.original_handler: Any = None

    def signals_received(self) -> list[bool]:
        """One flag per rank: whether that rank caught the signal (every rank must call)."""
        flag = torch.tensor([int(self._signal_received)], dtype=torch.int32)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [bool(flag.item())]
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        flags = [torch.zeros_like(flag) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(flags, flag)
        return [bool(f.item()) for f in flags]

    def __enter__(self) -> DistributedSignalHandler:
        self._signal_received = False
        self.released = False
        self.original_handler = signal.getsignal(self.sig)

        def on_signal(signum: int, frame: FrameType | None) -> None:
            logger.info("received signal %d: stopping after this step", signum)
            self._signal_received = True

        signal.signal(self.sig, on_signal)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> bool:
        """Put the previous handler back; False when that was already done."""
        if self.released or self.original_handler is None:
            return False
        signal.signal(self.sig, self.original_handler)
        self.released = True
        return True
