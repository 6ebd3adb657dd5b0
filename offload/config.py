"""Shapes of the synthetic gpt-oss checkpoints (``pdflash make-synthetic --preset NAME``).

A preset is the architecture only; ``hf_config`` turns it into the config.json
dict of a real ``GptOssForCausalLM`` checkpoint (the legacy ``rope_theta`` /
``rope_scaling`` spelling of openai/gpt-oss-20b, which every transformers
version reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdflash import PdflashError

# Special tokens of the synthetic tokenizer, in id order after the byte-level BPE vocabulary.
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>")


@dataclass(frozen=True)
class ModelPreset:
    """One gpt-oss architecture. E = experts per layer, H = hidden, I = expert intermediate."""

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

    def __post_init__(self):
        if self.hidden_size % 32 or self.intermediate_size % 32:
            raise PdflashError(f"preset {self.name}: hidden and intermediate sizes must be multiples of 32 (MXFP4 blocks)")
        if not self.layer_types:  # gpt-oss alternates sliding and full attention, sliding first
            types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)

    @classmethod
    def from_name(cls, name: str) -> "ModelPreset":
        try:
            return PRESETS[name]
        except KeyError:
            raise PdflashError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}", exit_code=2) from None

    def hf_config(self, special_ids: dict[str, int], *, dtype: str = "bfloat16", mxfp4: bool = False) -> dict:
        """config.json of a GptOssForCausalLM checkpoint with this shape.

        special_ids: {special token: id} of the checkpoint's tokenizer (SPECIAL_TOKENS).
        """
        ids = special_ids
        cfg = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": True,
            "attention_dropout": 0.0,
            "bos_token_id": ids["<|startoftext|>"],
            "eos_token_id": ids["<|return|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "experts_per_token": self.num_experts_per_tok,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initial_context_length": self.rope_scaling.get("original_max_position_embeddings", 4096),
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_local_experts": self.num_local_experts,
            "output_router_logits": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": dict(self.rope_scaling) or None,
            "rope_theta": self.rope_theta,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.sliding_window,
            "swiglu_limit": self.swiglu_limit,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        if mxfp4:
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


def _yarn(factor: float, original: int) -> dict:
    return {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": factor,
        "original_max_position_embeddings": original,
        "rope_type": "yarn",
        "truncate": False,
    }


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
    "gpt-oss-20b": ModelPreset(
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
    ),
}
