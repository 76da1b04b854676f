"""`xgraph` command line: info, demo, conformance, bench.

Errors print as one line (`xgraph: error: ...`, exit status 2); `-v` logs at INFO level and
shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
from collections.abc import Sequence

WIDTH = 100


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
    infos = xgraph.list_backends(refresh=True, hidden=args.all)
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
        argv = ["-p", "xgraph.testing.plugin", *argv]
    print(f"xgraph conformance: backend {backend.name!r} ({backend.device})", flush=True)
    return int(pytest.main(argv))


def _pytest_plugin_autoloaded() -> bool:
    from importlib import metadata

    return any(
        ep.value == "xgraph.testing.plugin" for ep in metadata.entry_points(group="pytest11")
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xgraph", description=__doc__.splitlines()[0])
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at INFO level and show tracebacks of unexpected errors",
    )
    sub = p.add_subparsers(dest="command", required=True)
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

    from .bench import add_parsers
    from .integrations.transformers.cli import add_parser as add_generate_parser

    add_parsers(sub)
    add_generate_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import XGraphError

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except XGraphError as exc:
        if args.verbose:
            raise
        print(f"xgraph: error: {exc}", file=sys.stderr)
    except (ValueError, OSError) as exc:
        if args.verbose:
            raise
        print(
            f"xgraph: error: {type(exc).__name__}: {exc} (run with -v for the traceback)",
            file=sys.stderr,
        )
    return 2


if __name__ == "__main__":
    sys.exit(main())
