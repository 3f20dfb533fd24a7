"""Megatron-Bridge's logging set-up and its barrier-then-log line.

The dialect logs under Megatron-Bridge's logger names (``megatron.bridge.training.train``
…), so :func:`setup_logging` tunes them as it does there: one level for the root
logger and every ``megatron.bridge`` logger (or every logger), taken from
``MEGATRON_BRIDGE_LOGGING_LEVEL`` when set, and optional filters that drop WARNING
records or the records of given modules.

>>> import logging
>>> module_filter(logging.makeLogRecord({"name": "noisy.lib"}), ["noisy"])
False
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from datetime import datetime

import torch

from hookloop.distributed import rank_info

logger = logging.getLogger("megatron.bridge.training.utils.log_utils")

#: The environment variable whose level (an int) wins over ``setup_logging``'s argument.
LEVEL_VARIABLE = "MEGATRON_BRIDGE_LOGGING_LEVEL"

RecordFilter = Callable[[logging.LogRecord], bool]


def warning_filter(record: logging.LogRecord) -> bool:
    """Keep every record but those at WARNING level."""
    return record.levelno != logging.WARNING


def module_filter(record: logging.LogRecord, modules_to_filter: list[str]) -> bool:
    """Keep the record unless its logger's name starts with one of ``modules_to_filter``."""
    return not any(record.name.startswith(prefix) for prefix in modules_to_filter)


def add_filter_to_all_loggers(filter: RecordFilter | logging.Filter) -> None:
    """Add ``filter`` to the root logger and to every logger made so far."""
    logging.getLogger().addFilter(filter)
    for name in list(logging.root.manager.loggerDict):
        logging.getLogger(name).addFilter(filter)


def setup_logging(
    logging_level: int = logging.INFO,
    filter_warning: bool = True,
    modules_to_filter: list[str] | None = None,
    set_level_for_all_loggers: bool = False,
) -> None:
    """Set the level of the root and ``megatron.bridge`` loggers (all loggers with
    ``set_level_for_all_loggers``) and add the filters asked for."""
    from_environment = os.environ.get(LEVEL_VARIABLE)
    if from_environment is not None:
        logging_level = int(from_environment)
    logger.info("logging level: %s", logging_level)
    logging.getLogger().setLevel(logging_level)
    for name in list(logging.root.manager.loggerDict):
        if set_level_for_all_loggers or name.startswith("megatron.bridge"):
            logging.getLogger(name).setLevel(logging_level)
    if filter_warning:
        add_filter_to_all_loggers(warning_filter)
    if modules_to_filter:
        add_filter_to_all_loggers(
            functools.partial(module_filter, modules_to_filter=modules_to_filter)
        )


def barrier_and_log(string: str) -> None:
    """Wait for every rank, then log ``string`` with the time on rank 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if rank_info()[0] == 0:
        now = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        logging.getLogger("megatron.bridge.training.train").info("[%s] datetime: %s", string, now)
