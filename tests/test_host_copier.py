"""The HostCopier duty: the core takes a backend's copier only if it is a HostCopier, and the
staged buffers send and wait through it; two banks of host twins take the steps in turn,
and none is written while its copy is in flight (a copier that completes only at `wait`)."""

from __future__ import annotations

import random

import pytest
import torch

from xgraph.buffers import BufferSpec, MemcpyCopier, StagedBuffers, _copier, write_prefix
from xgraph.errors import IncompleteBackendError
from xgraph.interfaces import HostCopier
from xgraph.models import Workload


class Recording(HostCopier):
    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self.inner = MemcpyCopier(device, host)
        self.calls: list[tuple[str, int]] = []

    def send(self, nbytes: int) -> None:
        self.calls.append(("send", nbytes))
        self.inner.send(nbytes)

    def wait(self) -> None:
        self.calls.append(("wait", 0))


def test_a_copier_that_is_no_host_copier_is_refused_by_name() -> None:
    dev, host = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(IncompleteBackendError, match="host_copier returned object, not an"):
        _copier(lambda d, h: object(), dev, host)  # type: ignore[arg-type,return-value]


def test_the_backends_copier_is_taken_as_is() -> None:
    dev, host = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    made = Recording(dev, host)
    assert _copier(lambda d, h: made, dev, host) is made


def test_staged_buffers_send_the_written_prefix_and_wait_before_writing() -> None:
    staged = StagedBuffers([BufferSpec("ids", torch.int64, (16,), 0)], torch.device("cpu"))
    recs = [Recording(staged.packed, bank.packed) for bank in staged.banks]
    for bank, rec in zip(staged.banks, recs):
        bank.copier = rec  # the CPU backend's buffers, sent through recording copiers
    bank = staged.begin()
    target = staged.target("ids", (8,))
    write_prefix(target.np, torch.arange(5).numpy(), target.fill)
    staged.send(target.end)
    assert recs[bank].calls == [("wait", 0), ("send", 64)]  # 8 int64 values, the extent
    assert recs[1 - bank].calls == []  # the other bank was neither waited for nor sent
    assert target.device.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


class InFlight(HostCopier):
    """A copy that stays in flight until `wait`: the bytes reach the device then, and the
    bank must not have been written since `send` (what a GPU copy still reading it needs)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor, log: list, name: int) -> None:
        self.device, self.host, self.log, self.name = device, host, log, name
        self.sent: torch.Tensor | None = None

    def send(self, nbytes: int) -> None:
        assert self.sent is None, "a bank sent again before its copy finished"
        self.sent = self.host[:nbytes].clone()
        self.log.append(("send", self.name))

    def wait(self) -> None:
        self.log.append(("wait", self.name))
        if self.sent is not None:
            n = len(self.sent)
            assert torch.equal(self.host[:n], self.sent), "a bank written while in flight"
            self.device[:n] = self.sent  # the copy completes
            self.sent = None


def test_two_banks_take_the_steps_in_turn_and_none_is_written_while_in_flight() -> None:
    w = Workload.tiny(num_blocks=64, max_blocks=6, max_seqs=16)
    ex = w.executor(backend="cpu", buckets=[1, 2, 4, 8])
    staged = ex.planner.staged
    log: list = []
    for i, bank in enumerate(staged.banks):
        bank.copier = InFlight(staged.packed, bank.packed, log, i)
    rng = random.Random(0)
    plans = []
    for b in (3, 1, 8, 2, 5, 8, 4):
        step = w.decode_step(rng, b)
        ex.planner.plan({"input_ids": step.input_ids, "positions": step.positions}, step.attn)
        plans.append(step)
    # each step waits for its own bank's copy of two steps back, never for the other's
    banks = [1, 0] * 4
    expected = [e for k in banks[:7] for e in (("wait", k), ("send", k))]
    assert log == expected
    for bank in (banks[5], banks[6]):  # the last two copies complete, in order
        staged.banks[bank].copier.wait()
    last = plans[-1]
    assert staged["input_ids"][:4].tolist() == last.input_ids.tolist()
    assert staged["seq_lens"][:4].tolist() == list(last.attn.seq_lens)
    ex.close()
