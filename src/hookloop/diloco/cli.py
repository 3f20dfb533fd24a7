"""``hookloop diloco serve``: run a DiLoCo server until interrupted.

::

    hookloop diloco serve --port 8512 [--host 127.0.0.1] [--outer-lr 0.7]
        [--outer-momentum 0.9] [--min-workers 1] [--round-timeout 600]
        [--checkpoint-dir DIR] [--token TOKEN | env DILOCO_TOKEN]
        [--certfile CERT --keyfile KEY]

Workers point ``DiLoCoCallback(server_addr=...)`` (or ``DILOCO_SERVER``) at it.
Started again with the same ``--checkpoint-dir`` it continues where it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

from hookloop.diloco.server import DiLoCoServer, ServerSettings, running


def add_diloco_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``diloco`` (with ``serve``) to an ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "diloco",
        help="DiLoCo across machines: run the server workers sync with",
        description="DiLoCo across machines. `serve` holds the global weights and the outer "
        "optimizer; workers are training runs with DiLoCoCallback(server_addr=HOST:PORT).",
    )
    sub = parser.add_subparsers(dest="diloco_command", required=True)
    serve = sub.add_parser("serve", help="run the DiLoCo server until interrupted")
    d = ServerSettings()
    serve.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    serve.add_argument("--port", type=int, required=True, help="port to listen on (0: any free)")
    serve.add_argument("--outer-lr", type=float, default=d.outer_lr, help="outer SGD lr")
    serve.add_argument(
        "--outer-momentum", type=float, default=d.outer_momentum, help="outer Nesterov momentum"
    )
    serve.add_argument(
        "--no-nesterov", action="store_true", help="plain momentum instead of Nesterov"
    )
    serve.add_argument(
        "--min-workers",
        type=int,
        default=d.min_workers,
        help="pseudo-gradients a round needs before it can close early (default 1)",
    )
    serve.add_argument(
        "--round-timeout",
        type=float,
        default=d.round_timeout,
        help="seconds after a round opens when it closes with what arrived (default 600)",
    )
    serve.add_argument("--checkpoint-dir", help="where the server keeps its state (resumable)")
    serve.add_argument("--token", help="bearer token workers must send (default: $DILOCO_TOKEN)")
    serve.add_argument("--certfile", help="TLS certificate (PEM): serve HTTPS")
    serve.add_argument("--keyfile", help="TLS private key (PEM) for --certfile")
    serve.set_defaults(run=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("DILOCO_TOKEN") or None
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        nesterov=not args.no_nesterov,
        min_workers=args.min_workers,
        round_timeout=args.round_timeout,
        checkpoint_dir=args.checkpoint_dir,
        token=token,
        certfile=args.certfile,
        keyfile=args.keyfile,
    )
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "the DiLoCo server needs aiohttp: pip install 'hookloop[diloco]'"
        ) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    server = DiLoCoServer(settings)
    if token is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"hookloop diloco: serving on {settings.host} WITHOUT a token: anyone who can "
            "reach it can change the model; pass --token",
            file=sys.stderr,
        )
    asyncio.run(_serve(server))
    return 0


async def _serve(server: DiLoCoServer) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    async with running(server) as port:
        scheme = "https" if server.ssl_context() is not None else "http"
        state = server.status()
        print(
            f"hookloop diloco: serving {scheme}://{server.settings.host}:{port} "
            f"(rounds {state['rounds'] or 'not started'})",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
