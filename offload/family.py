"""What the offload runtime needs from a model family, and the registry of families.

A family adapter (``gpt_oss.py``, ``qwen3_moe.py``; one more family is one more file plus one
line in ``_families``) is the only place that knows a family. Generic offload, cache, prefetch,
speculative and bench code asks it for:

- config: which config.json it accepts (``matches``), the shapes it reads from it, and the
  config.json of a synthetic checkpoint of a preset (``synthetic_config``);
- checkpoint: every tensor a checkpoint must hold, with shapes (``tensor_specs``), and where
  each packed expert piece comes from (``expert_sources``: one stacked ``[E, ...]`` tensor, or
  per-expert tensors concatenated along dim 0), plus the seeded init rule of each tensor for
  synthetic checkpoints (``init_rule``);
- experts: the packed byte layout of one expert (``expert_layout``) and the expert maths with
  its activation and constants (``expert_kernel``), and the native CPU path where the family
  has one (``cpu_unsupported_reason`` / ``cpu_runner``);
- routing: the router module of a decoder layer (``router``: scores and indices as the
  library's MoE block passes them to its experts), its linear (``router_linear``) and how
  logits become the top-k experts (``select``) for route-ahead and lookahead prediction;
- the model: building the library's own model on the meta device with each layer's experts
  swapped (``build``), the decoder layers, the graphed "everything before the experts" segment
  (``pre_experts``: attention with its masks, the post-attention norm, the router) and the
  attention kind of each layer (``layer_types`` / ``sliding_window``).

``family_of(model)`` finds the adapter of a loaded transformers model (draft taps and
route-ahead work on plain transformers targets as well as on the offloaded runtime).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
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
    "F8_E4M3": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the checkpoint must contain."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]  # allowed safetensors dtype names
    expert: bool = False  # part of the offloaded experts (read into the host store)


@dataclass(frozen=True)
class ExpertSource:
    """Where one packed expert piece of a layer is stored in a checkpoint.

    ``stacked``: one tensor [E, *piece shape] holds the piece of every expert (gpt-oss).
    ``per_expert``: for expert e, the tensors ``per_expert[e]`` concatenated along dim 0 make the
    piece (Qwen3-MoE: ``experts.{e}.gate_proj.weight`` and ``experts.{e}.up_proj.weight`` make
    one [2I, H] gate_up piece, so one expert stays one contiguous row).
    """

    stacked: str | None = None
    per_expert: tuple[tuple[str, ...], ...] = ()

    def first_name(self) -> str:
        return self.stacked if self.stacked is not None else self.per_expert[0][0]

    def names(self) -> list[str]:
        return [self.stacked] if self.stacked is not None else [n for names in self.per_expert for n in names]


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
    """Base class of family adapters; see the module docstring.

    The shared parts assume transformers' decoder-layer structure, which every supported family
    has: ``model.model.layers[i]`` with ``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm`` and ``mlp.experts``; the router module differs (``router``).
    """

    name = "?"
    model_type = "?"  # config.json model_type
    expert_format = "dense"  # what stats() reports for quantized experts: "mxfp4", "fp8", ...

    def __init__(self, config: dict):
        self.raw_config = config

    @classmethod
    def matches(cls, config: dict) -> bool:
        raise NotImplementedError

    # -- config ----------------------------------------------------------------------
    num_layers: int
    num_experts: int
    top_k: int
    quantized: bool
    hidden: int
    inter: int  # expert intermediate size

    @classmethod
    def synthetic_config(cls, preset, special_ids: dict[str, int], *, dtype: str = "bfloat16", quant: str | None = None) -> dict:
        """config.json of a synthetic checkpoint of ``preset`` (offload/config.py) in this family.
        ``quant``: None (dense), or the family's quantized expert format ("mxfp4", "fp8")."""
        raise NotImplementedError

    # -- checkpoint ------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def expert_sources(self, layer: int) -> dict[str, ExpertSource]:
        """{packed piece name: where it is stored} for one layer's experts."""
        raise NotImplementedError

    def expert_layout(self, stored_dtypes: dict[str, torch.dtype]):
        raise NotImplementedError

    def init_rule(self, name: str, preset) -> tuple[str, float, float]:
        """(kind, mean, std) of a synthetic tensor: kind 'normal', 'bytes' (random bytes), 'scales'
        (E8M0 exponents around ``mean``) or 'fp8' (normal values stored as float8_e4m3fn)."""
        raise NotImplementedError

    # -- experts ---------------------------------------------------------------------
    def expert_kernel(self, layout, dtype: torch.dtype, original: nn.Module) -> ExpertKernel:
        """The expert maths in ``dtype``; ``original`` is the library's experts module being
        replaced (its constants, e.g. gpt-oss's alpha and limit, are read from it)."""
        raise NotImplementedError

    # Whether cpu_runner is the native kernel (offload/cpu_compute.py's CpuExpertRunner), which
    # the CPU device also uses to compute the cache's experts in place from their slot rows.
    native_cpu_experts = False

    def cpu_unsupported_reason(self, layout, dtype: torch.dtype) -> str | None:
        """Why the native CPU expert kernel cannot compute this family's experts (None: it can)."""
        return f"the native CPU expert kernel does not compute {self.name} experts"

    def cpu_runner(self, host, original: nn.Module, threads: int | None, dtype: torch.dtype):
        """The native CPU kernel over the host store (offload/cpu_compute.py), for hybrid execution."""
        raise PdflashError(self.cpu_unsupported_reason(host.layout, dtype) or "no CPU expert kernel")

    # -- model -----------------------------------------------------------------------
    def build(
        self,
        device: torch.device,
        dtype: torch.dtype,
        load: Callable[[str], torch.Tensor],
        make_experts: Callable[[int, nn.Module], nn.Module],
    ) -> nn.Module:
        raise NotImplementedError

    attn_implementation = "eager"  # transformers attention path of the model build() makes
    reference_attn_implementation = "eager"  # what transformers' from_pretrained picks (speed references)

    def library_class(self) -> type[nn.Module]:
        """transformers' causal-LM class of this family."""
        raise NotImplementedError

    def reference_load_kwargs(self) -> dict:
        """Extra from_pretrained arguments of the all-resident transformers reference: quantized
        experts dequantized by transformers itself (its own converter)."""
        return {}

    def dense_tensor(self, load: Callable[[str], torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """A non-expert checkpoint tensor as the library's parameter in ``dtype`` (quantized ones
        dequantized), or None for a tensor that is not a parameter (a quantization scale)."""
        return load(name).to(dtype)

    def library_expert_state(self, load: Callable[[str], torch.Tensor], layer: int, device: torch.device,
                             dtype: torch.dtype, dequant_device: torch.device) -> dict[str, torch.Tensor]:
        """One layer's parameters of the library's own experts module, {state-dict name: tensor on
        ``device``} (the all-resident transformers reference of the benchmarks)."""
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def cache_kwarg(self, model: nn.Module) -> str:
        """Name of the KV-cache keyword of the model's forward (it changed across transformers versions)."""
        params = inspect.signature(model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def layer_types(self, config) -> list[str]:
        """Attention kind of each decoder layer: "full_attention" or "sliding_attention"."""
        types = getattr(config, "layer_types", None)
        return list(types) if types else ["full_attention"] * int(config.num_hidden_layers)

    def sliding_window(self, config) -> int:
        """Window of the sliding-attention layers (0: none)."""
        return int(getattr(config, "sliding_window", None) or 0)

    # -- routing ---------------------------------------------------------------------
    def router(self, layer: nn.Module) -> nn.Module:
        """The router module of a decoder layer: router(x [T, H]) -> (logits, scores [T, K], indices [T, K])."""
        raise NotImplementedError

    def router_linear(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [E, H], bias [E] or None) of a decoder layer's router."""
        r = self.router(layer)
        return r.weight, getattr(r, "bias", None)

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """Router logits [..., E] -> the experts chosen [..., K], in the router's order."""
        raise NotImplementedError

    def route(self, layer: nn.Module, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, K], expert indices [T, K]) of a decoder layer for its normed MLP
        input ``flat`` [T, H], exactly as the library's MoE block computes them."""
        out = self.router(layer)(flat)
        return out[-2], out[-1]

    def router_topk(self, model: nn.Module, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Experts layer ``layer`` would route ``hidden`` [T, H] (a residual-stream state) to: [T, top_k]."""
        block = self.decoder_layers(model)[layer]
        x = block.post_attention_layernorm(hidden)
        weight, bias = self.router_linear(block)
        return self.select(F.linear(x, weight, bias))  # [T, K]

    def pre_experts(self, layer: nn.Module, x: torch.Tensor, position_embeddings, mask, cache, cache_kw: str):
        """A decoder layer up to its experts (the graphed segment, graphs.py): returns (residual
        after attention [1, T, H], normed MLP input [T, H], routing weights [T, K], indices [T, K])."""
        a = layer.input_layernorm(x)
        a, _ = layer.self_attn(hidden_states=a, position_embeddings=position_embeddings, attention_mask=mask,
                               **{cache_kw: cache})
        x = x + a
        m = layer.post_attention_layernorm(x)
        flat = m.reshape(-1, m.shape[-1])
        scores, indices = self.route(layer, flat)
        return x, flat, scores, indices


def _families() -> list[type[ModelFamily]]:
    from pdflash.offload.gpt_oss import GptOssFamily
    from pdflash.offload.qwen3_moe import Qwen3MoeFamily

    return [GptOssFamily, Qwen3MoeFamily]


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


def family_class(model_type: str) -> type[ModelFamily]:
    """The adapter class of a config.json model_type ("gpt_oss", "qwen3_moe")."""
    for fam in _families():
        if fam.model_type == model_type:
            return fam
    raise PdflashError(f"unknown model family {model_type!r}: choose one of {', '.join(f.model_type for f in _families())}")


def family_of(model: nn.Module) -> ModelFamily:
    """The adapter of a loaded transformers model (or the offloaded runtime's model), kept on the model."""
    fam = getattr(model, "_pdflash_family", None)
    if fam is None:
        cfg = model.config.to_dict()
        fam = find_family(cfg, "the target model")
        try:
            model._pdflash_family = fam
        except (AttributeError, TypeError):
            pass
    return fam
