"""Warm-up of the eager (un-graphed) decode path, run before the prompt.

The first matrix product of a new shape pays for the CPU library's setup of that shape (on the
embedded model, 2-4 ms of a 6-12 ms forward). Decoding meets a few shapes only: one token per step
in plain decoding, 1 .. B tokens per verify block in speculative decoding. Running each distinct
linear layer once on zeros of every such length before the prompt moves that setup out of the
decode steps, for both modes alike. Nothing else is touched: no KV cache, no experts, no
statistics (the experts are not linear modules of the model).
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn


@torch.inference_mode()
def warm_linears(modules: Iterable[nn.Module], lengths: Iterable[int]) -> float:
    """Run every distinct (shape, dtype, bias) nn.Linear of ``modules`` on zeros [1, T, in] for
    each T in ``lengths``; returns the seconds it took."""
    t0 = time.perf_counter()
    lengths = sorted(set(int(t) for t in lengths if int(t) > 0))
    seen: set[tuple] = set()
    for root in modules:
        for mod in root.modules():
            if not isinstance(mod, nn.Linear) or mod.weight.is_meta:
                continue
            key = (tuple(mod.weight.shape), mod.weight.dtype, mod.weight.device, mod.bias is not None)
            if key in seen:
                continue
            seen.add(key)
            for t in lengths:
                F.linear(mod.weight.new_zeros((1, t, mod.in_features)), mod.weight, mod.bias)
    return time.perf_counter() - t0
