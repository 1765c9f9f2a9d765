"""``scd``: command-line entry point and exit codes."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import anyio
import orjson
from anyio.abc import TaskStatus

from scd.checkpoint.restore import check_before_start
from scd.cluster import AbandonedCalls, plan_devices
from scd.config import Config, load_config
from scd.daemon import Controller
from scd.errors import EXIT_CONFIG, EXIT_INVARIANT, EXIT_OK, EXIT_OTHER, ScdError
from scd.rewards import resolve_rewards
from scd.samplers import build_sampler
from scd.telemetry.events import Start
from scd.telemetry.http import open_listener, serve_http
from scd.telemetry.trackers import require_tracker_packages
from scd.triggers import Triggers

log = logging.getLogger("scd")


async def handle_signals(triggers: Triggers, *,
                         task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """SIGTERM/SIGINT fire the shutdown trigger (a drain); SIGUSR1 asks for a checkpoint."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
        task_status.started()
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            if signum == signal.SIGUSR1:
                triggers.request_checkpoint()
            else:
                triggers.shutdown.set()


async def run_daemon(config: Config, args: argparse.Namespace) -> None:
    triggers = Triggers()
    async with anyio.create_task_group() as tg:
        # Signals are handled from the first moment: a SIGTERM during a long restore still drains.
        await tg.start(handle_signals, triggers, name="signals")
        # Served from before Ray starts: /readyz says 503 (and /healthz ok) until the controller is up, and
        # again while a reward's service is down.
        listener = await open_listener(config.telemetry.metrics_host, config.telemetry.metrics_port)
        opened: list[Controller] = []
        async with anyio.create_task_group() as http:
            port = await http.start(serve_http, listener, lambda: opened[0].watch.health_problem() if opened else "",
                                    lambda: bool(opened) and opened[0].ready,
                                    lambda: opened[0].watch.outage() if opened else "", name="http")
            async with Controller.open(config, config_dir=Path(args.config).resolve().parent) as controller:
                controller.metrics_port = port
                opened.append(controller)
                try:
                    await run_controller(controller, triggers, args)
                except BaseException as exc:
                    # Said before the teardown: stopping Ray after a call it abandoned can end the process
                    # (Ray's core worker exits when the stuck thread touches it), and the reason must be out.
                    _report(exc)
                    raise
            http.cancel_scope.cancel()
        tg.cancel_scope.cancel()


async def run_controller(controller: Controller, triggers: Triggers, args: argparse.Namespace) -> None:
    """Announce the start, restore, and run until done or drained."""
    placement = controller.dataplane.placement
    await controller.events.emit(Start(step=controller.state.trainer_step, pid=os.getpid(),
                                       tq_controller_node=placement.controller,
                                       tq_storage_unit_nodes=placement.storage_units))
    await controller.restore(args.restore_from, args.allow_config_change, args.discard_newer)
    if not triggers.shutdown.is_set():
        await controller.run(triggers, args.max_steps)


