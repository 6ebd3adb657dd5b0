"""Warm-up of the eager decode path: each distinct linear shape once per length, nothing else."""

import torch
import torch.nn.functional as F
from torch import nn

from pdflash.offload.warmup import warm_linears


def test_each_distinct_linear_runs_once_per_length(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8, bias=False), nn.Embedding(10, 8))
    calls = []
    real = F.linear

    def counting(x, w, b=None):
        calls.append((tuple(x.shape), tuple(w.shape), b is not None))
        return real(x, w, b)

    monkeypatch.setattr(F, "linear", counting)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = warm_linears([model], [1, 4, 4, 0])
    assert seconds >= 0
    assert sorted(calls) == sorted([((1, t, 8), (16, 8), True) for t in (1, 4)] + [((1, t, 16), (8, 16), False) for t in (1, 4)])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
