"""The forward-step protocol and how losses are reduced over micro-batches.

A forward step is ``forward_step(state, data_iterator, model) -> (output,
loss_func)`` (``(data_iterator, model)`` also works). It takes the next
micro-batch with ``next(data_iterator)``, runs the model, and returns the
output plus a function that turns the output into a loss. ``loss_func(output)``
may return one of three patterns:

1. ``(loss, meta)``: ``loss`` is the micro-batch mean. The step's loss is the
   mean over micro-batches; each ``meta`` value is averaged the same way.
2. ``(loss_sum, num_tokens, meta)``: ``loss_sum`` is summed over tokens. The
   step's loss is ``sum(loss_sum) / sum(num_tokens)`` over all micro-batches
   (and data-parallel ranks), so long and short sequences weigh by their
   tokens. A ``meta`` value that is a 2-element tensor ``[numerator,
   denominator]`` is reduced as a ratio of sums; a scalar is token-weighted.
3. Anything else: non-loss data, collected as-is by ``Trainer.predict()``.

A bare scalar tensor is accepted as pattern 1 with empty meta.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

ForwardStep = Callable[..., tuple[Any, Callable[[Any], Any]]]
LossFn = Callable[[Any, Any], torch.Tensor]

PATTERNS_HELP = (
    "loss_func(output) must return (loss, meta_dict), (loss_sum, num_tokens, meta_dict), "
    "or a scalar loss tensor"
)


def bind_forward_step(fn: ForwardStep) -> Callable[[Any, Iterator[Any], Any], Any]:
    """Return ``call(state, data_iterator, model)`` for either supported signature.

    The signature is inspected once, here, so the step never pays for it.
    """
    if not callable(fn):
        raise TypeError(f"forward_step must be callable, got {type(fn).__name__}")
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):  # builtins without a signature: assume the full form
        return fn
    if len(params) >= 3:
        return fn
    if len(params) == 2:
        return lambda state, data_iterator, model: fn(data_iterator, model)
    raise TypeError(
        "forward_step must take (state, data_iterator, model) or (data_iterator, model); "
        f"{getattr(fn, '__qualname__', fn)} takes {len(params)} required positional arguments"
    )


def move_to(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to(v, device) for v in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    return batch


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 if none)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor:  # (inputs, targets)
        shape = batch[0].shape
        return shape[0] if shape else 1
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, Mapping) and batch:  # a dict, or a BatchEncoding
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return 1


def extract_loss(output: Any) -> torch.Tensor:
    """The loss from what a model returned: a scalar tensor, ``out["loss"]`` or ``out.loss``."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.numel() == 1:
            return output.reshape(())
    elif isinstance(output, dict) and "loss" in output:
        return output["loss"]
    elif getattr(output, "loss", None) is not None:
        return output.loss
    raise TypeError(
        "could not find a loss in the model output "
        f"({type(output).__name__}); without a loss_fn the model must return a scalar "
        "tensor, a dict with 'loss', or an object with .loss. Pass loss_fn=… or a forward_step."
    )


def default_forward_step(loss_fn: LossFn | None, device: torch.device) -> ForwardStep:
    """The forward step used when none is given.

    - batch ``(inputs, targets)`` with ``loss_fn``: ``loss_fn(model(inputs), targets)``
    - dict batch: ``model(**batch)`` returns the loss (or ``.loss`` / ``["loss"]``)
    - tuple batch without ``loss_fn``: ``model(*batch)`` returns the loss
    - anything else: ``model(batch)`` returns the loss
    """
    on_cpu = device.type == "cpu"

    def forward_step(state: Any, data_iterator: Iterator[Any], model: Any) -> Any:
        batch = next(data_iterator)
        if not on_cpu:
            batch = move_to(batch, device)
        if loss_fn is not None:
            if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
                raise TypeError(
                    "with loss_fn the batch must be (inputs, targets), got "
                    f"{type(batch).__name__}"
                    + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
                )
            inputs, targets = batch
            output = model(inputs)
            return output, lambda out: (loss_fn(out, targets), {})
        if isinstance(batch, dict):
            output = model(**batch)
        elif isinstance(batch, (list, tuple)):
            output = model(*batch)
        else:
            output = model(batch)
        return output, _loss_from_output

    return forward_step


