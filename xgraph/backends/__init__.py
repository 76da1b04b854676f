"""Backends built into the core distribution (the CPU reference backend)."""
