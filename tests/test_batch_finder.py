"""``hookloop.batch_finder``: the largest batch that fits, found as accelerate finds it."""

from __future__ import annotations

import logging

import pytest
import torch

from hookloop.batch_finder import (
    NoBatchSizeFits,
    find_executable_batch_size,
    halve,
    is_out_of_memory,
)


def fits_up_to(limit: int, tried: list[int], error: Exception | None = None):
    """A run that needs a batch of at most ``limit``, recording each size tried."""

    def run(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > limit:
            raise error if error is not None else torch.OutOfMemoryError("CUDA out of memory.")
        return batch_size * 10

    return run


def test_shrinks_by_a_tenth_as_accelerate_until_one_fits() -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    ours, theirs = [], []
    assert find_executable_batch_size(fits_up_to(5, ours), 8) == 50
    wrapped = accelerate.find_executable_batch_size(starting_batch_size=8)(fits_up_to(5, theirs))
    assert wrapped() == 50
    assert ours == theirs == [8, 7, 6, 5]


def test_halving_and_cpu_allocator_messages() -> None:
    tried: list[int] = []
    cpu = RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried")
    assert find_executable_batch_size(fits_up_to(3, tried, cpu), 16, shrink=halve) == 20
    assert tried == [16, 8, 4, 2]
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError(" out of memory."))


def test_other_errors_pass_through_untouched() -> None:
    tried: list[int] = []
    with pytest.raises(ValueError, match="a bug of the user's"):
        find_executable_batch_size(fits_up_to(0, tried, ValueError("a bug of the user's")), 8)
    assert tried == [8]  # not retried


def test_gives_up_at_zero_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    tried: list[int] = []
    with (
        caplog.at_level(logging.INFO, logger="hookloop.batch_finder"),
        pytest.raises(NoBatchSizeFits) as info,
    ):
        find_executable_batch_size(fits_up_to(0, tried), 3)
    assert tried == [3, 2, 1]
    message = str(info.value)
    assert "\n" not in message and "a batch of 1 ran out of memory" in message
    assert "trying 2" in caplog.text and "trying 1" in caplog.text


def test_starting_size_is_checked() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        find_executable_batch_size(lambda b: b, 0)
    with pytest.raises(TypeError, match="an int"):
        find_executable_batch_size(lambda b: b, True)
