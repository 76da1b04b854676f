"""`xgraph` command line: info, demo, conformance, check, bench, generate.

A mistake prints one line and exits with status 2: a bad option as `xgraph <command>: error:
...`, an error of the library as `xgraph: error: ...`. Ctrl-C prints `xgraph: interrupted`
and exits with status 130. `-v` (anywhere on the line) logs at INFO level and prints the
traceback before the error line. A warning of xgraph is shown once, as a log line. Only the
chosen command imports what it needs (torch.compile, transformers, matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import textwrap
import threading
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from .plugins import list_backends

WIDTH = 100
PYTEST_PLUGIN = "pytest_xgraph"  # the pytest11 entry point's module


def _info_rows(infos: list) -> list[str]:  # type: ignore[type-arg]
    """One entry per backend: a line of name / available / priority, the reason wrapped
    under it, then its versions: everything within WIDTH columns."""
    lines = []
    for b in infos:
        head = f"{b.name:<17} {'yes' if b.available else 'no':<4} priority {b.priority:<4}"
        lines.append(head.rstrip())
        for text in (b.reason, ", ".join(f"{k} {v}" for k, v in b.versions.items())):
            if text:
                lines += textwrap.wrap(text, WIDTH, initial_indent="    ", subsequent_indent="    ")
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    import xgraph

    chosen = xgraph.get_backend(args.backend).name  # first: a chosen hidden one is listed
    infos = list_backends(refresh=True, hidden=args.all)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": b.name,
                        "available": b.available,
                        "priority": b.priority,
                        "reason": b.reason,
                        "versions": b.versions,
                        "plugin": b.plugin,
                    }
                    for b in infos
                ],
                indent=2,
            )
        )
        return 0
    print(f"xgraph {xgraph.__version__}: backends (highest priority first)")
    print("\n".join(_info_rows(infos)))
    print(f"\nselected: {chosen} (argument > XGRAPH_BACKEND > highest priority available)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.backend)


def cmd_conformance(args: argparse.Namespace) -> int:
    import pytest

    import xgraph

    backend = xgraph.get_backend(args.backend)
    extra = list(args.pytest_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    argv = [
        "--pyargs",
        "xgraph.testing.test_conformance",
        "--xgraph-backend",
        backend.name,
        "-p",
        "no:cacheprovider",
        *extra,
    ]
    if not _pytest_plugin_autoloaded():
        argv = ["-p", PYTEST_PLUGIN, *argv]
    print(f"xgraph conformance: backend {backend.name!r} ({backend.device})", flush=True)
    with _noting_interrupts() as interrupted:
        try:
            code = pytest.main(argv)
        except Exception:
            if interrupted:  # a Ctrl-C in pytest's start-up can surface as its own error
                raise KeyboardInterrupt from None
            raise
    if code == pytest.ExitCode.INTERRUPTED or interrupted:  # pytest caught the Ctrl-C
        raise KeyboardInterrupt
    return int(code)


@contextlib.contextmanager
def _noting_interrupts() -> Iterator[list[bool]]:
    """A list that holds True once a Ctrl-C arrived in the block (which still raises
    KeyboardInterrupt as before); off the main thread, where no handler can be set, empty."""
    seen: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return

    def note(signum: int, frame: Any) -> None:
        seen.append(True)
        signal.default_int_handler(signum, frame)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield seen
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _quiet_finalizer_interrupts() -> Iterator[None]:
    """A Ctrl-C that lands in a finalizer or `__del__` is not raised but printed as an
    "Exception ignored" traceback, and the command runs on; `_noting_interrupts` has noted it
    and `main` exits with the one line and 130, so the traceback is left out."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def cmd_check(args: argparse.Namespace) -> int:
    from .check_cli import run_check

    return run_check(args)


def add_check_parser(sub: Any, backend_help: str) -> None:
    """`xgraph check`: the parameterization check of a model (xgraph.check_cli)."""
    from .check_cli import DTYPES, REFERENCE
    from .cli_types import positive_int, sizes

    p = sub.add_parser(
        "check",
        help="capture a model's graphs under changed sequence lengths, block tables and batch "
        "composition and name every launch that follows them (exit status 1 if any does)",
    )
    p.add_argument("--backend", default=None, help=backend_help)
    p.add_argument(
        "--model",
        default="tiny",
        help=f"a reference model shape ({', '.join(REFERENCE)}; random weights) or a local "
        "transformers model folder (needs the transformers extra)",
    )
    p.add_argument(
        "--kind",
        default="both",
        choices=["both", "full", "piecewise"],
        help="graph kinds to check (both: decode full graphs and piecewise prefill)",
    )
    p.add_argument(
        "--sizes", default=None, type=sizes, help="bucket sizes to check, such as 4,64 (default 4)"
    )
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="weights and cache dtype")
    p.add_argument("--block-size", type=positive_int, default=16, help="KV cache block size")
    p.add_argument(
        "--pdl-replays",
        type=int,
        default=200,
        help="PDL race check: pairs of replays per decode bucket, with PDL against without "
        "(backends with programmatic dependent launch; 0 skips it)",
    )
    p.set_defaults(func=cmd_check)


