"""Experts computed on the CPU by a family's own expert kernel (PyTorch), from the host store.

    runner = TorchCpuExperts(host, kernel, hidden)  # kernel: the family's ExpertKernel, CPU dtype
    y = runner.run(layer, expert, x_rows)           # x_rows [n, H] on the host -> [n, H] float32

The CPU side of hybrid execution where the native kernel (native/pf_cpu.c) cannot compute a
family's experts (Qwen3-MoE: an activation other than SiLU, no native library;
``PDFLASH_QWEN3_NATIVE=0``): the expert's packed host row is read in place (FP8 blocks
dequantized on use) and run through the same ``weights`` / ``apply`` as the device path, so its
results are the device path's on a CPU device, bit for bit. Its accounting and interface are
offload/cpu_compute.CpuRunner's, which the runtime, offload/experts.py and the placement cost model use. PyTorch's own intra-op
threads compute (``torch.get_num_threads()``).
"""

from __future__ import annotations

import torch

from pdflash.offload.cpu_compute import CpuRunner


class TorchCpuExperts(CpuRunner):
    level = "torch"

    def __init__(self, host, kernel, hidden: int):
        super().__init__(host)
        self.hidden = hidden
        self.kernel = kernel
        self.threads = torch.get_num_threads()
        self.calibration_dtype = kernel.dtype

    def _compute(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        row = self.host.row(layer, expert)[None]  # [1, expert_bytes], a view of the pinned store
        w = self.kernel.weights(row, [0])
        return self.kernel.apply(w, 0, x.to(self.kernel.dtype)).float()
