"""The HostCopier duty: the core takes a backend's copier only if it is a HostCopier, and the
staged buffers send and wait through it (checked on the CPU backend's memcpy copier)."""

from __future__ import annotations

import pytest
import torch

from xgraph.buffers import BufferSpec, MemcpyCopier, StagedBuffers, _copier, write_prefix
from xgraph.errors import IncompleteBackendError
from xgraph.interfaces import HostCopier


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
    rec = Recording(staged.packed, staged.host_packed)
    staged._copier = rec  # the CPU backend's buffers, sent through a recording copier
    staged.begin()
    target = staged.target("ids", (8,))
    write_prefix(target.np, torch.arange(5).numpy(), target.fill)
    staged.send(target.end)
    assert rec.calls == [("wait", 0), ("send", 64)]  # 8 int64 values, the extent written
    assert target.device.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
