"""pdflash.offload: run a Mixture-of-Experts checkpoint whose experts do not fit on the device.

Load and run
    rt = OffloadedModel.load(model_dir, *, device="cpu", dtype=None, expert_cache_mib=None,
                             expert_cache_experts=None, block_tokens=1, eviction="balanced", link_gbps=None,
                             workers=2, chunk_mib=4.0, lookahead_depth=0, history_depth=0,
                             route_ahead_priority=Band.ROUTE_AHEAD, background_priority=Band.BACKGROUND,
                             preload=False, progress=False)
        Cache size: expert_cache_experts slots, else what fits in expert_cache_mib, else every expert.
        Minimum: min(E, block_tokens * top_k) slots (what one layer of a decode block may need at
        once); below it a PdflashError. dtype None = the checkpoint's dtype. link_gbps simulates a
        host->device link on the CPU and paces the real copies to that rate on CUDA.
        OffloadedModel is a context manager.
    rt.model                   transformers' GptOssForCausalLM, experts swapped for OffloadedExperts;
                               use it like the library model, with its own KV cache (cropping works)
    rt.forward(input_ids, cache=None, **kw) -> model output   (no autograd; right KV keyword per version)
    rt.new_kv_cache()          DynamicCache(config=...) as transformers' generate uses
    rt.scheduler               the one native Scheduler: every expert byte moves through it
    rt.cache                   ExpertCache: slots, table, pins, eviction; resident(), occupancy(), drain()
    rt.prefetcher              ExpertPrefetcher:
        prefetch_experts({layer: experts}, priority=None) -> copies submitted (route-ahead band by default)
        accuracy() -> {predictor: {predicted, used, correct, recall, precision}}
    rt.stats() -> dict         exposed_fetch_seconds (+ by band: on-demand / route-ahead / background),
                               cache {hits, misses, promoted, hit_rate, ...}, prefetch {issued, used, wasted,
                               cancelled, dropped, accuracy}, bytes_moved, bytes_per_token,
                               link_busy_seconds, link_gbps, link_emulated (CUDA with link_gbps: the
                               real copies are paced), bands [...], per_layer [...]; unmeasured values are None
    rt.resident_experts() -> {layer: [experts]};  rt.hit_rate() -> float | None
    rt.add_routing_observer(fn(layer, experts)); rt.record_routing() -> context of RoutingRecord
        (.forwards: [{layer: experts used}], .union()); rt.last_routing
    rt.preload(zero_stats=True) -> experts copied in (fills the cache layer by layer)
    rt.reset_cache()           NOT terminal: empty cache and scheduler queues, zero statistics
    rt.close()                 terminal, idempotent: stop the scheduler, free pinned and device memory
    rt.tokenizer, rt.eos_token_ids

Generation (free functions)
    prefill(rt, input_ids, kv) -> logits [1, V];  decode_one_token(rt, token_id, kv) -> logits [1, V]
    sample(logits, temperature, generator) -> token id
    generate(rt, input_ids, max_new_tokens=64, temperature=0.0, seed=0, on_step=None, eos_token_ids=None)
        -> GenerationResult(token_ids, prompt_tokens, stop_reason, ttft_ms, tpot_ms, tokens_per_second,
                            total_s, stats)

Checkpoints
    Checkpoint(path)           validate a Hugging Face checkpoint directory (config.json, model.safetensors
                               or shards + index): PdflashError with one line for each kind of problem
    ModelPreset.from_name("tiny" | "gpt-oss-20b")
    write_checkpoint(out_dir, preset, *, mxfp4=False, quant=None, seed=0, dtype="bfloat16", max_shard_bytes=4 GiB,
                     progress=False) -> Path       seeded synthetic checkpoint in the real format
    SyntheticCheckpoint(preset, *, quant=None, seed=0)   the same weights generated in memory
    dequantize(blocks, scales, dtype) -> weight [..., in, out];  quantize(weight) -> (blocks, scales)

Model families
    A family adapter (gpt_oss.GptOssFamily, qwen3_moe.Qwen3MoeFamily; the seam is family.ModelFamily)
    knows the tensor names, where expert pieces are stored, the packed expert layout, the routing and
    the expert maths, and builds the library's own model with its experts swapped (family.find_family;
    family.family_of for a loaded model).
"""

from pdflash.offload.checkpoint import Checkpoint
from pdflash.offload.config import PRESETS, ModelPreset
from pdflash.offload.generate import GenerationResult, StepInfo, decode_one_token, generate, prefill, sample
from pdflash.offload.mxfp4 import dequantize, quantize
from pdflash.offload.prefetch import ExpertPrefetcher
from pdflash.offload.runtime import OffloadedModel, RoutingRecord, load_tokenizer, min_cache_experts
from pdflash.offload.synthetic import SyntheticCheckpoint, write_checkpoint

__all__ = [
    "Checkpoint",
    "ExpertPrefetcher",
    "GenerationResult",
    "ModelPreset",
    "OffloadedModel",
    "PRESETS",
    "RoutingRecord",
    "StepInfo",
    "SyntheticCheckpoint",
    "decode_one_token",
    "dequantize",
    "generate",
    "load_tokenizer",
    "min_cache_experts",
    "prefill",
    "quantize",
    "sample",
    "write_checkpoint",
]
