"""``scd``: command-line entry point and exit codes (DESIGN §8)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from scd.config import Config, load_config
from scd.errors import EXIT_CONFIG, EXIT_OK, EXIT_OTHER, ScdError

log = logging.getLogger("scd")


async def handle_signals(shutdown: anyio.Event, *,
                         task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """SIGTERM/SIGINT fire the shutdown trigger (a drain); a second one is left to the deadline."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            shutdown.set()


async def run_daemon(config: Config, max_steps: int | None) -> None:
    from scd.daemon import Controller

    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(handle_signals, shutdown, name="signals")
        async with Controller.open(config) as controller:
            if not shutdown.is_set():
                await controller.run(shutdown, max_steps)
        tg.cancel_scope.cancel()


def _first_scd_error(exc: BaseException) -> ScdError | None:
    if isinstance(exc, ScdError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_scd_error(inner)
            if found:
                return found
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scd", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the controller")
    run.add_argument("config", help="TOML config file")
    run.add_argument("--max-steps", type=int, default=None, help="stop after N trainer steps")
    return parser


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transfer_queue", "ray", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        if args.command == "run":
            config = load_config(args.config)
            if args.max_steps is not None and args.max_steps < 1:
                print("scd: error: --max-steps must be >= 1", file=sys.stderr)
                return EXIT_CONFIG
            anyio.run(run_daemon, config, args.max_steps, backend="asyncio",
                      backend_options={"use_uvloop": True})
    except BaseException as exc:
        error = _first_scd_error(exc)
        if error is not None:
            print(f"scd: error: {error}", file=sys.stderr)
            return error.exit_code
        if isinstance(exc, KeyboardInterrupt):
            return EXIT_OK
        if isinstance(exc, SystemExit):
            raise
        log.exception("scd stopped on an unexpected error")
        return EXIT_OTHER
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
