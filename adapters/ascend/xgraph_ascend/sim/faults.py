"""Fault injection for the simulated runtime: the core simulator's (any ACL call by name)."""

from xgraph.testing.sim import Faults

__all__ = ["Faults"]
