"""The errors of graphs across ranks, in the XGraphError family.

Every one of them is raised on every rank of the group (each rank learns of the others'
failures through the side group), so no rank is left waiting on a collective that will
never come.
"""

from __future__ import annotations

from ..errors import CaptureError, XGraphError


class DistributedError(XGraphError):
    """The ranks lost each other: a peer died, hangs past the timeout, or is out of lockstep.

    The executor that raised it refuses further steps (its peers cannot be trusted to be at
    the same point any more); close it (its books balance) and restart the process group.
    """


class OutOfStepError(DistributedError):
    """The ranks are not running the same step: their ordinals differ, or the ranks of one
    tensor-parallel group were given different batches (a rank skipped, repeated or
    reordered a call). Raised on every rank before any runs the step; the executor then
    stops, as for any DistributedError.
    """


class PeerStepError(XGraphError):
    """Another rank refused this step (bad inputs, an overflow under on_overflow='raise').

    No rank ran the step, and the ranks are still in lockstep: fix that rank's inputs and go on.
    """


class PeerCaptureError(CaptureError):
    """Another rank's capture of this key failed; this rank rolled its own capture back.

    Every rank then handles the key the same way (on_capture_error: eager from now on, or
    this error raised).
    """


class CollectiveMismatchError(CaptureError):
    """The ranks' forwards issue different collectives (op, group, dtype, shape, reduce op).

    Found before the differing collective is issued, so nothing hangs; raised on every rank
    whatever on_capture_error says (running the key eagerly would hang instead). The message
    names the first collective that differs and each rank's version of it.
    """
