"""The expert-cache budget of ``bench-priority``: model shape and the cache sizes the arms use."""

from __future__ import annotations

import math

from dataclasses import dataclass

from pdflash import PdflashError
from pdflash.bench.config import PriorityConfig


@dataclass
class Budget:
    """Model shape and the expert-cache sizes the arms use (experts = (layer, expert) pairs)."""

    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    block_size: int
    total_experts: int
    budget_experts: int  # capacity of the budget arms
    min_experts: int  # what one layer of one verify block may need at once
    allocated_experts: int  # slots allocated once (all experts when `resident` runs)

    @property
    def budget_bytes(self) -> int:
        return self.budget_experts * self.expert_bytes


def plan_budget(cfg: PriorityConfig) -> Budget:
    """Open and validate the checkpoints (no weights read) and size the cache; PdflashError if it cannot work."""
    from pdflash.draft.offloaded import draft_block_size
    from pdflash.offload.checkpoint import Checkpoint
    from pdflash.offload.runtime import min_cache_experts

    block = draft_block_size(cfg.draft_dir, cfg.block_size)
    with Checkpoint(cfg.model_dir) as ckpt:
        fam = ckpt.family
        stored = {piece: ckpt.dtype(src.first_name()) for piece, src in fam.expert_sources(0).items()}
        expert_bytes = fam.expert_layout(stored).expert_bytes
        L, E, K = fam.num_layers, fam.num_experts, fam.top_k
    total = L * E
    need = min_cache_experts(E, K, block)
    if cfg.expert_cache_mib is not None:
        n = min(total, int(cfg.expert_cache_mib * 2**20 // expert_bytes))
        asked = f"--expert-cache-mib {cfg.expert_cache_mib:g}"
        fix = f"--expert-cache-mib {math.ceil(need * expert_bytes / 2**20 * 10) / 10:g}"
    else:
        n = min(total, max(1, round(cfg.expert_cache_fraction * total)))
        asked = f"--expert-cache-fraction {cfg.expert_cache_fraction:g}"
        fix = f"--expert-cache-fraction {math.ceil(need / total * 100) / 100:g}"
    if n < need:
        raise PdflashError(f"{asked} gives {n} expert slots; a verify block of {block} tokens needs at least {need} "
                           f"({need * expert_bytes / 2**20:.1f} MiB): give at least {fix}, or a smaller --block-size")
    allocated = total if "resident" in cfg.arms else n
    return Budget(L, E, K, expert_bytes, block, total, n, need, allocated)
