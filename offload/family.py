"""What the offload runtime needs from a model family, and the registry of families.

A family adapter (``gpt_oss.py`` today; Qwen3-MoE or Mixtral would be one more
file plus one line in ``FAMILIES``) knows:

- which config.json it accepts (``matches``),
- every tensor a checkpoint must hold, with shapes (``tensor_specs``), and which of
  them are the experts of a layer in stored format (``expert_sources``),
- the packed byte layout of one expert (``expert_layout``) and the expert maths
  (``expert_kernel``),
- how to build the library's own model on the meta device, load the non-expert
  weights onto the device and swap each layer's experts module (``build``),
- the router of a layer, for lookahead prediction (``router_topk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from pdflash import PdflashError

FLOAT_DTYPES = ("BF16", "F16", "F32")  # safetensors dtype names allowed for dense tensors

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F64": torch.float64,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the checkpoint must contain."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # allowed safetensors dtype names
    expert: bool = False  # part of the offloaded experts (read into the host store)


class ExpertKernel(Protocol):
    """The expert maths of one family, on packed slots."""

    dtype: torch.dtype

    def weights(self, slots: torch.Tensor, slot_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """Stacked compute-dtype weights of the experts in ``slot_ids`` (rows of ``slots``)."""

    def apply(self, weights: tuple[torch.Tensor, ...], i: int, x: torch.Tensor) -> torch.Tensor:
        """Output of the i-th expert of ``weights`` for its tokens x [n, H] -> [n, H]."""

    def fused(self, device: torch.device):
        """A fused path for small token counts on ``device`` (gpt_oss: mxfp4_triton.FusedMxfp4Experts), or None."""


class ModelFamily:
    """Base class of family adapters; see the module docstring."""

    name = "?"

    def __init__(self, config: dict):
        self.raw_config = config

    @classmethod
    def matches(cls, config: dict) -> bool:
        raise NotImplementedError

    # -- checkpoint ------------------------------------------------------------------
    num_layers: int
    num_experts: int
    top_k: int
    quantized: bool

    def tensor_specs(self) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def expert_sources(self, layer: int) -> dict[str, str]:
        """{piece name: checkpoint tensor name} of one layer's stacked expert tensors [E, ...]."""
        raise NotImplementedError

    def expert_layout(self, stored_dtypes: dict[str, torch.dtype]):
        raise NotImplementedError

    # -- model -----------------------------------------------------------------------
    def build(
        self,
        device: torch.device,
        dtype: torch.dtype,
        load: Callable[[str], torch.Tensor],
        make_experts: Callable[[int, nn.Module], nn.Module],
    ) -> nn.Module:
        raise NotImplementedError

    def expert_kernel(self, layout, dtype: torch.dtype, alpha: float, limit: float) -> ExpertKernel:
        """The expert maths in ``dtype``; alpha / limit are the original experts module's constants."""
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def router_topk(self, model: nn.Module, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Experts layer ``layer`` would route ``hidden`` [T, H] (a residual-stream state) to: [T, top_k]."""
        raise NotImplementedError

    def cache_kwarg(self, model: nn.Module) -> str:
        """Name of the KV-cache keyword of the model's forward (it changed across transformers versions)."""
        raise NotImplementedError


def _families() -> list[type[ModelFamily]]:
    from pdflash.offload.gpt_oss import GptOssFamily

    return [GptOssFamily]


def find_family(config: dict, where: str) -> ModelFamily:
    """The adapter for a config.json dict, or a PdflashError naming what is unsupported."""
    for fam in _families():
        if fam.matches(config):
            return fam(config)
    arch = config.get("architectures")
    mtype = config.get("model_type")
    supported = ", ".join(f.name for f in _families())
    raise PdflashError(
        f"{where}: unsupported model (model_type={mtype!r}, architectures={arch!r}); pdflash supports: {supported}"
    )
