"""transformers' memory metrics (``skip_memory_metrics=False``).

For each stage — building the Trainer (``init``), ``train()`` (``train``),
``evaluate()`` (``eval``), ``predict()`` (``test``) — the growth of the process's
resident memory over the stage (``{stage}_mem_cpu_alloc_delta``) and how far it
peaked above its end value (``..._peaked_delta``), and the same for CUDA memory
(``_mem_gpu_``) when CUDA is there; ``init``'s figures come with the first
``train()``'s, with ``before_init_mem_cpu``. A stage begun inside another (an
evaluation during training) is not measured on its own, as in transformers.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import torch

_SAMPLE_EVERY_S = 0.002  # how often the peak is sampled while a stage runs


class MemoryTracker:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.stage: str | None = None
        self.figures: dict[str, dict[str, int]] = {}
        self.init_reported = False
        self._process: Any = None
        if enabled:
            try:
                import psutil
            except ImportError:
                raise ValueError(
                    "skip_memory_metrics=False measures memory with psutil, which is not "
                    "installed (pip install psutil), or leave skip_memory_metrics=True"
                ) from None
            self._process = psutil.Process()
        self._peak = 0
        self._watching = False
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def start(self, stage: str) -> None:
        if not self.enabled or self.stage is not None:
            return
        self.stage = stage
        gc.collect()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        begin = self._rss()
        self.figures[stage] = {
            "begin": begin,
            "gpu_begin": torch.cuda.memory_allocated() if cuda else 0,
        }
        self._peak, self._watching = begin, True
        self._thread = threading.Thread(target=self._watch, daemon=True, name="hf-memory-peak")
        self._thread.start()

    def _watch(self) -> None:
        event = threading.Event()
        while self._watching:
            self._peak = max(self._peak, self._rss())
            event.wait(_SAMPLE_EVERY_S)

    def stop_and_update(self, stage: str, metrics: dict[str, Any] | None = None) -> None:
        """End ``stage`` (when it is the one measured) and add its figures to ``metrics``."""
        if not self.enabled or self.stage != stage:
            return
        self._watching = False
        if self._thread is not None:
            self._thread.join()
        gc.collect()
        end = self._rss()
        got = self.figures[stage]
        got["alloc"] = end - got["begin"]
        got["peaked"] = max(0, self._peak - end)
        if torch.cuda.is_available():
            got["gpu_alloc"] = torch.cuda.memory_allocated() - got["gpu_begin"]
            got["gpu_peaked"] = max(
                0, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            )
        self.stage = None
        if metrics is not None:
            self._report(stage, metrics)

    def _report(self, stage: str, metrics: dict[str, Any]) -> None:
        stages = [stage]
        if not self.init_reported and "init" in self.figures and stage != "init":
            stages.insert(0, "init")
            self.init_reported = True
        for name in stages:
            got = self.figures.get(name, {})
            for kind in ("alloc", "peaked"):
                if kind in got:
                    metrics[f"{name}_mem_cpu_{kind}_delta"] = got[kind]
                if f"gpu_{kind}" in got:
                    metrics[f"{name}_mem_gpu_{kind}_delta"] = got[f"gpu_{kind}"]
        if stages[0] == "init":
            metrics["before_init_mem_cpu"] = self.figures["init"]["begin"]
            if torch.cuda.is_available():
                metrics["before_init_mem_gpu"] = self.figures["init"]["gpu_begin"]
