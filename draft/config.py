"""Configuration of a DFlash draft model, its presets and the fit check against a target.

A draft checkpoint's ``config.json`` is a Qwen3-style decoder config plus the DFlash fields:

    {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
     "hidden_size": 2880, "num_hidden_layers": 8, ..., "rope_theta": 150000, "rope_scaling": {...},
     "block_size": 8, "num_target_layers": 24,
     "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]}}

``target_layer_ids`` name target decoder layers by index; the draft's context feature of a token
is the concatenation of the *outputs* of those layers (see :mod:`pdflash.draft.features`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdflash import PdflashError

ARCHITECTURE = "DFlashDraftModel"
PRESETS = ("tiny", "gpt-oss-20b-DFlash", "Qwen3-Coder-30B-A3B-DFlash")


@dataclass
class TargetShape:
    """The few facts about a target model that a draft must agree with."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]

    @classmethod
    def from_config(cls, config: Any) -> "TargetShape":
        """Read a target's transformers config object or its config.json dict."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        try:
            hidden = int(get("hidden_size"))
            heads = int(get("num_attention_heads"))
            shape = cls(
                hidden_size=hidden,
                vocab_size=int(get("vocab_size")),
                num_hidden_layers=int(get("num_hidden_layers")),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or hidden // heads),
                max_position_embeddings=int(get("max_position_embeddings") or 131072),
                rms_norm_eps=float(get("rms_norm_eps") or 1e-5),
                rope_parameters=_rope_parameters(get("rope_parameters"), get("rope_theta"), get("rope_scaling")),
            )
        except (TypeError, ValueError) as exc:
            raise PdflashError(f"the target config lacks a field a draft needs ({exc}); check its config.json") from None
        return shape

    @classmethod
    def from_dir(cls, target_dir: str | Path) -> "TargetShape":
        return cls.from_config(read_config_json(Path(target_dir) / "config.json", "target"))


@dataclass
class DFlashConfig:
    """A DFlash draft: Qwen3-style decoder layers reading projected target context.

    Shapes: H = hidden_size, D = head_dim, K = len(target_layer_ids); ``fc`` maps K*H -> H.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    # -- checks -------------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise PdflashError when the config cannot describe a working draft."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PdflashError(f"draft config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise PdflashError(
                f"draft config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise PdflashError(f"draft config: block_size must be an integer >= 2, got {self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise PdflashError(
                f"draft config: dflash_config.mask_token_id must be a token id below vocab_size "
                f"{self.vocab_size}, got {self.mask_token_id!r}"
            )
        ids = self.target_layer_ids
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise PdflashError(f"draft config: dflash_config.target_layer_ids must be a non-empty list of integers, got {ids!r}")
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_target_layers for i in ids):
            raise PdflashError(
                f"draft config: dflash_config.target_layer_ids {ids} must be distinct layer indices in "
                f"[0, num_target_layers={self.num_target_layers})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise PdflashError(
                f"draft config: layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        for kind in self.layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                raise PdflashError(f"draft config: unsupported layer type {kind!r} (full_attention or sliding_attention)")
            if kind == "sliding_attention" and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
                raise PdflashError("draft config: sliding_attention layers need a positive sliding_window")

    def check_fits(self, target: TargetShape) -> None:
        """Raise PdflashError when this draft cannot run against ``target``."""
        if self.hidden_size != target.hidden_size:
            raise PdflashError(
                f"the draft's hidden size {self.hidden_size} does not match the target's {target.hidden_size}; "
                "use a draft trained for this target"
            )
        if self.vocab_size != target.vocab_size:
            raise PdflashError(
                f"the draft's vocabulary ({self.vocab_size}) does not match the target's ({target.vocab_size}); "
                "use a draft trained for this target"
            )
        if self.num_target_layers != target.num_hidden_layers or max(self.target_layer_ids) >= target.num_hidden_layers:
            raise PdflashError(
                f"the draft reads target layers {self.target_layer_ids} of a {self.num_target_layers}-layer target, "
                f"but this target has {target.num_hidden_layers} layers; use a draft trained for this target"
            )

    # -- (de)serialisation ----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        """Parse a draft config.json dict (published layout; see the module docstring)."""
        archs = raw.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise PdflashError(f"not a DFlash draft: config.json architectures is {archs!r}, expected [{ARCHITECTURE!r}]")
        dflash = raw.get("dflash_config")
        if not isinstance(dflash, dict):
            raise PdflashError("draft config: dflash_config (with mask_token_id and target_layer_ids) is missing")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if k not in raw]
        if "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        block_size = raw.get("block_size", dflash.get("block_size"))
        if block_size is None:
            missing.append("block_size")
        num_target_layers = raw.get("num_target_layers")
        ids = dflash.get("target_layer_ids")
        if ids is None and num_target_layers is None:
            missing.append("dflash_config.target_layer_ids")
        if missing:
            raise PdflashError(f"draft config.json lacks {', '.join(missing)}")
        if ids is None:
            ids = spread_layer_ids(int(num_target_layers), int(raw["num_hidden_layers"]))
        if num_target_layers is None:
            num_target_layers = max(ids) + 1
        heads = raw["num_attention_heads"]
        try:
            return cls(
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                vocab_size=raw["vocab_size"],
                block_size=block_size,
                mask_token_id=dflash["mask_token_id"],
                target_layer_ids=list(ids),
                num_target_layers=num_target_layers,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(raw.get("attention_bias", False)),
                max_position_embeddings=int(raw.get("max_position_embeddings") or 131072),
                rope_parameters=_rope_parameters(raw.get("rope_parameters"), raw.get("rope_theta"), raw.get("rope_scaling")),
                layer_types=list(raw.get("layer_types") or []),
                sliding_window=raw.get("sliding_window"),
                dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            )
        except (TypeError, ValueError) as exc:
            raise PdflashError(f"draft config.json has a malformed field ({exc})") from None

    @classmethod
    def from_dir(cls, draft_dir: str | Path) -> "DFlashConfig":
        path = Path(draft_dir)
        if not path.is_dir():
            raise PdflashError(f"draft directory {str(path)!r} does not exist; pass a DFlash checkpoint directory to --draft")
        return cls.from_dict(read_config_json(path / "config.json", "draft"))

    def to_dict(self) -> dict[str, Any]:
        """config.json content in the published layout (legacy rope_theta / rope_scaling keys)."""
        rope = dict(self.rope_parameters)
        theta = rope.pop("rope_theta")
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": scaling,
            "rope_theta": theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "vocab_size": self.vocab_size,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    # -- presets -------------------------------------------------------------------------------

    @classmethod
    def fitted_to(cls, target: TargetShape, *, intermediate_size: int, num_hidden_layers: int, block_size: int,
                  mask_token_id: int, features: int, dtype: str) -> "DFlashConfig":
        """A draft whose attention shape, vocabulary, norms and rotary are the target's, reading
        ``features`` target layers spread over its stack (spread_layer_ids)."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=spread_layer_ids(target.num_hidden_layers, features),
            num_target_layers=target.num_hidden_layers,
            rms_norm_eps=target.rms_norm_eps,
            attention_bias=True,
            max_position_embeddings=target.max_position_embeddings,
            rope_parameters=dict(target.rope_parameters),
            dtype=dtype,
        )

    @classmethod
    def from_preset(cls, name: str, target: TargetShape | None = None) -> "DFlashConfig":
        """A named draft shape. ``tiny`` is fitted to ``target`` (required); ``gpt-oss-20b-DFlash`` is
        the published gpt-oss-20b drafter shape and ``Qwen3-Coder-30B-A3B-DFlash`` a drafter of the
        Qwen3-Coder-30B-A3B shape, both checked against ``target`` when one is given."""
        if name == "tiny":
            if target is None:
                raise PdflashError("the tiny draft preset is fitted to a target: give the target checkpoint directory")
            config = cls.fitted_to(target, intermediate_size=2 * target.hidden_size, num_hidden_layers=2, block_size=4,
                                   mask_token_id=target.vocab_size - 1, features=3, dtype="float32")
        elif name == "gpt-oss-20b-DFlash":
            config = cls(
                hidden_size=2880,
                intermediate_size=7680,
                num_hidden_layers=8,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                vocab_size=201088,
                block_size=8,
                mask_token_id=200000,
                target_layer_ids=[1, 6, 11, 16, 21],
                num_target_layers=24,
                rms_norm_eps=1e-5,
                attention_bias=True,
                max_position_embeddings=131072,
                rope_parameters={
                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                },
                dtype="bfloat16",
            )
            if target is not None:
                config.check_fits(target)
        elif name == "Qwen3-Coder-30B-A3B-DFlash":
            # A drafter for Qwen3-Coder-30B-A3B in the published DFlash layout: the target's
            # attention shape (32 / 4 heads of 128, no bias), vocabulary and rotary; five layers
            # reading five target layers spread over the 48 (spread_layer_ids), block 16, the mask
            # token the first id after Qwen3's tokenizer. A downloaded draft's config.json is what
            # pdflash reads; this shape is for synthetic drafts of the right size.
            config = cls(
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=5,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                vocab_size=151936,
                block_size=16,
                mask_token_id=151669,
                target_layer_ids=spread_layer_ids(48, 5),
                num_target_layers=48,
                rms_norm_eps=1e-6,
                attention_bias=False,
                max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
                dtype="bfloat16",
            )
            if target is not None:
                config.check_fits(target)
        else:
            raise PdflashError(f"unknown draft preset {name!r}; choose one of {', '.join(PRESETS)}", exit_code=2)
        return config


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """Up to ``count`` distinct target layer indices spread evenly over [1, L-3].

    Early layers carry little beyond the embedding and the last layers are close to the logits the
    target itself computes, so the context is taken from the middle of the stack. A stack too short
    for that range uses [1, L-1] (or [0, 0] for one layer). For L=24, count=5: [1, 6, 11, 16, 21].
    """
    if num_target_layers <= 0 or count <= 0:
        raise PdflashError("spread_layer_ids needs a positive layer count and feature count")
    lo = min(1, num_target_layers - 1)
    hi = num_target_layers - 3
    if hi - lo + 1 < count:
        hi = num_target_layers - 1
    if count == 1:
        return [(lo + hi) // 2]
    ids = sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})
    return ids


def _rope_parameters(params: Any, theta: Any, scaling: Any) -> dict[str, Any]:
    """Normalise transformers-5 ``rope_parameters`` or legacy ``rope_theta`` + ``rope_scaling``."""
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(scaling) if isinstance(scaling, dict) else {}
        if "type" in out and "rope_type" not in out:
            out["rope_type"] = out.pop("type")
        out["rope_theta"] = float(theta if theta is not None else 1e6)
    out.setdefault("rope_type", "default")
    out["rope_theta"] = float(out["rope_theta"])
    return out


def read_config_json(path: Path, what: str) -> dict[str, Any]:
    if not path.parent.is_dir():
        raise PdflashError(f"{what} directory {str(path.parent)!r} does not exist")
    if not path.is_file():
        raise PdflashError(f"{what} directory {str(path.parent)!r} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PdflashError(f"{what} config {str(path)!r} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise PdflashError(f"{what} config {str(path)!r} is not a JSON object")
    return raw
