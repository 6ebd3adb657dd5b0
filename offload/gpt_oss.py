"""gpt-oss family adapter: checkpoint tensors, expert layout and maths, model build.

Shape legend: L = layers, E = experts per layer, K = experts per token (top-k),
H = hidden size, I = expert intermediate size, G = H/32 or I/32 (MXFP4 groups).

Checkpoint expert tensors of layer N (``model.layers.N.mlp.experts.``):
  bf16 / f32:  gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]
  MXFP4:       gate_up_proj_blocks u8 [E, 2I, G, 16], gate_up_proj_scales u8 [E, 2I, G], gate_up_proj_bias,
               down_proj_blocks u8 [E, H, G, 16], down_proj_scales u8 [E, H, G], down_proj_bias
The model itself is transformers' GptOssForCausalLM (attention with sinks and
sliding window, RMSNorm, YaRN rotary, router, KV cache); only each layer's
``mlp.experts`` instance is replaced.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.offload import attn_triton
from pdflash.offload.family import FLOAT_DTYPES, ExpertSource, ModelFamily, TensorSpec
from pdflash.offload.host_store import ExpertLayout
from pdflash.offload.mxfp4 import dequantize, dequantize_rows

FP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # RMS of a uniform random E2M1 code

_EXPERT_PREFIX = "model.layers.{}.mlp.experts."


def expert_pieces(hidden: int, inter: int, quantized: bool) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """Per-expert pieces in stored format, in packing order: (name, shape, allowed dtypes)."""
    H, I = hidden, inter
    u8 = ("U8",)
    if quantized:
        return [
            ("gate_up_proj_blocks", (2 * I, H // 32, 16), u8),
            ("gate_up_proj_scales", (2 * I, H // 32), u8),
            ("gate_up_proj_bias", (2 * I,), FLOAT_DTYPES),
            ("down_proj_blocks", (H, I // 32, 16), u8),
            ("down_proj_scales", (H, I // 32), u8),
            ("down_proj_bias", (H,), FLOAT_DTYPES),
        ]
    return [
        ("gate_up_proj", (H, 2 * I), FLOAT_DTYPES),
        ("gate_up_proj_bias", (2 * I,), FLOAT_DTYPES),
        ("down_proj", (I, H), FLOAT_DTYPES),
        ("down_proj_bias", (H,), FLOAT_DTYPES),
    ]


def mxfp4_expert_layout(hidden: int, inter: int, bias_dtype: torch.dtype = torch.bfloat16) -> ExpertLayout:
    """The packed slot layout of one MXFP4 gpt-oss expert of this size (biases in ``bias_dtype``)."""
    spec = [(name, shape, torch.uint8 if dts == ("U8",) else bias_dtype) for name, shape, dts in expert_pieces(hidden, inter, True)]
    return ExpertLayout.build(spec, quantized=True)


# config.json fields that must be positive integers when present
_POSITIVE_FIELDS = ("num_hidden_layers", "num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


class GptOssFamily(ModelFamily):
    name = "gpt_oss (GptOssForCausalLM)"
    model_type = "gpt_oss"

    @classmethod
    def matches(cls, config: dict) -> bool:
        archs = config.get("architectures") or ["GptOssForCausalLM"]
        return config.get("model_type") == "gpt_oss" and "GptOssForCausalLM" in archs

    def __init__(self, config: dict):
        super().__init__(config)
        from transformers import GptOssConfig

        for key in _POSITIVE_FIELDS:
            v = config.get(key)
            if key in config and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise PdflashError(f"config.json: {key} must be a positive integer, got {v!r}; the config is damaged: "
                                   "restore it from the checkpoint's source")
        clean = {k: v for k, v in config.items() if k != "quantization_config"}
        try:
            self.hf_config = GptOssConfig.from_dict(clean)
        except Exception as exc:  # transformers validates field types and values
            why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
            raise PdflashError(f"config.json is not a valid gpt_oss config: {why}") from None
        c = self.hf_config
        quant = config.get("quantization_config") or {}
        method = quant.get("quant_method")
        if method not in (None, "mxfp4"):
            raise PdflashError(f"config.json: quantization {method!r} is not supported; pdflash reads bf16/fp32 or mxfp4 experts")
        self.quantized = method == "mxfp4"
        self.expert_format = "mxfp4" if self.quantized else "dense"
        self.num_layers = int(c.num_hidden_layers)
        self.num_experts = int(c.num_local_experts)
        self.top_k = int(c.num_experts_per_tok)
        self.hidden = int(c.hidden_size)
        self.inter = int(c.intermediate_size)
        if self.quantized and (self.hidden % 32 or self.inter % 32):
            raise PdflashError("config.json: MXFP4 experts need hidden_size and intermediate_size divisible by 32")
        if not 0 < self.top_k <= self.num_experts:
            raise PdflashError(f"config.json: num_experts_per_tok={self.top_k} must be in [1, num_local_experts={self.num_experts}]")

    @classmethod
    def synthetic_config(cls, preset, special_ids: dict[str, int], *, dtype: str = "bfloat16", quant: str | None = None) -> dict:
        """config.json of a GptOssForCausalLM checkpoint of ``preset``'s shape (MXFP4 experts with quant="mxfp4")."""
        ids = special_ids
        cfg = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "attention_dropout": 0.0,
            "bos_token_id": ids["<|startoftext|>"],
            "eos_token_id": ids["<|return|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "experts_per_token": preset.num_experts_per_tok,
            "head_dim": preset.head_dim,
            "hidden_act": "silu",
            "hidden_size": preset.hidden_size,
            "initial_context_length": preset.rope_scaling.get("original_max_position_embeddings", 4096),
            "initializer_range": 0.02,
            "intermediate_size": preset.intermediate_size,
            "layer_types": list(preset.layer_types),
            "max_position_embeddings": preset.max_position_embeddings,
            "num_attention_heads": preset.num_attention_heads,
            "num_experts_per_tok": preset.num_experts_per_tok,
            "num_hidden_layers": preset.num_hidden_layers,
            "num_key_value_heads": preset.num_key_value_heads,
            "num_local_experts": preset.num_local_experts,
            "output_router_logits": False,
            "rms_norm_eps": preset.rms_norm_eps,
            "rope_scaling": dict(preset.rope_scaling) or None,
            "rope_theta": preset.rope_theta,
            "router_aux_loss_coef": 0.9,
            "sliding_window": preset.sliding_window,
            "swiglu_limit": preset.swiglu_limit,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "use_cache": True,
            "vocab_size": preset.vocab_size,
        }
        if quant == "mxfp4":
            cfg["quantization_config"] = {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
                "quant_method": "mxfp4",
            }
        return cfg

    # -- checkpoint ------------------------------------------------------------------
    def tensor_specs(self) -> dict[str, TensorSpec]:
        c = self.hf_config
        H, E, V = self.hidden, self.num_experts, int(c.vocab_size)
        hd = int(c.head_dim or H // c.num_attention_heads)
        nq, nkv = int(c.num_attention_heads) * hd, int(c.num_key_value_heads) * hd
        f = FLOAT_DTYPES
        specs = {"model.embed_tokens.weight": TensorSpec((V, H), f), "model.norm.weight": TensorSpec((H,), f)}
        if not c.tie_word_embeddings:
            specs["lm_head.weight"] = TensorSpec((V, H), f)
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            specs[p + "input_layernorm.weight"] = TensorSpec((H,), f)
            specs[p + "post_attention_layernorm.weight"] = TensorSpec((H,), f)
            for proj, out_f, in_f in (("q_proj", nq, H), ("k_proj", nkv, H), ("v_proj", nkv, H), ("o_proj", H, nq)):
                specs[p + f"self_attn.{proj}.weight"] = TensorSpec((out_f, in_f), f)
                if c.attention_bias:
                    specs[p + f"self_attn.{proj}.bias"] = TensorSpec((out_f,), f)
            specs[p + "self_attn.sinks"] = TensorSpec((int(c.num_attention_heads),), f)
            specs[p + "mlp.router.weight"] = TensorSpec((E, H), f)
            specs[p + "mlp.router.bias"] = TensorSpec((E,), f)
            for piece, shape, dt in self._expert_piece_shapes():
                specs[_EXPERT_PREFIX.format(n) + piece] = TensorSpec((E, *shape), dt, expert=True)
        return specs

    def _expert_piece_shapes(self) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
        return expert_pieces(self.hidden, self.inter, self.quantized)

    def expert_sources(self, layer: int) -> dict[str, ExpertSource]:
        """Every piece is one stacked [E, ...] tensor."""
        return {piece: ExpertSource(stacked=_EXPERT_PREFIX.format(layer) + piece) for piece, _, _ in self._expert_piece_shapes()}

    def expert_layout(self, stored_dtypes: dict[str, torch.dtype]) -> ExpertLayout:
        spec = [(piece, shape, stored_dtypes[piece]) for piece, shape, _ in self._expert_piece_shapes()]
        return ExpertLayout.build(spec, quantized=self.quantized)

    def init_rule(self, name: str, preset) -> tuple[str, float, float]:
        H, I = preset.hidden_size, preset.intermediate_size
        if name.endswith("_blocks"):
            return "bytes", 0.0, 0.0
        if name.endswith("_scales"):  # power-of-two scale so the weight std is about 1/sqrt(fan_in)
            fan_in = H if "gate_up" in name else I
            return "scales", 127 + round(math.log2(1.0 / (math.sqrt(fan_in) * FP4_RMS))), 0.0
        if "layernorm" in name or name == "model.norm.weight":
            return "normal", 1.0, 0.1
        if name == "model.embed_tokens.weight" or name.endswith("sinks"):
            return "normal", 0.0, 1.0
        if name.endswith("router.weight"):
            return "normal", 0.0, preset.router_logit_std / math.sqrt(H)
        if name.endswith("router.bias"):
            return "normal", 0.0, 0.1
        if name.endswith("bias"):
            return "normal", 0.0, 0.02
        if name.endswith("experts.down_proj"):
            return "normal", 0.0, 1.0 / math.sqrt(I)
        if name.endswith("o_proj.weight"):
            return "normal", 0.0, 1.0 / math.sqrt(preset.num_attention_heads * preset.head_dim)
        return "normal", 0.0, 1.0 / math.sqrt(H)  # q/k/v, lm_head, gate_up

    # -- model -----------------------------------------------------------------------
    def build(
        self,
        device: torch.device,
        dtype: torch.dtype,
        load: Callable[[str], torch.Tensor],
        make_experts: Callable[[int, nn.Module], nn.Module],
    ) -> nn.Module:
        """GptOssForCausalLM built on meta, experts swapped, other weights loaded onto ``device``."""
        import copy

        from transformers import GptOssForCausalLM

        cfg = copy.deepcopy(self.hf_config)
        cfg._attn_implementation = "eager"  # sinks need the eager path; it runs on CPU and CUDA
        with torch.device("meta"):
            model = GptOssForCausalLM(cfg)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts = make_experts(i, layer.mlp.experts)  # instance swap, class untouched

        # Every weight in the compute dtype, as transformers 5.x from_pretrained(dtype=...) loads them.
        state = {name: load(name).to(device=device, dtype=dtype) for name, spec in self.tensor_specs().items() if not spec.expert}
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise PdflashError(f"internal: weights did not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return finish_loaded_model(model, device)

    def expert_kernel(self, layout: ExpertLayout, dtype: torch.dtype, original: nn.Module) -> "GptOssExpertKernel":
        alpha, limit = _swiglu_constants(original)
        return GptOssExpertKernel(layout, dtype, alpha, limit)

    def cpu_unsupported_reason(self, layout: ExpertLayout, dtype: torch.dtype) -> str | None:
        from pdflash.offload.cpu_compute import unsupported_reason

        return unsupported_reason(layout, dtype)

    native_cpu_experts = True

    def cpu_runner(self, host, original: nn.Module, threads: int | None, dtype: torch.dtype):
        from pdflash.offload.cpu_compute import CpuExpertRunner

        alpha, limit = _swiglu_constants(original)
        return CpuExpertRunner(host, alpha, limit, threads=threads, dtype=dtype)

    def library_class(self) -> type[nn.Module]:
        from transformers import GptOssForCausalLM

        return GptOssForCausalLM

    def reference_load_kwargs(self) -> dict:
        if not self.quantized:
            return {}
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}

    def library_expert_state(self, load: Callable[[str], torch.Tensor], layer: int, device: torch.device,
                             dtype: torch.dtype, dequant_device: torch.device) -> dict[str, torch.Tensor]:
        """The four GptOssExperts parameters of one layer, in transformers' layout, on ``device``:
        gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H].
        MXFP4 blocks [E, out, in/32, 16] + scales [E, out, in/32] are dequantized on ``dequant_device``."""
        src = {piece: s.stacked for piece, s in self.expert_sources(layer).items()}
        prefix = _EXPERT_PREFIX.format(layer)
        out = {}
        for proj in ("gate_up_proj", "down_proj"):
            if self.quantized:
                blocks = load(src[f"{proj}_blocks"]).to(dequant_device)
                scales = load(src[f"{proj}_scales"]).to(dequant_device)
                w = dequantize(blocks, scales, dtype)  # [E, in, out]
                del blocks, scales
            else:
                w = load(src[proj]).to(dequant_device, dtype)
            out[prefix + proj] = w.to(device)
            out[prefix + proj + "_bias"] = load(src[f"{proj}_bias"]).to(device, dtype)
        return out

    def router(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.router

    def pre_experts(self, layer: nn.Module, x: torch.Tensor, position_embeddings, mask, cache, cache_kw: str):
        """The library's modules (ModelFamily.pre_experts), or for a short step over the graphed
        decoder's static cache the same maths in fused kernels (attn_triton.py)."""
        if not attn_triton.supports(layer, x, position_embeddings, mask, cache):
            return super().pre_experts(layer, x, position_embeddings, mask, cache, cache_kw)
        a = attn_triton.rms_norm(layer.input_layernorm, x)
        a = attn_triton.attention(layer.self_attn, a, position_embeddings, mask, cache)
        x, m = attn_triton.rms_norm(layer.post_attention_layernorm, x, add=a)
        flat = m.reshape(-1, m.shape[-1])
        scores, indices = self.route(layer, flat)
        return x, flat, scores, indices

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """gpt-oss routes to the top-k router logits (softmax over the k afterwards)."""
        return torch.topk(logits, self.top_k, dim=-1).indices


def _swiglu_constants(original: nn.Module) -> tuple[float, float]:
    """gpt-oss's clamped SwiGLU constants (alpha, limit) of the library's experts module."""
    return float(getattr(original, "alpha", 1.702)), float(getattr(original, "limit", 7.0))


class GptOssExpertKernel:
    """gpt-oss expert maths on packed slots, written to match transformers' GptOssExperts.

    For tokens x [n, H] of one expert:
      gate_up = x @ W1 + b1                       W1 [H, 2I], gate = even columns, up = odd
      gate = min(gate, limit); up = clamp(up, -limit, limit)
      y = ((up + 1) * gate * sigmoid(alpha * gate)) @ W2 + b2    W2 [I, H]
    Same operations in the same order and dtype as the library, so results are bit-identical.

    Weight layout: on the CPU, W1 / W2 are contiguous [in, out] like the library's parameters
    (matmul results depend on the operand layout, and the CPU path must match bit for bit);
    on CUDA MXFP4 weights stay in their stored [out, in] row order and the matmuls take the
    transposed view (cuBLAS reads either layout at the same speed, one copy fewer).
    """

    def __init__(self, layout: ExpertLayout, dtype: torch.dtype, alpha: float, limit: float, rows_layout: bool | None = None):
        self.layout = layout
        self.dtype = dtype
        self.alpha = alpha
        self.limit = limit
        self.rows_layout = rows_layout  # None: [out, in] rows on CUDA, [in, out] elsewhere
        self._fused: dict[str, object] = {}

    def fused(self, device: torch.device):
        """The fused MXFP4 kernels (mxfp4_triton.py) for small token counts on ``device``, or None
        where they cannot run (no Triton, a CPU without Triton's interpreter, dense experts,
        float16). PDFLASH_FUSED_EXPERTS=0 turns them off."""
        key = str(device)
        if key not in self._fused:
            from pdflash.offload import mxfp4_triton

            ok = self.layout.quantized and self.dtype in (torch.bfloat16, torch.float32) and mxfp4_triton.available(device)
            self._fused[key] = mxfp4_triton.FusedMxfp4Experts(self.layout, self.alpha, self.limit) if ok else None
        return self._fused[key]

    def weights(self, slots: torch.Tensor, slot_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """(W1 [n, H, 2I], b1 [n, 2I], W2 [n, I, H], b2 [n, H]) in the compute dtype.

        The selected slot rows are gathered in one copy (none for a single expert); every
        piece is then a view of them, and MXFP4 pieces are dequantized for all n at once.
        """
        lay, dt = self.layout, self.dtype
        if len(slot_ids) == 1:
            rows = slots[slot_ids[0] : slot_ids[0] + 1]
        else:
            rows = slots.index_select(0, torch.tensor(slot_ids, dtype=torch.long).to(slots.device, non_blocking=True))
        v = lambda name: lay.view(rows, name)  # noqa: E731
        if lay.quantized:
            rows_layout = slots.device.type == "cuda" if self.rows_layout is None else self.rows_layout
            if rows_layout:  # [n, out, in] rows, used through transposed views
                w1 = dequantize_rows(v("gate_up_proj_blocks"), v("gate_up_proj_scales"), dt).transpose(1, 2)
                w2 = dequantize_rows(v("down_proj_blocks"), v("down_proj_scales"), dt).transpose(1, 2)
            else:
                w1 = dequantize(v("gate_up_proj_blocks"), v("gate_up_proj_scales"), dt)
                w2 = dequantize(v("down_proj_blocks"), v("down_proj_scales"), dt)
        else:
            w1 = v("gate_up_proj").to(dt)
            w2 = v("down_proj").to(dt)
        return w1, v("gate_up_proj_bias").to(dt), w2, v("down_proj_bias").to(dt)

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return (up + 1) * glu

    def apply(self, weights: tuple[torch.Tensor, ...], i: int, x: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = weights
        gate_up = x @ w1[i] + b1[i]  # [n, 2I]
        return self._glu(gate_up) @ w2[i] + b2[i]  # [n, H]

    def apply_batched(self, weights: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """Every expert in one batched matmul, x [n_exp, m, H] -> [n_exp, m, H]. Not used by the
        runtime: on CUDA its bf16 results depend on how many experts are batched together
        (benchmarks/check_fused_gpu.py measures that against ``apply`` and the fused kernels)."""
        w1, b1, w2, b2 = weights
        gate_up = torch.bmm(x, w1) + b1[:, None, :]  # [n_exp, m, 2I]
        return torch.bmm(self._glu(gate_up), w2) + b2[:, None, :]  # [n_exp, m, H]


def finish_loaded_model(model: nn.Module, device: torch.device, source: str = "the checkpoint") -> nn.Module:
    """Last step of loading a GptOssForCausalLM built on the meta device with ``assign=True``:
    tie the head if the config says so, rebuild the non-persistent rotary buffers on ``device``,
    check that nothing is still on meta, and put the model in inference mode."""
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_meta:
            raise PdflashError(f"internal: {name} was not loaded from {source}")
    model.requires_grad_(False)
    model.eval()
    return model
