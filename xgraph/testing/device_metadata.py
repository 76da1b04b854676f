"""Conformance of device-resident attention metadata through every runner of the backend.

Engines keep sequence lengths, block tables and slot mappings on the device and pass them
as device tensors (docs/executor.md, "Device metadata"). Every runner the backend offers
(the core's reference runners, its `kernels().attention`, and the opt-in runners its
conformance subclass declares in `attention_runners`) runs the same steps twice, over
equal workloads: once given device metadata, once host metadata, and the outputs and the
KV cache must be equal. Decode runners serve full graphs (and a step above the largest
bucket, eager); prefill runners serve piecewise steps. On a backend whose device is the
host, host tensors are taken as device-resident (the planner's `cpu_is_device`), so the
device path runs there too; a bad value in a full graph's device metadata is found on the
device and raised by `synchronize()`, not at the call.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from xgraph.errors import InputError
from xgraph.interfaces import AttentionRunner, Backend
from xgraph.metadata import AttentionInputs
from xgraph.runners import reference_runners

from .base import BackendTests, tiny_workload

FULL_BUCKETS = [1, 2, 4, 8]
PIECEWISE_BUCKETS = [8, 16, 32]
DECODE_BATCHES = [3, 1, 8, 5, 2, 11]  # 11: above the largest bucket, eager
COMPOSITIONS = [([5, 9], [2, 0]), ([1, 1, 1], [6, 9, 2]), ([16, 16], [0, 4]), ([20, 1], [1, 3])]


@dataclass(frozen=True)
class RunnerCase:
    """One attention runner the suite runs device metadata through."""

    name: str
    role: str  # "decode": full graphs (and eager above the buckets); "prefill": piecewise
    make: Callable[[Backend], AttentionRunner]  # a fresh runner (one per executor)
    workload: Mapping[str, Any] = field(default_factory=dict)  # Workload.tiny's arguments


def on_device(attn: AttentionInputs, w: Any, device: torch.device) -> AttentionInputs:
    """The step's metadata as an engine keeps it: int32 lengths and tables, int64 slots."""
    return AttentionInputs(
        list(attn.query_lens),
        torch.tensor(list(attn.seq_lens), dtype=torch.int32).to(device),
        attn.table(w.cache.dummy_block, w.max_blocks).to(device),
        torch.as_tensor(attn.slot_mapping, dtype=torch.int64).to(device),
    )


class DeviceMetadataTests(BackendTests):
    """Device metadata gives what host metadata gives, through every runner offered."""

    def attention_runners(self, backend: Backend) -> list[RunnerCase]:
        """The runners to check: the reference ones and the backend's `kernels()`. An
        adapter with opt-in runners (not in `kernels()`) adds them, with the workload
        arguments they need (a dtype, a block size)."""
        cases = [RunnerCase(f"reference {r}", r, _reference(r)) for r in ("decode", "prefill")]
        for role, runner in backend.kernels().attention.items():
            cases.append(RunnerCase(f"{type(runner).__name__} (kernels)", role, _kernel(role)))
        return cases

    def metadata_executor(self, backend: Backend, w: Any, case: RunnerCase, device: bool) -> Any:
        from xgraph import Buckets

        decode = case.role == "decode"
        runner = case.make(backend)
        attention = w.attention(**{f"{case.role}_runner": runner})
        buckets = Buckets(FULL_BUCKETS if decode else PIECEWISE_BUCKETS)
        ex = w.executor(backend=backend, buckets=buckets, attention=attention)
        # on a host device host tensors are the device's: take them as device-resident
        ex.planner.attn_check.cpu_is_device = device and backend.device.type == "cpu"
        return ex

    def check_metadata_runner(self, backend: Backend, case: RunnerCase) -> None:
        ws = [tiny_workload(backend, **{**_LAYOUT, **case.workload}) for _ in range(2)]
        for w in ws:
            w.randomize_cache(8)
        dex, hex_ = (self.metadata_executor(backend, w, case, on) for w, on in zip(ws, (1, 0)))
        rng = random.Random(8)
        decode = case.role == "decode"
        if decode:
            steps = [ws[0].decode_step(rng, n) for n in DECODE_BATCHES]
        else:
            steps = [ws[0].prefill_step(rng, q, extra) for q, extra in COMPOSITIONS]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the step above the buckets is warned of
                for step in steps:
                    kw = {"input_ids": step.input_ids, "positions": step.positions}
                    out = dex(attn=on_device(step.attn, ws[0], backend.device), **kw)
                    self.assert_matches(backend, out, hex_(attn=step.attn, **kw))
                    for a, b in zip(*(w.cache.tensors() for w in ws)):
                        self.assert_matches(backend, a, b)
            assert dex.stats()["hits"] == hex_.stats()["hits"]
            if decode:
                self.check_found_on_the_device(backend, dex, ws[0], rng)
        finally:
            dex.close()
            hex_.close()

    def check_found_on_the_device(self, backend: Backend, ex: Any, w: Any, rng: Any) -> None:
        """A bad slot in a full graph's device metadata: the call returns, synchronize()
        names it (host metadata would be refused at the call)."""
        step = w.decode_step(rng, 3)
        attn = on_device(step.attn, w, backend.device)
        attn.slot_mapping[1] = -3
        ex(input_ids=step.input_ids, positions=step.positions, attn=attn)
        with pytest.raises(InputError, match=r"slot_mapping\[1\] = -3"):
            ex.synchronize()

    @pytest.mark.parametrize("role", ["decode", "prefill"])
    def test_device_metadata_equals_host_metadata_through_every_runner(
        self, backend: Backend, role: str
    ) -> None:
        """Every runner of the role is run; the failures are reported together, by name."""
        cases = [c for c in self.attention_runners(backend) if c.role == role]
        assert cases, f"no {role} runner to check"
        failed = {}
        for case in cases:
            try:
                self.check_metadata_runner(backend, case)
            except Exception as exc:  # the other runners still run
                failed[case.name] = f"{type(exc).__name__}: {exc}"
        assert not failed, f"device metadata through {role} runners: {failed}"


_LAYOUT = {"num_blocks": 96, "max_blocks": 10, "max_seqs": 16}


def _reference(role: str) -> Callable[[Backend], AttentionRunner]:
    return lambda backend: reference_runners()[role]


def _kernel(role: str) -> Callable[[Backend], AttentionRunner]:
    return lambda backend: backend.kernels().attention[role]