def _pytest_plugin_autoloaded() -> bool:
    from importlib import metadata

    return any(ep.value == PYTEST_PLUGIN for ep in metadata.entry_points(group="pytest11"))


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version_text() -> str:
    """xgraph's version, then each installed adapter's (from its metadata: no adapter code
    runs) and torch's."""
    from importlib import metadata

    from . import __version__
    from .hooks import ENTRY_POINT_GROUP

    lines = [f"xgraph {__version__}"]
    adapters: dict[str, str] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None:
            adapters[ep.dist.name] = ep.dist.version
    lines += [f"{name} {version}" for name, version in sorted(adapters.items())]
    with contextlib.suppress(metadata.PackageNotFoundError):
        lines.append(f"torch {metadata.version('torch')}")
    return "\n".join(lines)


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS)
        self.help = kwargs.get("help")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_text())
        parser.exit()


def _add_verbose(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="log at INFO level and print the traceback of an error",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="xgraph", description=__doc__.splitlines()[0])
    _add_verbose(p, False)
    p.add_argument(
        "--version", action=_Version, help="print the versions of xgraph, its adapters and torch"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    backend_help = "backend name (default: XGRAPH_BACKEND, else the best available one)"

    info = sub.add_parser("info", help="list backends: availability, priority, reason, versions")
    info.add_argument("--json", action="store_true", help="print the list as JSON")
    info.add_argument(
        "--all", action="store_true", help="also list hidden backends (test adapters, simulators)"
    )
    info.add_argument("--backend", default=None, help=backend_help)
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="capture and replay a small model on the best backend")
    demo.add_argument("--backend", default=None, help=backend_help)
    demo.set_defaults(func=cmd_demo)

    conf = sub.add_parser(
        "conformance", help="run the conformance suite against a backend (pytest args after --)"
    )
    conf.add_argument("--backend", required=True, help="the backend to check")
    conf.add_argument(
        "pytest_args", nargs=argparse.REMAINDER, help="arguments for pytest, after --"
    )
    conf.set_defaults(func=cmd_conformance)
    add_check_parser(sub, backend_help)

    from .bench.cli import add_parsers

    # importing the integration also registers its bench families (hf-llama) in xgraph.bench
    from .integrations.transformers.cli import add_parser as add_generate_parser

    add_parsers(sub)
    add_generate_parser(sub)
    for command in sub.choices.values():  # -v after the command too; absent, the top one holds
        _add_verbose(command, argparse.SUPPRESS)
    return p


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


class _ShownOnce(logging.Filter):
    """Drops a warning line already shown: xgraph warns (warnings.warn) and logs the same
    text, for programs that watch only one of the two; the command line shows it once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


@contextlib.contextmanager
def _output(verbose: bool) -> Iterator[None]:
    """Log lines on stderr (INFO with -v, else WARNING); an XGraphWarning becomes a log line,
    shown once with the log line the library writes for it. Undone on return."""
    from .errors import XGraphWarning

    root = logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ShownOnce())
    level, shown = root.level, warnings.showwarning

    def show(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if issubclass(category, XGraphWarning):
            logging.getLogger("xgraph").warning("%s", message)
        else:
            shown(message, category, *args, **kwargs)

    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
        root.setLevel(level)
        root.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import XGraphError

    parser = build_parser()
    args = parser.parse_args(argv)
    check = getattr(args, "check", None)  # a command's own check of its options together
    problem = check(args) if check is not None else None
    if problem:
        _command_parser(parser, args.command).error(problem)
    verbose = bool(args.verbose)
    try:
        with _output(verbose), _noting_interrupts() as interrupted, _quiet_finalizer_interrupts():
            code = int(args.func(args) or 0)
        if interrupted:  # a Ctrl-C raised inside a finalizer, which Python swallows
            raise KeyboardInterrupt
        return code
    except KeyboardInterrupt as exc:
        if argv is None:  # the process's own command line: the exit follows
            _ignore_interrupts()
        if verbose:
            traceback.print_exception(exc)
        print("xgraph: interrupted", file=sys.stderr)
        return 130
    except XGraphError as exc:  # the library's own errors say what to do
        _error(exc, verbose, _one_line(str(exc)))
        return 2
    except (ValueError, OSError) as exc:  # a bad value or path from the user, met deeper down
        _error(exc, verbose, f"{type(exc).__name__}: {_first_line(exc)}", hint=True)
        return 2
    except Exception as exc:  # not a mistake of the user's: exit status 1
        _error(exc, verbose, f"unexpected {type(exc).__name__}: {_first_line(exc)}", hint=True)
        return 1


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:500] if lines else ""


def _error(exc: BaseException, verbose: bool, text: str, hint: bool = False) -> None:
    """One line on stderr; with -v, the traceback first."""
    if verbose:
        traceback.print_exception(exc)
    elif hint:
        text += " (run with -v for the traceback)"
    print(f"xgraph: error: {text}", file=sys.stderr)


def _ignore_interrupts() -> None:
    """After the first Ctrl-C only the exit is left: a second one, or one still pending from
    a library that caught the first (pytest does), would end the process by the signal
    (status -2) in the middle of the cleanup instead of with the one line and 130."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
