"""The executor's choices as enums: each is checked once, where it enters, with one message.

Members are strings too (`Mode.AUTO == "auto"`), so configuration files and keyword
arguments may keep passing the plain names; graph keys and stats use the plain values.
"""

from __future__ import annotations

import os
from enum import Enum
from typing import TypeVar

from .errors import XGraphError

_C = TypeVar("_C", bound="Choice")
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")


def switch(given: bool | None, name: str, env: str, default: bool = False) -> bool:
    """An on/off option: `given` as passed, or, for None, the environment variable `env`
    (1 / true / on / yes; 0 / false / off / no; unset or empty: `default`)."""
    unset = "on" if default else "off"
    if given is not None:
        if not isinstance(given, bool):
            raise XGraphError(
                f"{name}={given!r}: pass True, False or None (None: {env} decides; unset, {unset})."
            )
        return given
    value = os.environ.get(env, "").strip().lower()
    if value == "":
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise XGraphError(f"{env}={value!r}: set it to 1 (on) or 0 (off), or unset it ({unset}).")


class Choice(str, Enum):
    """A string enum; `parse` turns a name into a member or an XGraphError naming the choices."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def parse(cls: type[_C], value: object, what: str) -> _C:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise XGraphError(f"{what}={value!r}: choose one of {names}.") from None


class Mode(Choice):
    """Which steps run through graphs."""

    AUTO = "auto"  # decode -> full graph, other batches -> piecewise
    FULL = "full"  # full graphs for decode, other batches eagerly
    PIECEWISE = "piecewise"  # every step piecewise
    EAGER = "eager"  # no graphs


class Kind(Choice):
    """How one step runs."""

    FULL = "full"  # one graph for the whole forward (attention recorded inside)
    PIECEWISE = "piecewise"  # captured pieces, attention run between them
    EAGER = "eager"  # no graph


class Fallback(Choice):
    """What to do with a step a graph cannot serve (above the buckets, or a failed capture)."""

    EAGER = "eager"  # run it eagerly (warned or logged once)
    RAISE = "raise"  # raise the error


class MemoryMode(Choice):
    """Which native pool each capture allocates from (see xgraph.memory)."""

    PRIVATE = "private"
    SHARED_POOL = "shared-pool"
    SHARED_PHYSICAL = "shared-physical"
