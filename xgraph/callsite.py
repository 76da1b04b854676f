"""Warnings that point at the engine's line: the first frame outside xgraph.

An executor warns from a few calls deep (a step, a pre-capture, an idle step, under one
rank or several), so a fixed `stacklevel` would name a different line on each path. The
frames are walked instead, on the warning path only.
"""

from __future__ import annotations

import os
import sys
import warnings

from .errors import XGraphWarning

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _inside(filename: str) -> bool:
    """xgraph's own frames, and the context managers and frozen modules between them."""
    return (
        filename.startswith(_PACKAGE)
        or filename.endswith("contextlib.py")
        or (filename.startswith("<frozen"))
    )


def warn_at_caller(message: str) -> None:
    """warnings.warn(message, XGraphWarning) attributed to the caller of xgraph."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame.f_back is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, XGraphWarning, stacklevel=level)
