"""DFlash block-diffusion drafting and lossless speculative decoding.

    from pdflash.draft import load_draft, speculative_generate
    draft = load_draft("path/to/gpt-oss-20b-DFlash", target)       # shares target embed / lm_head
    result = speculative_generate(target, draft, prompt_ids, 128)    # greedy: identical to target greedy
    result.stats.acceptance_length, result.to_dict()

Modules: ``config`` (DFlashConfig, presets, fit check), ``model`` (DFlashDraftModel, load_draft),
``taps`` (hooks on the target: context features, chosen experts), ``speculative`` (the loop and the
acceptance rules), ``route_ahead`` (expert predictors, prefetch submission, quality report),
``oracle`` (oracle-acceptance mode), ``offloaded`` (the loop on the offload runtime),
``synthetic`` (synthetic draft checkpoints). The benchmark against plain decoding is
``pdflash.bench.speculative``.
"""

from pdflash.draft.config import PRESETS, DFlashConfig, TargetShape, spread_layer_ids
from pdflash.draft.model import DFlashDraftModel, DraftKVCache, draft_tensor_shapes, load_draft
from pdflash.draft.offloaded import draft_block_size, generate_with_draft, speculative_on_runtime, speculative_options
from pdflash.draft.oracle import OracleProposer
from pdflash.draft.route_ahead import (
    PREDICTORS,
    ROUTE_AHEAD_PRIORITY,
    RouteAhead,
    RouteAheadReport,
    check_predictor_name,
    make_predictor,
    window_for_cache,
)
from pdflash.draft.speculative import (
    SpeculativeResult,
    SpeculativeStats,
    StepInfo,
    accept_greedy,
    accept_sampling,
    check_block_size,
    greedy_generate,
    make_oracle,
    speculative_generate,
)
from pdflash.draft.synthetic import shaped_draft_config, write_synthetic_draft
from pdflash.draft.taps import FeatureTap, RouterTap

__all__ = [
    "PRESETS",
    "PREDICTORS",
    "ROUTE_AHEAD_PRIORITY",
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftKVCache",
    "FeatureTap",
    "OracleProposer",
    "RouteAhead",
    "RouteAheadReport",
    "RouterTap",
    "SpeculativeResult",
    "SpeculativeStats",
    "StepInfo",
    "TargetShape",
    "accept_greedy",
    "accept_sampling",
    "check_block_size",
    "check_predictor_name",
    "draft_block_size",
    "draft_tensor_shapes",
    "generate_with_draft",
    "greedy_generate",
    "load_draft",
    "make_oracle",
    "make_predictor",
    "speculative_generate",
    "speculative_on_runtime",
    "speculative_options",
    "spread_layer_ids",
    "window_for_cache",
    "shaped_draft_config",
    "write_synthetic_draft",
]
