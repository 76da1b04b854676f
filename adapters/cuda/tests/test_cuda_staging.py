"""The CUDA HostCopier (GPU only): prefixes arrive byte for byte, in stream order, from any
thread; `wait` returns only once the copy has read the host buffer."""

from __future__ import annotations

import threading

import pytest
import torch

from xgraph.buffers import TorchCopier


@pytest.fixture
def pair(backend):  # type: ignore[no-untyped-def]
    device = torch.zeros(1 << 20, dtype=torch.uint8, device=backend.device)
    host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
    return backend, device, host


def test_the_backend_offers_the_driver_copier(pair, monkeypatch):
    backend, device, host = pair
    from xgraph_cuda.staging import DriverCopier

    assert isinstance(backend.host_copier(device, host), DriverCopier)
    monkeypatch.setenv("XGRAPH_CUDA_STAGING", "torch")
    assert backend.host_copier(device, host) is None
    monkeypatch.setenv("XGRAPH_CUDA_STAGING", "fast")
    with pytest.raises(Exception, match="choose 'driver'"):
        backend.host_copier(device, host)


@pytest.mark.parametrize("kind", ["driver", "torch"])
def test_prefixes_arrive_in_stream_order(pair, kind):
    backend, device, host = pair
    copier = backend.host_copier(device, host) if kind == "driver" else TorchCopier(device, host)
    for i, n in enumerate([7, 4096, 1 << 20, 64]):
        copier.wait()
        host[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        # a long kernel queued first: the copy must not overtake it on the stream
        torch.cuda._sleep(1_000_000)
        copier.send(n)
        device[:n].add_(1)  # runs after the copy on the same stream
        copier.wait()
        expected = host[:n].to(torch.int16).add(1).remainder(256).to(torch.uint8)
        assert torch.equal(device[:n].cpu(), expected), f"copy {i} of {n} bytes"


def test_a_fresh_thread_can_send(pair):
    backend, device, host = pair
    copier = backend.host_copier(device, host)
    host[:256] = 9
    errors: list[BaseException] = []

    def send() -> None:
        try:
            copier.send(256)
            copier.wait()
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    t = threading.Thread(target=send)
    t.start()
    t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert torch.equal(device[:256].cpu(), torch.full((256,), 9, dtype=torch.uint8))
