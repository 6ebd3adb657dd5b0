"""Configuration of ``bench-priority``: the arms, the built-in prompts, the seeds and
:class:`PriorityConfig` with its validation (every bad setting fails here, before anything loads)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pdflash import PdflashError
from pdflash.native import Band

ARMS = ("flat", "banded", "on-demand", "resident", "oracle")
BAND_NAMES = ("on-demand", "route-ahead", "background")  # Band 0, 1, 2
DEFAULT_PROMPTS = (
    "The router scores all experts and keeps the best four",
    "Questions and answers: what is the capital of France?",
    "def route(hidden, router, top_k=4):",
    "Write a short story about a lighthouse keeper who",
    "The expert cache keeps the most useful experts on the device and",
    "Explain why the link between host memory and the GPU limits decoding speed:",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a city built on a river,",
)
LEVEL_KEYS = ("submitted", "completed", "cancelled", "promoted", "deduplicated", "bytes",
              "queue_wait_s", "stall_s", "stall_waits", "transfer_s")


@dataclass(frozen=True)
class ArmSpec:
    """How one arm sets up the runtime. ``route_ahead_band`` None: no route-ahead at all."""

    name: str
    route_ahead_band: int | None
    history: bool
    resident: bool = False
    oracle: bool = False
    description: str = ""


ARM_SPECS = {
    "flat": ArmSpec("flat", int(Band.BACKGROUND), True,
                    description="route-ahead prefetch at band 2 (background), history prefetch at band 2"),
    "banded": ArmSpec("banded", int(Band.ROUTE_AHEAD), True,
                      description="route-ahead prefetch at band 1 (route-ahead), history prefetch at band 2"),
    "on-demand": ArmSpec("on-demand", None, False, description="no prefetch of any kind; every miss waits at band 0"),
    "resident": ArmSpec("resident", None, False, resident=True,
                        description="every expert resident before the run (cache holds all experts); no prefetch"),
    "oracle": ArmSpec("oracle", int(Band.ROUTE_AHEAD), True, oracle=True,
                      description="banded, with route-ahead predicting exactly the experts each verify pass used "
                                  "(recorded in an untimed run of the same prompt, replayed before each draft)"),
}


def order_seed(seed: int, rep: int) -> int:
    """Seed of the arm order of repetition ``rep`` (recorded in the output)."""
    return seed * 1_000_003 + rep


def oracle_seed(seed: int, prompt_index: int) -> int:
    """Seed of oracle-acceptance proposals for one prompt: the same in every arm and repetition."""
    return seed * 7919 + prompt_index




# -- configuration ------------------------------------------------------------------------------
@dataclass
class PriorityConfig:
    """Everything one ``bench-priority`` run depends on (all of it goes into the output)."""

    model_dir: str
    draft_dir: str
    arms: tuple[str, ...] = ARMS
    repetitions: int = 5
    prompts: tuple[str, ...] | None = None  # texts; None: the first n_prompts of DEFAULT_PROMPTS
    n_prompts: int = 3
    max_new_tokens: int = 32
    block_size: int | str | None = "auto"  # "auto": the block planner; None: the draft's trained block size
    draft_acceptance: float | None = None  # oracle-acceptance P; None: the draft's own proposals
    expert_cache_fraction: float | None = 0.25
    expert_cache_mib: float | None = None  # overrides the fraction
    device: str = "cpu"
    dtype: str | None = None  # compute dtype (default: the checkpoint's)
    link_gbps: float | None = None  # simulated host->device link (CPU only)
    seed: int = 0
    warmup: int = 1  # discarded rounds of every arm before the measured ones
    history_depth: int = 2  # history prefetch depth of the flat / banded / oracle arms
    predictor: str = "draft-router"  # route-ahead predictor of flat / banded
    workers: int = 2  # scheduler copy threads
    timeline: bool = True  # trace one step per prefetching arm for the link timeline
    peers: bool = False
    peer_new_tokens: int | None = None  # None: max_new_tokens
    peer_offload_new_tokens: int = 4
    peer_time_limit_s: float = 120.0
    output: str | None = None

    def validate(self) -> None:
        """Raise PdflashError on any bad setting, before anything is loaded: exit code 2 for a value
        that is wrong by itself (bad usage), 1 for one that does not fit the machine or the files."""
        import math

        from pdflash.offload.runtime import LINK_GBPS_MAX, LINK_GBPS_MIN

        def usage(msg: str) -> PdflashError:
            return PdflashError(msg, exit_code=2)

        if not self.arms:
            raise usage(f"no arm selected: choose from {', '.join(ARMS)}")
        unknown = [a for a in self.arms if a not in ARM_SPECS]
        if unknown:
            raise usage(f"unknown arm {unknown[0]!r}: choose from {', '.join(ARMS)}")
        dup = sorted({a for a in self.arms if self.arms.count(a) > 1})
        if dup:
            raise usage(f"arm {dup[0]!r} is named twice in --arms")
        if self.repetitions < 1:
            raise usage(f"--repetitions must be at least 1, got {self.repetitions}")
        if self.warmup < 0:
            raise usage(f"--warmup must be 0 or more, got {self.warmup}")
        if self.prompts is not None:
            if not self.prompts or any(not p.strip() for p in self.prompts):
                raise usage("--prompt texts must not be empty")
        elif not 1 <= self.n_prompts <= len(DEFAULT_PROMPTS):
            raise usage(f"--prompts must be between 1 and {len(DEFAULT_PROMPTS)} (the built-in prompts); "
                        f"give your own with --prompt TEXT, got {self.n_prompts}")
        if self.max_new_tokens < 2:
            raise usage(f"--max-new-tokens must be at least 2 (tokens/s needs a decode step), got {self.max_new_tokens}")
        if self.draft_acceptance is not None and not 0.0 <= self.draft_acceptance <= 1.0:
            raise usage(f"--draft-acceptance must be between 0 and 1, got {self.draft_acceptance}")
        if self.expert_cache_mib is not None:
            if not (math.isfinite(self.expert_cache_mib) and self.expert_cache_mib > 0):
                raise usage(f"--expert-cache-mib must be a positive finite number, got {self.expert_cache_mib}")
        elif self.expert_cache_fraction is None or not 0 < self.expert_cache_fraction <= 1:
            raise usage(f"--expert-cache-fraction must be in (0, 1], got {self.expert_cache_fraction}")
        if self.device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise usage(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.link_gbps is not None:
            if not (math.isfinite(self.link_gbps) and LINK_GBPS_MIN <= self.link_gbps <= LINK_GBPS_MAX):
                raise usage(f"--link-gbps must be between {LINK_GBPS_MIN:g} and {LINK_GBPS_MAX:g} (GB/s), "
                            f"got {self.link_gbps:g}")
            if self.device != "cpu":
                raise usage("--link-gbps simulates a link for --device cpu only; on CUDA the real link is used")
        if not 0 <= self.seed <= 2**63 - 1:
            raise usage(f"--seed must be between 0 and 2**63-1, got {self.seed}")
        if not (math.isfinite(self.peer_time_limit_s) and self.peer_time_limit_s > 0):
            raise usage(f"--peer-time-limit must be a positive number of seconds, got {self.peer_time_limit_s}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise PdflashError("--device cuda was asked for but no CUDA device is available; use --device cpu")
        from pdflash.draft.offloaded import parse_block_size

        self.block_size = parse_block_size(self.block_size)
        if isinstance(self.block_size, int) and self.block_size < 1:
            raise usage(f"--block-size must be at least 1, got {self.block_size}")
        if self.dtype is not None:
            from pdflash.offload.runtime import resolve_dtype

            resolve_dtype(self.dtype, None)  # an unknown name fails here, before any work
        from pdflash.draft.route_ahead import PREDICTORS, check_predictor_name

        check_predictor_name(self.predictor)
        if self.predictor == "none":
            raise usage(f"--predictor none leaves flat and banded without route-ahead: choose from {', '.join(PREDICTORS)}")
        if self.history_depth < 0:
            raise usage(f"--history-depth must be 0 or more, got {self.history_depth}")
        if self.workers < 1:
            raise usage(f"--workers must be at least 1, got {self.workers}")
        for name, d in (("--model", self.model_dir), ("--draft", self.draft_dir)):
            p = Path(d)
            if not p.is_dir():
                raise PdflashError(f"{name} {d}: no such directory")
            if not (p / "config.json").is_file():
                raise PdflashError(f"{name} {d}: no config.json; pass a checkpoint directory")
        mp = Path(self.model_dir)
        if not ((mp / "tokenizer.json").is_file() or (mp / "tokenizer_config.json").is_file()):
            raise PdflashError(f"--model {self.model_dir}: no tokenizer files (tokenizer.json); prompts cannot be encoded")
        if self.output is not None:
            check_writable(Path(self.output))

    def prompt_texts(self) -> tuple[str, ...]:
        return tuple(self.prompts) if self.prompts is not None else DEFAULT_PROMPTS[: self.n_prompts]


def check_writable(path: Path) -> None:
    """PdflashError unless ``path`` (and the PNG next to it) can be written; writes nothing."""
    import os

    if path.is_dir():
        raise PdflashError(f"--output {path} is a directory: give a file path such as {path / 'bm3.json'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise PdflashError(f"--output {path} cannot be written: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PdflashError(f"--output {path} cannot be written: the directory {parent} is not writable")
    for p in (path, path.with_suffix(".png")):
        if p.exists() and not os.access(p, os.W_OK):
            raise PdflashError(f"--output {path} cannot be written: {p} exists and is read-only")
