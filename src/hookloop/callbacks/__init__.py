"""Built-in callbacks. Each is optional; the loop never depends on one."""

from hookloop.callbacks.jsonlog import JsonLogger, read_jsonl
from hookloop.callbacks.progress import ProgressBar, format_metrics

__all__ = ["JsonLogger", "ProgressBar", "format_metrics", "read_jsonl"]