def _loss_from_output(output: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    return extract_loss(output), {}


class LossReducer:
    """Accumulates ``loss_func`` results over micro-batches (or eval batches).

    Keeps everything as tensors: nothing here reads a value back to the host.
    With one micro-batch and no meta the step's loss is the loss tensor itself:
    the common case costs no extra tensor operation.
    """

    __slots__ = ("_den", "_losses", "_meta", "_meta_w", "_num", "_tokens", "token_mode")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        # Once a step: only what every step uses is made anew here. The token list and the
        # meta sums are made by the first micro-batch that needs them.
        self.token_mode: bool | None = None
        self._losses: list[torch.Tensor] = []  # detached: means (1) or token sums (2)
        self._tokens: list[Any] | None = None  # pattern 2: token counts
        self._meta: dict[str, Any] | None = None  # created by the first meta value
        self._meta_w: dict[str, Any] | None = None  # the weights of the meta sums
        self._num: Any = None  # set (with _den) once sums are reduced over ranks
        self._den: Any = None

    def add(self, result: Any) -> tuple[torch.Tensor, Any]:
        """Record one micro-batch; return ``(loss for backward, tokens or None)``.

        Pattern 1 returns the micro-batch mean (the caller divides by the number
        of micro-batches); pattern 2 returns the token sum (the caller divides
        the gradients by the total tokens once all micro-batches are in).
        """
        if type(result) is tuple and len(result) == 2 and not self.token_mode:
            loss, meta = result  # usual: (loss, meta) of plain types, e.g. (loss, {})
            if type(loss) is torch.Tensor and type(meta) is dict and loss.numel() == 1:
                self.token_mode = False
                self._losses.append(loss.detach())
                if meta:
                    self._add_meta(meta, 1)
                return loss, None
        elif type(result) is torch.Tensor and not self.token_mode:  # a bare loss (pattern 1)
            if result.numel() != 1:
                raise TypeError(
                    f"{PATTERNS_HELP}; the loss must be a scalar tensor, got shape "
                    f"{tuple(result.shape)} (reduce it, e.g. .mean() or .sum())"
                )
            self.token_mode = False
            self._losses.append(result.detach())
            return result, None
        if type(result) is not tuple:
            if isinstance(result, torch.Tensor):
                result = (result, {})
            elif not isinstance(result, tuple):
                raise TypeError(f"{PATTERNS_HELP}; got {type(result).__name__}")
        n = len(result)
        if n != 2 and n != 3:
            raise TypeError(f"{PATTERNS_HELP}; got a tuple of {n}")
        token_mode = n == 3
        if self.token_mode is None:
            self.token_mode = token_mode
        elif self.token_mode != token_mode:
            raise TypeError("loss_func mixed the (loss, meta) and (loss, tokens, meta) patterns")
        loss, meta = result[0], result[-1]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss)
            raise TypeError(
                f"{PATTERNS_HELP}; the loss must be a scalar tensor, got {what} "
                "(reduce it, e.g. .mean() or .sum())"
            )
        if type(meta) is not dict:
            raise TypeError(f"{PATTERNS_HELP}; meta must be a dict, got {type(meta).__name__}")
        self._losses.append(loss.detach())
        tokens = result[1] if token_mode else None
        if token_mode:
            if self._tokens is None:
                self._tokens = []
            self._tokens.append(tokens)
        if meta:
            self._add_meta(meta, tokens if token_mode else 1)
        return loss, tokens

    def _add_meta(self, meta: dict[str, Any], weight: Any) -> None:
        if self._meta is None:
            self._meta, self._meta_w = {}, {}
        sums, weights = self._meta, self._meta_w
        for key, value in meta.items():
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.numel() == 2:  # [numerator, denominator]: ratio of sums
                    sums[key] = sums.get(key, 0) + value[0]
                    weights[key] = weights.get(key, 0) + value[1]
                    continue
            sums[key] = sums.get(key, 0) + value * weight
            weights[key] = weights.get(key, 0) + weight

    def _sums(self) -> tuple[Any, Any]:
        """(numerator, denominator) of the loss: over ranks once reduced."""
        if self._num is not None:
            return self._num, self._den
        losses = self._losses
        num = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
        if not self.token_mode:
            return num, len(losses)
        tokens: list[Any] = self._tokens  # type: ignore[assignment]  # set in token mode
        den = tokens[0] if len(tokens) == 1 else sum(tokens[1:], tokens[0])
        return num, den

    @property
    def tokens(self) -> Any:
        """Total tokens (pattern 2; over ranks once reduced), else None."""
        return self._sums()[1] if self.token_mode and self._losses else None

    def result(self) -> dict[str, Any]:
        """``{"loss": …, **meta}`` reduced over everything added (tensors stay tensors)."""
        losses = self._losses
        if not losses:
            return {}
        if self._num is None and not self.token_mode:
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        else:
            num, den = self._sums()
            loss = num / den
        out = {"loss": loss}
        if self._meta:
            for key, total in self._meta.items():
                out[key] = total / self._meta_w[key]
        return out

    def reduce_tokens_across_ranks(self, device: torch.device | None = None) -> Any:
        """Token mode: total tokens over all ranks; the loss becomes the global ratio too."""
        from hookloop.distributed import all_reduce_sum, is_distributed

        num, den = self._sums()
        if not is_distributed():
            return den
        both = all_reduce_sum(_stack64([num, den], device))
        self._num, self._den = both[0], both[1]
        return self._den

    def reduce_across_ranks(self, device: torch.device | None = None) -> None:
        """Sum every numerator and denominator over ranks (for evaluation results)."""
        from hookloop.distributed import all_reduce_sum, is_distributed

        if not is_distributed() or not self._losses:
            return
        num, den = self._sums()
        meta = self._meta or {}
        keys = sorted(meta)
        parts = [num, den] + [p for k in keys for p in (meta[k], self._meta_w[k])]
        summed = all_reduce_sum(_stack64(parts, device))
        self._num, self._den = summed[0], summed[1]
        for i, k in enumerate(keys):
            meta[k], self._meta_w[k] = summed[2 + 2 * i], summed[3 + 2 * i]

    @property
    def count(self) -> int:
        return len(self._losses)


