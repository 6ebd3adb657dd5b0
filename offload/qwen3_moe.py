"""Qwen3-MoE family adapter (transformers' Qwen3MoeForCausalLM): Qwen3-30B-A3B, Qwen3-Coder-30B-A3B.

Shape legend: L = layers, E = experts per layer, K = experts per token (top-k),
H = hidden size, I = expert intermediate size (``moe_intermediate_size``), b = FP8 block.

Checkpoint expert tensors of layer N, expert e (``model.layers.N.mlp.experts.e.``), each stored
separately:
  bf16 / f32:  gate_proj.weight [I, H], up_proj.weight [I, H], down_proj.weight [H, I]
  FP8:         the same weights as float8_e4m3fn, each with weight_scale_inv [I/b, H/b] or [H/b, I/b]
               (float32 or bf16, one scale per b x b block: w = fp8 * scale_inv)
In the host store one expert is one packed row: ``gate_up_proj`` [2I, H] (gate rows, then up
rows, exactly transformers' fused parameter), ``down_proj`` [H, I], and for FP8 their scale grids
(``gate_up_proj_scale_inv`` [2I/b, H/b], ``down_proj_scale_inv`` [H/b, I/b]): an FP8 expert is
half the bytes of a bf16 one. FP8 checkpoints also store the attention projections in FP8; they
are dequantized once at load, like transformers does on a machine without FP8 kernels.

Routing (the library's Qwen3MoeTopKRouter, ``mlp.gate``): softmax over the router logits in
float32, top-k, renormalised to sum 1 when ``norm_topk_prob``; no router bias. Experts:
y = (silu(x Wg^T) * (x Wu^T)) Wd^T. Attention: GQA with RMS-normed queries and keys (qk-norm).
"""

from __future__ import annotations

import copy
import math
import os
import re
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdflash import PdflashError
from pdflash.offload.family import FLOAT_DTYPES, ExpertSource, ModelFamily, TensorSpec
from pdflash.offload.host_store import ExpertLayout

_EXPERT = "model.layers.{}.mlp.experts.{}."
_FP8 = ("F8_E4M3",)
_SCALE_DTYPES = ("F32", "BF16")
FP8_STD = 16.0  # std of the stored FP8 values of synthetic checkpoints (e4m3 reaches 448)


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
    """Block-quantised FP8 weights [..., R, C] with scales [..., R/br, C/bc] -> ``dtype``.

    Each b x b block is multiplied by its scale in float32 and the product rounded once to
    ``dtype``, the arithmetic of transformers' FP8 dequantization (Fp8Dequantize). On a CPU tensor
    the codes are widened by :func:`_fp8_over_256` and scaled in place. With ``scratch`` the weights
    go one at a time (one per leading index) through this thread's int16 and float32 buffers, kept
    from call to call at one weight's size (an expert's dequantization on every use: fresh buffers
    of that size cost their page faults each time, on a 2-core VM more than the arithmetic). The
    result is always a tensor of its own."""
    R, C = w.shape[-2:]
    sr, sc = scale_inv.shape[-2:]
    if R % sr or C % sc:
        raise PdflashError(f"FP8 weight {tuple(w.shape)} is not divisible into the scale grid {tuple(scale_inv.shape)}")
    br, bc = R // sr, C // sc
    lead = w.shape[:-2]
    s = scale_inv.to(torch.float32).reshape(*lead, sr, 1, sc, 1)
    if w.device.type != "cpu":
        q = w.to(torch.float32).reshape(*lead, sr, br, sc, bc) * s
        return q.to(dtype).reshape(*lead, R, C)
    s = s * 256.0  # the codes' values come x 2^-8 (_fp8_over_256): powers of two, the same products
    if not scratch:
        return _fp8_over_256(w).reshape(*lead, sr, br, sc, bc).mul_(s).to(dtype).reshape(*lead, R, C)
    out = torch.empty(w.shape, dtype=dtype)
    ws, ss, outs = w.reshape(-1, R, C), s.reshape(-1, sr, 1, sc, 1), out.view(-1, R, C)
    for i in range(ws.shape[0]):  # one weight at a time: the scratch stays one weight's size
        q = _fp8_over_256(ws[i], _SCRATCH.take(R * C)).view(sr, br, sc, bc).mul_(ss[i])
        outs[i].copy_(q.view(R, C))
    return out


