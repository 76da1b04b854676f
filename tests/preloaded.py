"""`python -c CODE` run in a child forked from a process that imported torch and xgraph once.

Not a test module. multiprocessing's forkserver, preloaded with torch and xgraph, forks the
child: a test of a whole program pays for the program, not for importing torch again
(seconds of CPU time each on a CI machine). The child starts with nothing run but those
imports (no backend chosen, no op run), takes the environment it is given, writes its
stdout and stderr to files of its own and ends with the program's exit status: what the
test reads of it is what a fresh `python -c CODE` gives. A program that needs a fresh
interpreter itself (what is imported, a signal, `multiprocessing` pickling its own
functions) runs in one with `subprocess`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback

_context = None


def _forkserver():  # type: ignore[no-untyped-def]
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "xgraph"])
    return _context


def _child(code: str, env: dict[str, str], out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.argv = ["-c"]
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_code(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -c code` with `env`, forked from the preloaded process (module docstring)."""
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        for path in (out, err):
            open(path, "w").close()
        p = _forkserver().Process(target=_child, args=(code, dict(env), out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(["-c", code], timeout)
        with open(out) as fo, open(err) as fe:
            return subprocess.CompletedProcess(["-c", code], p.exitcode, fo.read(), fe.read())
