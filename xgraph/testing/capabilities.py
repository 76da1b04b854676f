"""Declared capabilities of the backend under test (fsspec style: declared, then checked).

A conformance class takes what the backend has from its `capabilities` declaration, never
from the backend itself: the defaults claim what a torch-style device (CUDA through
xgraph.adapter.TorchBackend) has, and an adapter lowers what it lacks in its conformance
subclass::

    class TestMyDev(ConformanceSuite):
        backend_name = "mydev"
        capabilities = Capabilities(linear_kernel=False, reads_launches=False)

`xgraph conformance` takes the same declaration on the command line, after `--`:
`--xgraph-capabilities linear_kernel=no,reads_launches=no`. Each declared value is checked
against the backend before a test uses it: a backend that lacks a capability it did not
lower (or has one it lowered) fails with a message naming the capability, so the suite
never checks less than the backend has, and never by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from xgraph.interfaces import Backend


@dataclass(frozen=True)
class Capabilities:
    """What the backend under test has; the defaults claim what a torch-style device has."""

    #: a VirtualMemory (`Backend.virtual_memory()`); lowered: shared-physical memory refused
    virtual_memory: bool = True
    #: capture pools take their segments from xgraph (`segments_support()`); lowered:
    #: shared-physical memory falls back to shared-pool with one warning
    routes_segments: bool = True
    #: `memory_in_use()` reads the device's memory; lowered: teardown checked by the books
    reports_memory: bool = True
    #: graphs describe what they record (`Graph.keep_launches()`); lowered: the
    #: parameterization check refuses with its documented error
    reads_launches: bool = True
    #: a linear kernel of its own (`kernels().linear`); lowered: `xgraph.linear` is F.linear
    linear_kernel: bool = True

    def lowered(self, *names: str) -> Capabilities:
        """This declaration with `names` declared absent."""
        for name in names:
            _check_name(name)
        return dataclasses.replace(self, **dict.fromkeys(names, False))


NAMES = tuple(f.name for f in dataclasses.fields(Capabilities))
OPTION = "--xgraph-capabilities"


def _reads_launches(backend: Backend) -> bool:
    from xgraph.parameterization import supported

    return supported(backend)


# how each capability reads on the backend: only to check the declaration against it
PROBES: dict[str, Callable[[Backend], bool]] = {
    "virtual_memory": lambda b: b.virtual_memory() is not None,
    "routes_segments": lambda b: b.segments_support().available,
    "reports_memory": lambda b: b.memory_in_use() is not None,
    "reads_launches": _reads_launches,
    "linear_kernel": lambda b: b.kernels().linear is not None,
}

_TRUE, _FALSE = {"yes", "true", "1", "on"}, {"no", "false", "0", "off"}


def _check_name(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown capability {name!r}; the capabilities are {', '.join(NAMES)}.")


def parse(text: str | None) -> dict[str, bool]:
    """`name=yes|no[,name=yes|no ...]` (the command line's declaration) as a mapping."""
    out: dict[str, bool] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        _check_name(name)
        if value not in _TRUE | _FALSE:
            raise ValueError(f"{OPTION}: {item.strip()!r}; write {name}=yes or {name}=no.")
        out[name] = value in _TRUE
    return out


def with_option(capabilities: Capabilities, option: str | None) -> Capabilities:
    """The class's declaration, with what the command line declares on top."""
    return dataclasses.replace(capabilities, **parse(option))


def mismatch(backend: Backend, caps: Capabilities, name: str) -> str | None:
    """Why the declaration of `name` is wrong for this backend, or None when it holds."""
    claimed, actual = getattr(caps, name), PROBES[name](backend)
    if claimed == actual:
        return None
    if claimed:
        return (
            f"capability {name!r}: the conformance class claims it, but backend "
            f"{backend.name!r} lacks it. If the lack is meant, lower it in the conformance "
            f"subclass (capabilities = Capabilities({name}=False), or for `xgraph "
            f"conformance`: -- {OPTION} {name}=no); the suite then checks what the backend "
            "promises instead (docs/conformance.md). Otherwise the backend lost it: fix that."
        )
    return (
        f"capability {name!r}: the conformance class declares it absent, but backend "
        f"{backend.name!r} has it, so the suite would leave it unchecked. Remove the lowering "
        f"(or for `xgraph conformance`: -- {OPTION} {name}=yes)."
    )


def require(backend: Backend, caps: Capabilities, name: str) -> bool:
    """The declared value of `name`, once checked against the backend (fails otherwise)."""
    import pytest

    problem = mismatch(backend, caps, name)
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return bool(getattr(caps, name))


def all_mismatches(backend: Backend, caps: Capabilities) -> list[str]:
    """Every wrong declaration, for one report."""
    return [m for m in (mismatch(backend, caps, n) for n in NAMES) if m is not None]
