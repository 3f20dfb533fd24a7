"""DiLoCo across machines: a server holding the global model, workers that join and leave.

- :mod:`hookloop.diloco.outer`: the outer Nesterov step (shared with the all-reduce
  callback :class:`hookloop.callbacks.DiLoCo`).
- :mod:`hookloop.diloco.wire`: safetensors payloads, bf16 casting, fragments.
- :mod:`hookloop.diloco.server`: the aiohttp server (``hookloop diloco serve``).
- :mod:`hookloop.diloco.client`: the worker's HTTP client, with retries.
- :mod:`hookloop.diloco.worker`: when a worker syncs what (DyLU, streaming fragments).
- :mod:`hookloop.diloco.callback`: :class:`DiLoCoCallback`, seed 004's constructor.
"""
