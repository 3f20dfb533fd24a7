"""``hookloop diloco serve`` (alias ``server``), and the commands that ask a running server:
``status``, ``set`` (the outer optimizer), ``pause`` and ``resume`` (the outer loop).

``serve`` takes Forgather's ``forgather diloco server`` options::

    hookloop diloco serve -o OUTPUT_DIR -n NUM_WORKERS [--from-checkpoint DIR]
        [--port 8512] [--host 127.0.0.1] [--outer-lr 0.7] [--outer-momentum 0.9]
        [--no-nesterov] [--save-every 10] [--save-total-limit 3] [--async]
        [--dn-buffer-size 0] [--dylu] [--dylu-base-sync-every 500]
        [--heartbeat-timeout 120] [--min-workers 1] [--no-dashboard]
        [--max-payload-mb N]

and hookloop's: ``--token T`` (or ``DILOCO_TOKEN``) or ``--no-auth`` (admit
tokenless peers such as Forgather's workers; off loopback only with
``--allow-remote-without-auth``), ``--allow-unbound-workers`` (admit workers
that send no worker secret, as Forgather's), ``--max-update-ratio R`` (refuse a
submission whose norm exceeds R times the global weights'), ``--certfile``/
``--keyfile`` (HTTPS), and ``--recipe NAME [KEY=VALUE ...]`` to start from that
recipe's freshly built model when ``OUTPUT_DIR`` holds no checkpoint yet.

``-n`` is, as in Forgather, the number of workers expected, not a barrier: each
round waits for the workers registered when its first submission arrives.

Started again on an output dir that holds its checkpoints, ``serve`` continues from
the highest round there, even when given ``--from-checkpoint`` (which seeds a new
output dir only). SIGINT or SIGTERM saves the current round (unless ``--save-every
0``) and exits 128 + the signal's number (130, 143), as ``hookloop train`` does; a
second server on the same output dir exits 2 naming the one that holds it.

``pause`` holds the server's rounds (workers train on locally and sync again at their
next sync point, :mod:`hookloop.diloco.pause`); ``resume`` lets them merge again. Each
prints one line; one the server refuses (already paused, not paused, a wrong token)
exits 2, an unreachable server 1. These commands import no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hookloop.diloco.options import MAX_UPDATE_RATIO

#: The commands that pause and resume a server's outer loop, and their help.
OUTER_LOOP_COMMANDS = {
    "pause": "pause the outer loop: no round advances, workers train on locally and sync "
    "again at their next sync point",
    "resume": "resume a paused outer loop: the workers' next syncs merge",
}


def add_diloco_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``diloco`` (``serve``, ``status``, ``set``, ``pause``, ``resume``) to an
    ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "diloco",
        help="DiLoCo across machines: the server workers sync with (Forgather's protocol)",
        description="DiLoCo across machines, in Forgather's protocol. `serve` holds the global "
        "weights and the outer optimizer; workers are training runs with "
        "DiLoCoCallback(server_addr=HOST:PORT) or Forgather's workers.",
    )
    sub = parser.add_subparsers(dest="diloco_command", required=True)
    serve = sub.add_parser("serve", aliases=["server"], help="run the DiLoCo server")
    _add_serve_arguments(serve.add_argument)
    serve.set_defaults(run=run_serve)
    status = sub.add_parser("status", help="print a DiLoCo server's status")
    status.add_argument("--server", default="localhost:8512", help="host:port or URL")
    status.add_argument("--token", help="bearer token (default: $DILOCO_TOKEN)")
    status.add_argument("--json", action="store_true", help="the raw JSON reply")
    status.set_defaults(run=run_status)
    setter = sub.add_parser(
        "set",
        help="change the outer optimizer's lr / momentum (Forgather's update_optimizer)",
    )
    setter.add_argument("--server", default="localhost:8512", help="host:port or URL")
    setter.add_argument("--token", help="bearer token (default: $DILOCO_TOKEN)")
    setter.add_argument("values", nargs="+", metavar="KEY=VALUE", help="lr=0.5 momentum=0.8")
    setter.set_defaults(run=run_set)
    for name, what in OUTER_LOOP_COMMANDS.items():
        command = sub.add_parser(name, help=what)
        command.add_argument("--server", default="localhost:8512", help="host:port or URL")
        command.add_argument("--token", help="bearer token (default: $DILOCO_TOKEN)")
        command.set_defaults(run=run_pause)
    return parser


def _add_serve_arguments(a: Any) -> None:
    """``hookloop diloco serve``'s options (``a``: the parser's ``add_argument``)."""
    a("--output-dir", "-o", type=os.path.expanduser, required=True,
      help="where checkpoints go; the newest one there is where the server starts")  # fmt: skip
    a("--num-workers", "-n", type=int, required=True,
      help="workers expected (shown in /status; grows as more register). Not a barrier, as "
           "in Forgather: a round waits for the workers registered when its first "
           "submission arrives, so start every worker before the first sync to have "
           "them all in round 0")  # fmt: skip
    a("--from-checkpoint", "-c", type=os.path.expanduser, help="start from this model directory")
    a("--recipe", help="with no checkpoint yet: start from this recipe's freshly built model")
    a("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides for --recipe")
    a("--port", type=int, default=8512, help="port (default 8512; 0: any free)")
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    a("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (default 0.7)")
    a("--outer-momentum", type=float, default=0.9, help="outer momentum (default 0.9)")
    a("--no-nesterov", action="store_true", help="plain momentum instead of Nesterov")
    a("--save-every", type=int, default=10, help="save every N rounds (0: never; default 10)")
    a("--save-total-limit", type=int, default=3, help="checkpoints kept (0: all; default 3)")
    a("--async", dest="async_mode", action="store_true", help="asynchronous mode")
    a("--dn-buffer-size", type=int, default=0, help="Delayed Nesterov buffer (async; 0: off)")
    a("--dylu", action="store_true", help="recommend per-worker sync_every (DyLU)")
    a("--dylu-base-sync-every", type=int, default=500, help="DyLU's sync_every of the fastest")
    a("--heartbeat-timeout", type=float, default=120.0,
      help="seconds of silence before a worker is evicted (0: never; default 120)")  # fmt: skip
    a("--min-workers", type=int, default=1, help="floor of the expected workers (default 1)")
    a("--no-dashboard", action="store_true", help="do not serve /dashboard")
    a("--max-payload-mb", type=int, default=None, metavar="N",
      help="largest request body in MB; larger ones are refused with 413 (default: the "
           "model's size in float64 plus 64)")  # fmt: skip
    a("--token", help="bearer token every peer must send (default: $DILOCO_TOKEN)")
    a("--no-auth", action="store_true", help="admit tokenless peers (Forgather's workers)")
    a("--allow-remote-without-auth", action="store_true",
      help="with --no-auth on an address other than loopback: really do it")  # fmt: skip
    a("--allow-unbound-workers", action="store_true",
      help="admit workers that ask for no worker secret (Forgather's), each tied to the "
           "address it registered from; hookloop's workers stay bound to their secret")  # fmt: skip
    a("--max-update-ratio", type=float, default=MAX_UPDATE_RATIO, metavar="R",
      help="refuse a submission whose norm is more than R times the global weights' norm "
           f"(a diverged worker); 0: no bound (default {MAX_UPDATE_RATIO:g})")  # fmt: skip
    a("--certfile", help="TLS certificate (PEM): serve HTTPS")
    a("--keyfile", help="TLS private key (PEM) for --certfile")


def run_set(args: argparse.Namespace) -> int:
    """``hookloop diloco set lr=0.5``: the server checks the values (exit 2 when refused),
    applies them before the next outer step and records them in its changes.jsonl."""
    from hookloop.control.client import client_name
    from hookloop.diloco.client import DiLoCoClient

    values: dict[str, Any] = {}
    for pair in args.values:
        key, sep, raw = pair.partition("=")
        if not sep or key not in ("lr", "momentum"):
            print(f"hookloop diloco set: error: expected lr=VALUE or momentum=VALUE, got {pair!r}",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            values[key] = float(raw)
        except ValueError:
            print(f"hookloop diloco set: error: {key} must be a number, got {raw!r}",
                  file=sys.stderr)  # fmt: skip
            return 2
    token = args.token or os.environ.get("DILOCO_TOKEN") or None
    client = DiLoCoClient(args.server, timeout=10, token=token)
    try:
        answer = client.control("update_optimizer", {**values, "client": client_name()})
    except Exception as err:  # the server's refusal (HTTP 400) or an unreachable server
        status = getattr(err, "status", None) or getattr(err, "code", None)
        print(f"hookloop diloco set: error: {err}", file=sys.stderr)
        return 2 if status == 400 else 1
    print(f"outer optimizer now {', '.join(f'{k} {answer[k]}' for k in values)}")
    return 0


def _start_weights(args: argparse.Namespace) -> str | None:
    """The checkpoint to start from: the output dir's own (a restart with the same command
    line continues its rounds), else the one given, else one made from a recipe."""
    from hookloop.diloco import storage

    if storage.saved_rounds(args.output_dir):
        if args.from_checkpoint:
            print(f"hookloop diloco: {args.output_dir} holds this server's checkpoints: "
                  f"continuing from them, not from {args.from_checkpoint} (which starts a "
                  "new output dir)", file=sys.stderr, flush=True)  # fmt: skip
        return None
    if args.from_checkpoint or storage.find_latest(args.output_dir) is not None:
        return args.from_checkpoint
    if not args.recipe:
        if args.overrides:
            raise ValueError("KEY=VALUE overrides need --recipe")
        return None  # the server names what is missing
    from hookloop.config import apply_overrides
    from hookloop.entry import seed_everything
    from hookloop.recipes import default_config, get_recipe

    cfg = default_config(args.recipe)
    apply_overrides(cfg, list(args.overrides))
    seed_everything(cfg.seed)
    model = get_recipe(cfg.recipe).build(cfg).model
    return str(storage.save_initial(Path(args.output_dir) / "initial", model))


def run_serve(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "the DiLoCo server needs aiohttp: pip install 'hookloop[diloco]'"
        ) from None
    from hookloop.diloco import storage
    from hookloop.diloco.server import DiLoCoServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    token = args.token or os.environ.get("DILOCO_TOKEN") or None
    storage.check_output_dir(args.output_dir)
    if token is None and not args.no_auth:
        raise ValueError("hookloop diloco serve needs --token T (or DILOCO_TOKEN) or --no-auth "
                         "to admit tokenless peers such as Forgather's workers")  # fmt: skip
    server = DiLoCoServer(
        args.output_dir, args.num_workers, _start_weights(args), args.port, None, args.host,
        args.save_every, args.save_total_limit, args.async_mode, True, args.dn_buffer_size,
        args.dylu, args.dylu_base_sync_every, args.heartbeat_timeout, args.min_workers,
        not args.no_dashboard, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        nesterov=not args.no_nesterov, token=token, disable_auth=args.no_auth,
        allow_remote_without_auth=args.allow_remote_without_auth,
        certfile=args.certfile, keyfile=args.keyfile, max_payload_mb=args.max_payload_mb,
        allow_unbound_workers=args.allow_unbound_workers, max_update_ratio=args.max_update_ratio,
    )  # fmt: skip

    def ready() -> None:
        scheme = "https" if args.certfile else "http"
        url = f"{scheme}://{server.address}"
        print(f"hookloop diloco: serving {url} (round {server.status()['sync_round']}); "
              f"dashboard {url}/dashboard", file=sys.stderr, flush=True)  # fmt: skip

    import asyncio
    import signal

    signum = asyncio.run(server.serve_until_signal(ready))
    if signum is None:
        return 0
    round_now = server.status()["sync_round"]
    print(f"hookloop diloco: stopped by {signal.Signals(signum).name} at round {round_now} "
          f"(exit {128 + signum})", file=sys.stderr, flush=True)  # fmt: skip
    return 128 + signum


def run_pause(args: argparse.Namespace) -> int:
    """``hookloop diloco pause`` / ``resume``: one line saying what the server did."""
    from hookloop.control.client import client_name
    from hookloop.diloco.client import DiLoCoClient
    from hookloop.diloco.pause import clock

    action = args.diloco_command
    token = args.token or os.environ.get("DILOCO_TOKEN") or None
    client = DiLoCoClient(args.server, timeout=10, token=token)
    try:
        answer = client.control(action, {"client": client_name()})
    except Exception as err:  # the server's refusal (409: nothing to do) or no server
        status = getattr(err, "status", None)
        print(f"hookloop diloco {action}: error: {err}", file=sys.stderr)
        return 2 if status is not None else 1
    if action == "pause":
        print(f"outer loop paused at round {answer['sync_round']} (since "
              f"{clock(answer['paused_since'])}): workers train on locally and sync again at "
              f"their next sync point; `hookloop diloco resume --server {args.server}` goes "
              "on")  # fmt: skip
    else:
        print(
            f"outer loop resumed at round {answer['sync_round']} after "
            f"{answer['paused_seconds']:.0f} s paused: the workers' next syncs merge"
        )
    return 0


def run_status(args: argparse.Namespace) -> int:
    from hookloop.diloco.client import DiLoCoClient

    token = args.token or os.environ.get("DILOCO_TOKEN") or None
    status = DiLoCoClient(args.server, timeout=10, token=token).get_status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"DiLoCo server {args.server}: {status['status']}, mode {status['mode']}, "
          f"round {status['sync_round']}, workers {status['num_registered']}/"
          f"{status['num_workers']}, outer lr {status['outer_lr']} momentum "
          f"{status['outer_momentum']}")  # fmt: skip
    if status.get("paused"):
        from hookloop.diloco.pause import clock

        print(
            f"  outer loop paused since {clock(status['paused_since'])} by "
            f"{status['paused_by']}: no round advances until `hookloop diloco resume`"
        )
    for worker_id, w in status["workers"].items():
        print(f"  {worker_id:<30} {w['hostname']:<15} syncs {w['sync_round']:<6} "
              f"{w['steps_per_second']:.2f} steps/s")  # fmt: skip
    return 0
