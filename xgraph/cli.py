"""`xgraph` command line: info, demo, conformance, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def cmd_info(args: argparse.Namespace) -> int:
    import xgraph

    infos = xgraph.list_backends(refresh=True)
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
    rows = [
        [
            b.name,
            "yes" if b.available else "no",
            str(b.priority),
            b.reason,
            ", ".join(f"{k} {v}" for k, v in b.versions.items()),
        ]
        for b in infos
    ]
    print(f"xgraph {xgraph.__version__}")
    print(_table(rows, ["backend", "available", "priority", "reason", "versions"]))
    try:
        chosen = xgraph.get_backend(args.backend).name
        print(f"\nselected: {chosen} (argument > XGRAPH_BACKEND > highest priority available)")
    except xgraph.XGraphError as exc:
        print(f"\nselected: none: {exc}")
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.backend)


def cmd_conformance(args: argparse.Namespace) -> int:
    import pytest

    import xgraph

    try:
        backend = xgraph.get_backend(args.backend)
    except xgraph.XGraphError as exc:
        print(f"xgraph conformance: {exc}", file=sys.stderr)
        return 2
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
    p = argparse.ArgumentParser(prog="xgraph", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="list backends: availability, priority, reason, versions")
    info.add_argument("--json", action="store_true")
    info.add_argument("--backend", default=None)
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="capture and replay a small model on the best backend")
    demo.add_argument("--backend", default=None)
    demo.set_defaults(func=cmd_demo)

    conf = sub.add_parser(
        "conformance", help="run the conformance suite against a backend (pytest args after --)"
    )
    conf.add_argument("--backend", required=True)
    conf.add_argument("pytest_args", nargs=argparse.REMAINDER)
    conf.set_defaults(func=cmd_conformance)

    from .bench import add_parsers

    add_parsers(sub)

    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
