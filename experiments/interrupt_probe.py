"""How `xgraph conformance` ends when Ctrl-C comes at a random moment (CPU; no GPU needed).

    OUT=out python experiments/interrupt_probe.py --runs 30 --max-delay 4

Each run starts `xgraph conformance --backend cpu`, waits for its first line, sends SIGINT
a uniform 0..max-delay seconds later and records the exit status and what stderr said after
the interrupt. A clean end is status 130 with the one line `xgraph: interrupted`; a negative
status is a signal (-11 SIGSEGV, -6 abort). Writes `$OUT/interrupt-probe.json`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time

READY = "xgraph conformance: backend"


def one_run(delay: float, timeout: float) -> dict:
    """One interrupted run: its status and stderr lines after the first line of output."""
    p = subprocess.Popen(
        [sys.executable, "-m", "xgraph.cli", "conformance", "--backend", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "XGRAPH_BACKEND": "cpu"},
    )
    try:
        while True:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if not line or READY in line:
                break
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = [x for x in (err or "").splitlines() if x.strip()]
    return {"delay_s": round(delay, 3), "status": p.returncode, "stderr_tail": lines[-6:]}


def verdict(run: dict) -> str:
    if run["status"] == 130 and run["stderr_tail"] == ["xgraph: interrupted"]:
        return "clean"
    if run["status"] < 0:
        return f"signal {-run['status']}"
    return f"status {run['status']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--max-delay", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.runs):
        run = one_run(rng.uniform(0, args.max_delay), args.timeout)
        run["verdict"] = verdict(run)
        runs.append(run)
        print(f"{i + 1}/{args.runs}: after {run['delay_s']} s: {run['verdict']}", flush=True)
    counts = collections.Counter(r["verdict"] for r in runs)
    print(dict(counts))
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "interrupt-probe.json"), "w") as f:
        json.dump({"args": vars(args), "counts": counts, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
