"""Experts computed on the CPU by a family's own expert kernel (PyTorch), from the host store.

    runner = TorchCpuExperts(host, kernel, hidden)  # kernel: the family's ExpertKernel, CPU dtype
    y = runner.run(layer, expert, x_rows)           # x_rows [n, H] on the host -> [n, H] float32

The CPU side of hybrid execution for a family the native kernel (native/pf_cpu.c, gpt-oss's
clamped SwiGLU) does not compute: the expert's packed host row is read in place (FP8 blocks
dequantized on use) and run through the same ``weights`` / ``apply`` as the device path, so its
results are the device path's on a CPU device, bit for bit. It has the interface of
offload/cpu_compute.CpuExpertRunner (run, seconds_for, calibrate, stats, reset_stats, close)
that the runtime, offload/experts.py and the placement cost model use. PyTorch's own intra-op
threads compute (``torch.get_num_threads()``).
"""

from __future__ import annotations

import time

import torch

_EWMA = 0.2  # weight of the newest measurement in the kept rate


class TorchCpuExperts:
    def __init__(self, host, kernel, hidden: int):
        self.host = host
        self.hidden = hidden
        self.layout = host.layout
        self.kernel = kernel
        self.threads = torch.get_num_threads()
        self.level = "torch"
        self.expert_bytes = self.layout.payload_bytes  # what one call reads from the weights
        self.rate_bps: float | None = None  # weight bytes per second, kept current (EWMA)
        self.experts = 0
        self.tokens = 0
        self.seconds = 0.0

    def _compute(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        row = self.host.row(layer, expert)[None]  # [1, expert_bytes], a view of the pinned store
        w = self.kernel.weights(row, [0])
        return self.kernel.apply(w, 0, x.to(self.kernel.dtype)).float()

    def run(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] on the host -> the expert's output [n, H] float32 (no routing weight)."""
        t0 = time.perf_counter()
        y = self._compute(layer, expert, x)
        dt = time.perf_counter() - t0
        self.experts += 1
        self.tokens += x.shape[0]
        self.seconds += dt
        if dt > 0:
            r = self.expert_bytes / dt  # small token counts: one read of the weights per call
            self.rate_bps = r if self.rate_bps is None else (1 - _EWMA) * self.rate_bps + _EWMA * r
        return y

    def seconds_for(self, tokens: int) -> float | None:
        """Predicted seconds to compute one expert for ``tokens`` tokens (None before any measurement)."""
        if not self.rate_bps:
            return None
        return self.expert_bytes / self.rate_bps

    def calibrate(self, repeats: int = 3) -> float:
        """Time a few one-token calls on real experts (not counted in the statistics); returns bytes/s."""
        x = torch.zeros((1, self.hidden), dtype=self.kernel.dtype)
        n = self.host.num_layers * self.host.num_experts
        best = None
        for i in range(max(1, repeats)):
            r = (i * 7919) % n
            layer, expert = r // self.host.num_experts, r % self.host.num_experts
            t0 = time.perf_counter()
            self._compute(layer, expert, x)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        self.rate_bps = self.expert_bytes / max(best, 1e-9)
        return self.rate_bps

    def stats(self) -> dict:
        return {
            "threads": self.threads,
            "level": self.level,
            "experts": self.experts,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "gbps": self.rate_bps / 1e9 if self.rate_bps else None,
        }

    def reset_stats(self) -> None:
        self.experts = 0
        self.tokens = 0
        self.seconds = 0.0

    def close(self) -> None:
        pass
