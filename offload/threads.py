"""PyTorch's intra-op threads while a small model decodes on the CPU device.

A decode step of a model with a small hidden size is a long chain of tiny operators (the
embedded model's are 4 x 192 by 192 x 512 products): each takes tens of microseconds on one
core, and a second intra-op thread saves less than it costs to wake and join, since between two
operators the step runs Python and native expert calls long enough for PyTorch's idle threads to
go to sleep. Measured on a 2-vCPU VM, embedded pair, `make demo` setting, ten alternating rounds
in one process: one thread against two gave plain decoding 97.9 / 95.2 tok/s and blocks of 4
112.6 / 92.3 tok/s. Models with a hidden size of ``SMALL_HIDDEN`` or more keep PyTorch's setting.
The threshold is a judgement from these figures, not a crossover measured in the loop: alone, a
bf16 [4, H] x [H, 2H] product gained 17 us from a second thread at H = 512 (78 / 61 us) and 58 us
at H = 1024 (217 / 159 us), against the tens of microseconds a woken thread cost in the loop (a
[4, 192] x [192, 512] product: 24 us alone, 68 us in the loop on two threads). See docs/benchmarks.md.

    with intra_op_threads(decode_threads(rt.device, hidden_size)):
        ...  # the decode loop
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

SMALL_HIDDEN = 1024


def decode_threads(device, hidden_size: int) -> int | None:
    """PyTorch intra-op threads for decoding a model of ``hidden_size`` on ``device``: 1 for a
    small model on the CPU, None (PyTorch's own setting) otherwise."""
    if torch.device(device).type != "cpu" or hidden_size >= SMALL_HIDDEN:
        return None
    return 1


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the body with ``threads`` PyTorch intra-op threads (None: unchanged), restoring the
    previous count afterwards."""
    saved = torch.get_num_threads()
    if threads is None or threads == saved:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