class _Scratch(threading.local):
    """One thread's int16 and float32 buffers for :func:`_fp8_over_256`, grown to the largest
    single weight asked for (an expert's gate_up: 12 MB of float32 for Qwen3-30B-A3B)."""

    def __init__(self) -> None:
        self.h = torch.empty(0, dtype=torch.int16)
        self.q = torch.empty(0, dtype=torch.float32)

    def take(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.h.numel() < n:
            with torch.inference_mode(False):  # normal tensors: written in place inside inference mode or not
                self.h, self.q = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.float32)
        return self.h[:n], self.q[:n]


_SCRATCH = _Scratch()


def fp8_to_float32(w: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly as ``w.to(torch.float32)``, in a few vector passes.

    PyTorch converts float8 on the CPU one element at a time (about 7 ms for a Qwen3-30B-A3B
    expert's gate_up); see :func:`_fp8_over_256` for how this does it."""
    return _fp8_over_256(w).mul_(256.0)


def _fp8_over_256(w: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """float8_e4m3fn -> float32 values times 2^-8, exactly. Each code becomes a float16 bit pattern
    worth exactly 2^-8 of its value: e4m3's 3 mantissa bits as float16's top 3, its exponent as
    float16's (bias 7 against 15: the 2^-8), its subnormals float16 subnormals of the same scale;
    i.e. the sign-extended byte shifted left by 7 with bit 14 cleared; float16 -> float32 is exact.
    e4m3fn's two NaN codes (0x7F, 0xFF: the largest byte as int8 and as uint8) would come out as
    +-1.875; where one is present, they are put back as NaN. ``work``: flat int16 and float32
    buffers of w.numel() elements to compute in (the float32 one, viewed in w's shape, is
    returned); None: fresh ones."""
    b, u = w.view(torch.int8), w.view(torch.uint8)
    if work is None:
        h = b.to(torch.int16)
    else:
        h = work[0].view(w.shape).copy_(b)
    h.bitwise_left_shift_(7).bitwise_and_(-16385)  # clear bit 14 (0x4000): the sign's extension
    if work is None:
        q = h.view(torch.float16).to(torch.float32)
    else:
        q = work[1].view(w.shape).copy_(h.view(torch.float16))
    if q.numel() and (int(b.max()) == 127 or int(u.max()) == 255):
        q.masked_fill_(u.bitwise_and(0x7F) == 0x7F, float("nan"))
    return q


class Qwen3MoeFamily(ModelFamily):
    name = "qwen3_moe (Qwen3MoeForCausalLM)"
    model_type = "qwen3_moe"
    attn_implementation = "eager"  # see build()
    reference_attn_implementation = "sdpa"

    @classmethod
    def matches(cls, config: dict) -> bool:
        archs = config.get("architectures") or ["Qwen3MoeForCausalLM"]
        return config.get("model_type") == "qwen3_moe" and "Qwen3MoeForCausalLM" in archs

    def __init__(self, config: dict):
        super().__init__(config)
        from transformers import Qwen3MoeConfig

        clean = {k: v for k, v in config.items() if k != "quantization_config"}
        try:
            self.hf_config = Qwen3MoeConfig.from_dict(clean)
        except Exception as exc:  # transformers validates field types and values
            raise PdflashError(f"config.json is not a valid qwen3_moe config: {str(exc).splitlines()[0]}") from None
        c = self.hf_config
        quant = config.get("quantization_config") or {}
        method = quant.get("quant_method")
        if method not in (None, "fp8"):
            raise PdflashError(f"config.json: quantization {method!r} is not supported; pdflash reads bf16/fp32 or fp8 Qwen3-MoE experts")
        self.quantized = method == "fp8"
        self.expert_format = "fp8" if self.quantized else "dense"
        self.num_layers = int(c.num_hidden_layers)
        self.num_experts = int(c.num_experts)
        self.top_k = int(c.num_experts_per_tok)
        self.hidden = int(c.hidden_size)
        self.inter = int(c.moe_intermediate_size)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        sparse = [n for n in range(self.num_layers)
                  if n not in (c.mlp_only_layers or []) and (n + 1) % int(c.decoder_sparse_step or 1) == 0]
        if len(sparse) != self.num_layers:
            raise PdflashError("config.json: every decoder layer must be a MoE layer (mlp_only_layers empty, decoder_sparse_step 1); "
                               "dense MLP layers are not supported")
        if not 0 < self.top_k <= self.num_experts:
            raise PdflashError(f"config.json: num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        self.block = (128, 128)
        self.not_converted: list[str] = ["lm_head", "mlp.gate", "embed_tokens"]
        if self.quantized:
            block = quant.get("weight_block_size") or [128, 128]
            if len(block) != 2 or int(block[0]) != int(block[1]):
                raise PdflashError(f"config.json: FP8 weight_block_size {block} must be two equal sizes")
            self.block = (int(block[0]), int(block[1]))
            if quant.get("fmt", "e4m3") != "e4m3":
                raise PdflashError(f"config.json: FP8 format {quant.get('fmt')!r} is not supported (e4m3)")
            self.not_converted += list(quant.get("modules_to_not_convert") or [])
            b = self.block[0]
            if self.inter % b or self.hidden % b:
                raise PdflashError(f"config.json: FP8 experts need hidden_size and moe_intermediate_size divisible by the block size {b}")

    # -- config ----------------------------------------------------------------------
    @classmethod
    def synthetic_config(cls, preset, special_ids: dict[str, int], *, dtype: str = "bfloat16", quant: str | None = None) -> dict:
        """config.json of a Qwen3MoeForCausalLM checkpoint of ``preset``'s shape (FP8 with quant="fp8")."""
        ids = special_ids
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": ids["<|startoftext|>"],
            "eos_token_id": ids["<|return|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "decoder_sparse_step": 1,
            "head_dim": preset.head_dim,
            "hidden_act": "silu",
            "hidden_size": preset.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": preset.dense_intermediate_size or 2 * preset.intermediate_size,
            "max_position_embeddings": preset.max_position_embeddings,
            "max_window_layers": preset.num_hidden_layers,
            "mlp_only_layers": [],
            "moe_intermediate_size": preset.intermediate_size,
            "norm_topk_prob": preset.norm_topk_prob,
            "num_attention_heads": preset.num_attention_heads,
            "num_experts": preset.num_local_experts,
            "num_experts_per_tok": preset.num_experts_per_tok,
            "num_hidden_layers": preset.num_hidden_layers,
            "num_key_value_heads": preset.num_key_value_heads,
            "output_router_logits": False,
            "rms_norm_eps": preset.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": preset.rope_theta,
            "router_aux_loss_coef": 0.001,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": preset.vocab_size,
        }
        if quant == "fp8":
            b = int(preset.fp8_block)
            cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [b, b], "modules_to_not_convert": ["lm_head", "mlp.gate"]}
        return cfg

    # -- checkpoint ------------------------------------------------------------------
    def _fp8(self, module: str) -> bool:
        """Whether linear ``module`` (a dotted name) is stored in FP8."""
        if not self.quantized:
            return False
        return not any(pat in module or re.fullmatch(pat.replace(".", r"\.").replace("*", ".*"), module)
                       for pat in self.not_converted)

    def _linear(self, specs: dict, module: str, out_f: int, in_f: int, expert: bool = False) -> None:
        if self._fp8(module):
            b = self.block[0]
            specs[module + ".weight"] = TensorSpec((out_f, in_f), _FP8, expert=expert)
            specs[module + ".weight_scale_inv"] = TensorSpec((math.ceil(out_f / b), math.ceil(in_f / b)), _SCALE_DTYPES, expert=expert)
        else:
            specs[module + ".weight"] = TensorSpec((out_f, in_f), FLOAT_DTYPES, expert=expert)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        c = self.hf_config
        H, E, I, V, hd = self.hidden, self.num_experts, self.inter, int(c.vocab_size), self.head_dim
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
                self._linear(specs, p + f"self_attn.{proj}", out_f, in_f)
                if c.attention_bias:
                    specs[p + f"self_attn.{proj}.bias"] = TensorSpec((out_f,), f)
            specs[p + "self_attn.q_norm.weight"] = TensorSpec((hd,), f)
            specs[p + "self_attn.k_norm.weight"] = TensorSpec((hd,), f)
            self._linear(specs, p + "mlp.gate", E, H)
            for e in range(E):
                q = _EXPERT.format(n, e)
                self._linear(specs, q + "gate_proj", I, H, expert=True)
                self._linear(specs, q + "up_proj", I, H, expert=True)
                self._linear(specs, q + "down_proj", H, I, expert=True)
        return specs

    def _pieces(self, dtypes: dict[str, torch.dtype] | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype | None]]:
        H, I = self.hidden, self.inter
        d = dtypes or {}
        pieces = [("gate_up_proj", (2 * I, H), d.get("gate_up_proj")), ("down_proj", (H, I), d.get("down_proj"))]
        if self.quantized:
            b = self.block[0]
            pieces.insert(1, ("gate_up_proj_scale_inv", (2 * I // b, H // b), d.get("gate_up_proj_scale_inv")))
            pieces.append(("down_proj_scale_inv", (H // b, I // b), d.get("down_proj_scale_inv")))
        return pieces

    def expert_sources(self, layer: int) -> dict[str, ExpertSource]:
        """Per expert: gate_proj and up_proj rows make gate_up_proj; down_proj alone (and their scales)."""
        E = range(self.num_experts)
        q = lambda e, m, t="weight": _EXPERT.format(layer, e) + f"{m}.{t}"  # noqa: E731
        out = {
            "gate_up_proj": ExpertSource(per_expert=tuple((q(e, "gate_proj"), q(e, "up_proj")) for e in E)),
            "down_proj": ExpertSource(per_expert=tuple((q(e, "down_proj"),) for e in E)),
        }
        if self.quantized:
            s = "weight_scale_inv"
            out["gate_up_proj_scale_inv"] = ExpertSource(per_expert=tuple((q(e, "gate_proj", s), q(e, "up_proj", s)) for e in E))
            out["down_proj_scale_inv"] = ExpertSource(per_expert=tuple((q(e, "down_proj", s),) for e in E))
        return out

    def expert_layout(self, stored_dtypes: dict[str, torch.dtype]) -> ExpertLayout:
        return ExpertLayout.build(self._pieces(stored_dtypes), quantized=self.quantized)

    def init_rule(self, name: str, preset) -> tuple[str, float, float]:
        H, I = preset.hidden_size, preset.intermediate_size
        if "norm" in name:  # input / post-attention layernorms, q_norm, k_norm, the final norm
            return "normal", 1.0, 0.1
        if name == "model.embed_tokens.weight":
            return "normal", 0.0, 1.0
        if name.endswith("mlp.gate.weight"):
            return "normal", 0.0, preset.router_logit_std / math.sqrt(H)
        if name.endswith("bias"):
            return "normal", 0.0, 0.02
        if "down_proj" in name:
            std = 1.0 / math.sqrt(I)
        elif "o_proj" in name:
            std = 1.0 / math.sqrt(preset.num_attention_heads * preset.head_dim)
        else:
            std = 1.0 / math.sqrt(H)  # q/k/v, lm_head, gate / up
        if name.endswith("weight_scale_inv"):  # per-block scales around std / FP8_STD (+-25 %)
            return "uniform", std / FP8_STD, 0.25 * std / FP8_STD
        if self.quantized and self._fp8(name.rsplit(".", 1)[0]):
            return "fp8", 0.0, FP8_STD
        return "normal", 0.0, std

    # -- experts ---------------------------------------------------------------------
    def expert_kernel(self, layout: ExpertLayout, dtype: torch.dtype, original: nn.Module) -> "Qwen3ExpertKernel":
        act = getattr(original, "act_fn", None) or F.silu
        return Qwen3ExpertKernel(layout, dtype, act, silu=getattr(self.hf_config, "hidden_act", "silu") == "silu")

    def cpu_unsupported_reason(self, layout: ExpertLayout, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.bfloat16, torch.float32):
            return f"CPU experts are computed in bfloat16 or float32, not {str(dtype).replace('torch.', '')}"
        return None

    # the CPU device computes the cache's experts with the native kernel too, where it runs
    native_cpu_experts = True

    def cpu_runner(self, host, original: nn.Module, threads: int | None, dtype: torch.dtype):
        """The native kernel over the host rows (offload/cpu_compute.py's RowsExpertRunner: bf16 /
        float32 / FP8 rows, SiLU) where it can compute them: a SiLU model in bfloat16 or float32 and
        the native library built. Otherwise the family's own kernel through PyTorch
        (offload/torch_cpu.py; ``threads`` not used there: PyTorch's intra-op threads compute)."""
        from pdflash.native import NativeLibraryMissing
        from pdflash.native.cpu_experts import CpuExpertError
        from pdflash.offload.cpu_compute import RowsExpertRunner, rows_unsupported_reason
        from pdflash.offload.torch_cpu import TorchCpuExperts

        silu = getattr(self.hf_config, "hidden_act", "silu") == "silu"
        if silu and rows_unsupported_reason(host.layout, dtype) is None and os.environ.get("PDFLASH_QWEN3_NATIVE") != "0":
            try:
                return RowsExpertRunner(host, threads=threads, dtype=dtype)
            except (CpuExpertError, NativeLibraryMissing):
                pass
        return TorchCpuExperts(host, self.expert_kernel(host.layout, dtype, original), self.hidden)

    # -- model -----------------------------------------------------------------------
    def build(
        self,
        device: torch.device,
        dtype: torch.dtype,
        load: Callable[[str], torch.Tensor],
        make_experts: Callable[[int, nn.Module], nn.Module],
    ) -> nn.Module:
        """Qwen3MoeForCausalLM built on meta, experts swapped, other weights loaded onto ``device``
        (FP8 attention projections dequantized once)."""
        from transformers import Qwen3MoeForCausalLM

        from pdflash.offload.gpt_oss import finish_loaded_model

        cfg = copy.deepcopy(self.hf_config)
        # transformers' eager attention: its result for a position does not depend on how many
        # query tokens the forward has (SDPA's bf16 result does), so a speculative verify block
        # computes what single-token steps compute. The exactness references use the same.
        cfg._attn_implementation = self.attn_implementation
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
        for i, layer in enumerate(model.model.layers):
            layer.mlp.experts = make_experts(i, layer.mlp.experts)  # instance swap, class untouched

        state = {}
        for name, spec in self.tensor_specs().items():
            t = None if spec.expert else self.dense_tensor(load, name, dtype)
            if t is not None:
                state[name] = t.to(device=device)
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise PdflashError(f"internal: weights did not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return finish_loaded_model(model, device)

    def library_class(self) -> type[nn.Module]:
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM

    def reference_load_kwargs(self) -> dict:
        if not self.quantized:
            return {}
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(weight_block_size=self.block, dequantize=True)}

    def dense_tensor(self, load: Callable[[str], torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor | None:
        if name.endswith(".weight_scale_inv"):
            return None  # consumed with its weight
        t = load(name)
        if t.dtype == torch.float8_e4m3fn:
            return dequantize_fp8(t, load(name + "_scale_inv"), dtype)
        return t.to(dtype)

    def library_expert_state(self, load: Callable[[str], torch.Tensor], layer: int, device: torch.device,
                             dtype: torch.dtype, dequant_device: torch.device) -> dict[str, torch.Tensor]:
        """Qwen3MoeExperts' gate_up_proj [E, 2I, H] and down_proj [E, H, I] of one layer."""
        out = {}
        for piece, src in self.expert_sources(layer).items():
            if piece.endswith("_scale_inv"):
                continue
            scales = self.expert_sources(layer).get(piece + "_scale_inv")
            rows = []
            for e, names in enumerate(src.per_expert):
                w = torch.cat([load(n).to(dequant_device) for n in names], dim=0)
                if scales is not None:
                    s = torch.cat([load(n).to(dequant_device) for n in scales.per_expert[e]], dim=0)
                    w = dequantize_fp8(w, s, dtype)
                rows.append(w.to(device, dtype))
            out[f"model.layers.{layer}.mlp.experts.{piece}"] = torch.stack(rows)
        return out

    # -- routing ---------------------------------------------------------------------
    def router(self, layer: nn.Module) -> nn.Module:
        return layer.mlp.gate

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over all experts (float32), then the top-k (renormalising keeps the order)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return torch.topk(probs, self.top_k, dim=-1).indices


class Qwen3ExpertKernel:
    """Qwen3-MoE expert maths on packed slots, the arithmetic of transformers' Qwen3MoeExperts.

    For tokens x [n, H] of one expert, with W1 = gate_up_proj [2I, H] and W2 = down_proj [H, I]:
      gate, up = (x @ W1^T).chunk(2);   y = (act(gate) * up) @ W2^T        act = SiLU
    The weights stay in their stored [out, in] row order and the matmuls take the transposed
    view, the operand layout of the library's own (grouped) expert matmuls, so CPU results are
    bit-identical. FP8 slots are dequantized block by block (``dequantize_fp8``).

    For a few tokens on CUDA, ``fused`` gives the fused kernels of dense_triton.py instead (two
    launches per layer, FP8 decoded in registers).
    """

    def __init__(self, layout: ExpertLayout, dtype: torch.dtype, act: Callable[[torch.Tensor], torch.Tensor],
                 silu: bool = True):
        self.layout = layout
        self.dtype = dtype
        self.act = act
        self.silu = silu  # the activation is SiLU: the fused kernels compute exactly that
        self._fused: dict[str, object] = {}

    def fused(self, device: torch.device):
        """The fused kernels (dense_triton.py) for small token counts on ``device``, or None where
        they cannot run (no Triton, a CPU without Triton's interpreter, another activation,
        float16). PDFLASH_FUSED_EXPERTS=0 turns them off."""
        key = str(device)
        if key not in self._fused:
            from pdflash.offload import dense_triton

            ok = self.silu and dense_triton.supported(self.layout, self.dtype) and dense_triton.available(device)
            self._fused[key] = dense_triton.FusedDenseExperts(self.layout, self.dtype) if ok else None
        return self._fused[key]

    def weights(self, slots: torch.Tensor, slot_ids: list[int]) -> tuple[torch.Tensor, ...]:
        """(W1 [n, 2I, H], W2 [n, H, I]) in the compute dtype."""
        lay, dt = self.layout, self.dtype
        if len(slot_ids) == 1:
            rows = slots[slot_ids[0] : slot_ids[0] + 1]
        else:
            rows = slots.index_select(0, torch.tensor(slot_ids, dtype=torch.long).to(slots.device, non_blocking=True))
        v = lambda name: lay.view(rows, name)  # noqa: E731
        if lay.quantized:
            w1 = dequantize_fp8(v("gate_up_proj"), v("gate_up_proj_scale_inv"), dt, scratch=True)
            w2 = dequantize_fp8(v("down_proj"), v("down_proj_scale_inv"), dt, scratch=True)
        else:
            w1 = v("gate_up_proj").to(dt)
            w2 = v("down_proj").to(dt)
        return w1, w2

    def apply(self, weights: tuple[torch.Tensor, ...], i: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = weights
        gate, up = (x @ w1[i].transpose(0, 1)).chunk(2, dim=-1)  # [n, I] each
        return (self.act(gate) * up) @ w2[i].transpose(0, 1)  # [n, H]
