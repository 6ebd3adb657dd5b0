"""Shapes of the synthetic checkpoints (``pdflash make-synthetic --preset NAME``).

A preset is the architecture only, in one model family (``family``: a config.json model_type,
"gpt_oss" or "qwen3_moe"); ``hf_config`` asks that family's adapter (offload/family.py) for the
config.json dict of a real checkpoint of that shape (for gpt-oss the legacy ``rope_theta`` /
``rope_scaling`` spelling of openai/gpt-oss-20b, which every transformers version reads).
Field names follow gpt-oss's config; for Qwen3-MoE ``num_local_experts`` is ``num_experts``
and ``intermediate_size`` is ``moe_intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdflash import PdflashError

# Special tokens of the synthetic tokenizer, in id order after the byte-level BPE vocabulary.
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>")


@dataclass(frozen=True)
class ModelPreset:
    """One MoE architecture. E = experts per layer, H = hidden, I = expert intermediate."""

    name: str
    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    vocab_size: int  # embedding rows; the synthetic tokenizer uses at most tokenizer_vocab of them
    tokenizer_vocab: int  # target size of the byte-level BPE (specials included)
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    router_logit_std: float = 1.5  # std of router logits for a unit-RMS input: routing spread, not degenerate
    layer_types: tuple[str, ...] = ()
    family: str = "gpt_oss"  # config.json model_type of the family
    norm_topk_prob: bool = True  # qwen3_moe: renormalise the top-k routing weights
    fp8_block: int = 128  # qwen3_moe FP8 checkpoints: weight_block_size (square blocks)
    dense_intermediate_size: int = 0  # qwen3_moe: intermediate_size of dense MLP layers (none here)

    def __post_init__(self):
        if self.family == "gpt_oss" and (self.hidden_size % 32 or self.intermediate_size % 32):
            raise PdflashError(f"preset {self.name}: hidden and intermediate sizes must be multiples of 32 (MXFP4 blocks)")
        if not self.layer_types:
            if self.family == "gpt_oss":  # gpt-oss alternates sliding and full attention, sliding first
                types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers))
            else:
                types = ("full_attention",) * self.num_hidden_layers
            object.__setattr__(self, "layer_types", types)

    @classmethod
    def from_name(cls, name: str) -> "ModelPreset":
        try:
            return PRESETS[name]
        except KeyError:
            raise PdflashError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}", exit_code=2) from None

    @property
    def quant_formats(self) -> tuple[str, ...]:
        """Quantized expert formats a synthetic checkpoint of this preset can be written in."""
        return {"gpt_oss": ("mxfp4",), "qwen3_moe": ("fp8",)}.get(self.family, ())

    def hf_config(self, special_ids: dict[str, int], *, dtype: str = "bfloat16", mxfp4: bool = False, quant: str | None = None) -> dict:
        """config.json of a checkpoint of this shape in its family.

        special_ids: {special token: id} of the checkpoint's tokenizer (SPECIAL_TOKENS).
        quant: None (dense), "mxfp4" (gpt_oss) or "fp8" (qwen3_moe); ``mxfp4=True`` is quant="mxfp4".
        """
        from pdflash.offload.family import family_class

        quant = "mxfp4" if mxfp4 else quant
        if quant is not None and quant not in self.quant_formats:
            raise PdflashError(f"preset {self.name} ({self.family}) has no {quant} format; choose "
                               f"{' or '.join(self.quant_formats) or 'a dense checkpoint'}")
        return family_class(self.family).synthetic_config(self, special_ids, dtype=dtype, quant=quant)


def _yarn(factor: float, original: int) -> dict:
    return {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": factor,
        "original_max_position_embeddings": original,
        "rope_type": "yarn",
        "truncate": False,
    }


_GPT_OSS_20B = ModelPreset(
    name="gpt-oss-20b",
    num_hidden_layers=24,
    num_local_experts=32,
    num_experts_per_tok=4,
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    vocab_size=201088,
    tokenizer_vocab=1024,
    max_position_embeddings=131072,
    rope_theta=150000.0,
    rope_scaling=_yarn(32.0, 4096),
)

PRESETS: dict[str, ModelPreset] = {
    # Small enough for CPU tests in seconds; keeps every module type: sinks, sliding and full
    # attention (window 8, so prompts of a dozen tokens cross it), YaRN rotary, top-k routing.
    "tiny": ModelPreset(
        name="tiny",
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        vocab_size=384,
        tokenizer_vocab=384,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling=_yarn(4.0, 1024),
    ),
    # openai/gpt-oss-20b (../shared/REFERENCE.md).
    "gpt-oss-20b": _GPT_OSS_20B,
    # openai/gpt-oss-120b: the 20b's attention and expert shapes, 36 layers of 128 experts (top-4);
    # 65 GB of MXFP4 experts, so GPU benchmarks fill it in memory (synthetic.SyntheticCheckpoint).
    "gpt-oss-120b": replace(_GPT_OSS_20B, name="gpt-oss-120b", num_hidden_layers=36, num_local_experts=128,
                            rope_scaling=_yarn(32.0, 4096), layer_types=()),  # () -> derived for 36 layers
    # Qwen3-MoE with every module type of Qwen3-30B-A3B (qk-norm, GQA, softmax -> top-k ->
    # renormalised routing, per-expert SiLU-gated MLPs), small enough for CPU tests.
    "qwen3-tiny": ModelPreset(
        name="qwen3-tiny",
        family="qwen3_moe",
        num_hidden_layers=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=0,
        vocab_size=384,
        tokenizer_vocab=384,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        fp8_block=32,
        dense_intermediate_size=128,
    ),
    # Qwen/Qwen3-30B-A3B: 48 layers, 128 experts, top-8, hidden 2048, expert intermediate 768,
    # GQA 32 / 4 heads of 128, qk-norm (Qwen/Qwen3-30B-A3B-FP8: 128 x 128 FP8 blocks).
    "qwen3-30b-a3b": ModelPreset(
        name="qwen3-30b-a3b",
        family="qwen3_moe",
        num_hidden_layers=48,
        num_local_experts=128,
        num_experts_per_tok=8,
        hidden_size=2048,
        intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        sliding_window=0,
        vocab_size=151936,
        tokenizer_vocab=1024,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        fp8_block=128,
        dense_intermediate_size=6144,
    ),
}
# Qwen/Qwen3-Coder-30B-A3B-Instruct: the same shape, a 256k context (rope theta 1e7).
PRESETS["qwen3-coder-30b-a3b"] = replace(PRESETS["qwen3-30b-a3b"], name="qwen3-coder-30b-a3b",
                                         max_position_embeddings=262144, rope_theta=10000000.0)
