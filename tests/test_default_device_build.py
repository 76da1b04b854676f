"""Models and workloads built under a default device that is not the weights' own: the
seeded draws are made on the host (a CPU generator), whatever device torch defaults to."""

from __future__ import annotations

import torch

from xgraph.models.workload import Workload


def _weights(w: Workload) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.model.parameters()]


def test_seeded_draws_under_a_meta_default_device_give_the_same_weights_and_cache():
    plain, under = Workload.tiny(device="cpu"), Workload.tiny(device="cpu")
    plain.model.init_random(7)
    plain.randomize_cache(4)
    # meta stands for an accelerator as the default device: a CPU generator cannot draw
    # there, so a draw that does not name its device fails as it did under cuda
    with torch.device("meta"):
        under.model.init_random(7)
        under.randomize_cache(4)
    for a, b in zip(_weights(plain), _weights(under)):
        assert a.device.type == "cpu" and torch.equal(a, b)
    for a, b in zip(plain.cache.tensors(), under.cache.tensors()):
        assert torch.equal(a, b)
