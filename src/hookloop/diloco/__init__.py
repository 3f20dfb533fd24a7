"""DiLoCo across machines, in Forgather's protocol: a server holding the global model,
workers that register, sync and leave.

- :mod:`hookloop.diloco.wire`: the encoding (torch.save payloads, length-prefixed headers),
  fragments and their schedule.
- :mod:`hookloop.diloco.validate`: whether a submission may touch the global model.
- :mod:`hookloop.diloco.storage`: the server's checkpoints (Forgather's layout).
- :mod:`hookloop.diloco.server`: the aiohttp server (``hookloop diloco serve``).
- :mod:`hookloop.diloco.dashboard`: the page ``/dashboard`` serves.
- :mod:`hookloop.diloco.client`: the HTTP client (Forgather's methods).
- :mod:`hookloop.diloco.worker`: when a worker syncs what (fragments, DyLU, retries).
- :mod:`hookloop.diloco.callback`: :class:`DiLoCoCallback`, Forgather's constructor.
- :mod:`hookloop.diloco.outer`: the outer Nesterov step of the all-reduce variant
  :class:`hookloop.callbacks.DiLoCo`.
"""