def eval_command(args: argparse.Namespace) -> int:
    """Print the evaluation of one bundle as JSON (the ``eval`` event's numbers) on stdout, alone; exit 0."""
    from scd.evaluation import evaluate_bundle, summary

    config = load_config(args.config, args.overrides)
    resolve_rewards(config.task, args.config.resolve().parent)
    with _stdout_for_the_result_alone() as result:
        event = anyio.run(evaluate_bundle, config, args.bundle, args.config.resolve().parent, backend="asyncio",
                          backend_options={"use_uvloop": True})
        result.write(orjson.dumps(summary(event), option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return EXIT_OK


@contextlib.contextmanager
def _stdout_for_the_result_alone() -> Iterator[BinaryIO]:
    """The real stdout, for the result; within the block file descriptor 1 is stderr's, so whatever else
    writes to stdout goes to stderr: vLLM's logger (stdout by default), its engine processes (which
    inherit the descriptor), any library's print."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with open(saved, "wb", closefd=False) as result:
            yield result
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def checkpoint_command(args: argparse.Namespace) -> int:
    from scd.checkpoint.inspect import inspect_bundle, list_bundles
    from scd.checkpoint.verify import BundleError

    if args.checkpoint_command == "list":
        if not args.dir.is_dir():
            print(f"scd: error: {args.dir} is not a directory", file=sys.stderr)
            return EXIT_CONFIG
        for row in list_bundles(args.dir):
            flags = ("finalized" if row["finalized"] else "UNFINISHED") + (" latest" if row["latest"] else "")
            print(f"{row['name']}  {row['bytes']:>12d} bytes  {flags}")
        return EXIT_OK
    try:
        summary = inspect_bundle(args.path)
    except BundleError as exc:
        print(f"scd: {exc}", file=sys.stderr)
        return EXIT_INVARIANT
    if args.checkpoint_command == "verify":
        print(f"ok: {args.path} (step {summary['step']}, {summary['groups']} groups, {summary['samples']} samples)")
    elif args.json:
        sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        for key, value in summary.items():
            print(f"{key:28s} {value}")
    return EXIT_OK


def model_command(args: argparse.Namespace) -> int:
    """``init-tiny DIR`` writes a model; ``init-tiny --for-config CONFIG`` writes the one CONFIG names if missing."""
    from scd.model.init_tiny import init_tiny
    from scd.model.policy import TINY

    if (args.dir is None) == (args.for_config is None):
        print("scd: error: give a directory or --for-config CONFIG", file=sys.stderr)
        return EXIT_CONFIG
    if args.dir is not None:
        print(init_tiny(args.dir))
        return EXIT_OK
    name = load_config(args.for_config).model.name
    if name != TINY and not (Path(name) / "config.json").exists():
        print(init_tiny(Path(name)))
    return EXIT_OK


def _report(exc: BaseException) -> None:
    """Print scd's error in ``exc`` (exit code aside) once, however often it is reported."""
    error = _first_scd_error(exc)
    if error is not None and not error.reported:
        print(f"scd: error: {error}", file=sys.stderr, flush=True)
        error.reported = True


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
    run.add_argument("--max-steps", type=int, default=None,
                     help="stop once the run has made N trainer steps in all (a restored run's steps count: "
                          "not N more); default run.max_steps")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="set a config key over the file's (repeatable; VALUE read as TOML, else as text), "
                          "checked as the file's keys are; the fingerprint records the result")
    run.add_argument("--output-dir", type=Path, default=None, help="run.output_dir, over the file's")
    run.add_argument("--restore-from", type=Path, default=None,
                     help="restore this bundle instead of the newest finalized one")
    run.add_argument("--discard-newer", action="store_true",
                     help="with --restore-from an older bundle: move the newer bundles to "
                          "<checkpointing.dir>/abandoned/<time>/ (never deleted) and continue from it")
    run.add_argument("--allow-config-change", action="store_true",
                     help="restore even if settings that change what stored rollouts mean have changed")
    report = commands.add_parser("report", help="plots and a summary table from an event log")
    report.add_argument("events", type=Path, help="JSONL event log (telemetry.events_path)")
    report.add_argument("-o", "--out", type=Path, required=True, help="directory for the PNG plots")
    model = commands.add_parser("model", help="make a local model (no hub downloads)")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    init = model_commands.add_parser("init-tiny", help="a random-init Llama and a character tokenizer")
    init.add_argument("dir", type=Path, nargs="?", help="directory to write the model into")
    init.add_argument("--for-config", type=Path, help="write the model.name directory of CONFIG if it is missing")
    export = commands.add_parser("export", help="a bundle's policy as a Hugging Face model directory")
    export.add_argument("bundle", type=Path, help="a checkpoint bundle (step_N directory)")
    export.add_argument("out_dir", type=Path, help="the directory to write (written beside it, then renamed)")
    export.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    evaluate = commands.add_parser("eval", help="a bundle's held-out evaluation ([eval] of CONFIG), as a run makes it")
    evaluate.add_argument("bundle", type=Path, help="a checkpoint bundle (step_N directory)")
    evaluate.add_argument("--config", type=Path, required=True, help="the run's TOML config; its [eval] is used")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                          help="set a config key over the file's (repeatable), as scd run --set does")
    ckpt = commands.add_parser("checkpoint", help="list, verify or inspect checkpoint bundles")
    ckpt_commands = ckpt.add_subparsers(dest="checkpoint_command", required=True)
    ckpt_commands.add_parser("list", help="bundles in a checkpoint directory").add_argument("dir", type=Path)
    ckpt_commands.add_parser("verify", help="verify one bundle offline (exit 0 good, 3 bad)").add_argument(
        "path", type=Path)
    inspect = ckpt_commands.add_parser("inspect", help="summarise one bundle")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transfer_queue", "ray", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def entry() -> None:
    """The ``scd`` command: ``main``, and the process's exit with its code."""
    code = main()
    if AbandonedCalls.count:
        # What scd started is stopped already; a thread stuck in a call it gave up on (a hung TQ) would
        # hold the interpreter's exit for ever.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging()
    try:
        if args.command == "checkpoint":
            return checkpoint_command(args)
        if args.command == "model":
            return model_command(args)
        if args.command == "export":
            from scd.checkpoint.export import export_bundle

            print(export_bundle(args.bundle, args.out_dir, replace=args.force))
            return EXIT_OK
        if args.command == "eval":
            return eval_command(args)
        if args.command == "report":
            from scd.report import write_report

            print(write_report(args.events, args.out))
            return EXIT_OK
        overrides = [*args.overrides, *([f"run.output_dir='{args.output_dir.resolve()}'"] if args.output_dir else [])]
        config = load_config(args.config, overrides)
        # The rewards, a custom sampler, the trackers' packages and the device plan are checked here, before
        # Ray or any engine starts.
        resolve_rewards(config.task, Path(args.config).resolve().parent)
        sampler = build_sampler(config)
        require_tracker_packages(config.telemetry)
        plan_devices(config)
        if args.max_steps is not None and args.max_steps < 1:
            print("scd: error: --max-steps must be >= 1", file=sys.stderr)
            return EXIT_CONFIG
        if args.discard_newer and args.restore_from is None:
            print("scd: error: --discard-newer goes with --restore-from BUNDLE", file=sys.stderr)
            return EXIT_CONFIG
        # Which history the run continues, and whether its bundle can be restored under this config, are
        # settled here, before Ray or any engine starts.
        check_before_start(config, sampler.name, args.restore_from, args.discard_newer, args.allow_config_change)
        anyio.run(run_daemon, config, args, backend="asyncio", backend_options={"use_uvloop": True})
    except BaseException as exc:
        error = _first_scd_error(exc)
        if error is not None:
            _report(error)
            return error.exit_code
        if isinstance(exc, KeyboardInterrupt):
            return EXIT_OK
        if isinstance(exc, SystemExit):
            raise
        log.exception("scd stopped on an unexpected error")
        return EXIT_OTHER
    return EXIT_OK


if __name__ == "__main__":
    entry()