def _stack64(values: list[Any], device: torch.device | None) -> torch.Tensor:
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])


def count_zeros(grads: list[torch.Tensor], *, sharded: bool = False) -> torch.Tensor:
    """Zero elements over ``grads``: Megatron's ``num_zeros_in_grad``, as a device tensor.

    ``sharded``: each rank holds a slice of every gradient (FSDP); the slices'
    counts are summed over ranks. Replicated (DDP) gradients are counted once.
    """
    from hookloop.distributed import all_reduce_sum, local_shards

    shards = local_shards(grads)
    if not shards:
        return torch.zeros((), dtype=torch.int64)
    total = torch.stack([(g == 0).sum() for g in shards]).sum()
    return all_reduce_sum(total) if sharded else total


def to_float(value: Any) -> float:
    """A Python float from a tensor or number (this is where a device sync happens)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


def read_back(values: list[Any]) -> list[list[float] | None]:
    """Each value as a list of Python floats, with ONE device-to-host transfer for all.

    Tensors are flattened, cast to float32 (so the numbers equal ``.float().item()``)
    and then to float64 (exact, and so that an integer count stays exact past
    2**24), concatenated and read back with one ``tolist()``. Numbers pass
    through as ``[float(v)]``; ``None`` stays ``None``.
    """
    tensors = [v.detach().reshape(-1) for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) == 1 and tensors[0].dtype == torch.float32:  # usual: the losses alone
        host = iter(tensors[0].tolist())  # float32 -> Python float is exact: no cast needed
    elif tensors:
        flat = [t.double() if not t.is_floating_point() else t.float().double() for t in tensors]
        host = iter(torch.cat(flat).tolist() if len(flat) > 1 else flat[0].tolist())
    out: list[list[float] | None] = []
    for value in values:
        if value is None:
            out.append(None)
        elif isinstance(value, torch.Tensor):
            out.append([next(host) for _ in range(value.numel())])
        else:
            out.append([float(value)])
    return out
