"""Peer baselines that ``bench-priority`` reports next to pdflash.

Two arms, both transformers' own model of the checkpoint's family (``GptOssForCausalLM``,
``Qwen3MoeForCausalLM``) holding the checkpoint's weights:

- ``transformers-resident``: every weight on the GPU. The speed ceiling of the library.
- ``transformers-accelerate-offload``: the same model dispatched by accelerate
  (``infer_auto_device_map`` + ``dispatch_model``) with GPU memory capped at a budget,
  normally pdflash's expert cache plus its resident non-expert weights. Modules mapped to
  the CPU are copied to the GPU on every forward: what users get from ``device_map="auto"``
  with ``max_memory``.

Loading. MXFP4 experts are dequantized in memory, one layer at a time, with
:func:`pdflash.offload.mxfp4.dequantize` (no bf16 copy is written to disk and transformers'
mxfp4 quantizer, which needs hub kernels, is never involved). The model is built on the
meta device and each tensor is assigned (``load_state_dict(assign=True)``) on its final
device, so host memory holds at most one layer of temporaries beyond the model itself.

Decoding. Both arms run the same explicit greedy loop (:func:`greedy_decode`): one forward
per token with a ``DynamicCache``, argmax of the last position's logits, EOS ignored, so every
prompt yields exactly ``new_tokens`` tokens. The first token comes from the prefill (TTFT);
tokens/s counts only the ``new_tokens - 1`` decode steps after it. Every forward is bracketed
by ``torch.cuda.synchronize`` on CUDA. A metric that was not measured is ``None``, never 0.

Shape legend: E = experts per layer, H = hidden size, I = expert intermediate size.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pdflash import PdflashError
from pdflash.offload.gpt_oss import finish_loaded_model

RESIDENT = "transformers-resident"
ACCELERATE_OFFLOAD = "transformers-accelerate-offload"
ARMS = (RESIDENT, ACCELERATE_OFFLOAD)

GIB = 1 << 30
DECODE_METHOD = (
    "explicit greedy loop: one forward per token with a transformers DynamicCache, argmax of the "
    "last position's logits, EOS ignored (exactly new_tokens per prompt)"
)
DEFAULT_PROMPTS = (
    "The router scores all experts and keeps the best four",
    "Questions and answers: what is the capital of France?",
    "def route(hidden, router, top_k=4):",
)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise PdflashError(f"unsupported dtype {name!r}: choose one of {', '.join(_DTYPES)}") from None


# -- loading ---------------------------------------------------------------------------------
def _open(model_dir: str | Path):
    from pdflash.offload.checkpoint import Checkpoint

    return Checkpoint(model_dir)


def load_transformers_reference(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    attn_implementation: str | None = None,
    experts_implementation: str | None = None,
    dequant_device: str | torch.device | None = None,
) -> nn.Module:
    """transformers' own model of the checkpoint's family (GptOssForCausalLM, Qwen3MoeForCausalLM)
    with every weight of ``model_dir`` on ``device`` in ``dtype``. ``model_dir`` may also be an
    open checkpoint object (offload/synthetic.py's in-memory SyntheticCheckpoint); it is left open.

    bf16 / fp32 checkpoints and quantized ones (MXFP4, FP8: dequantized in memory) all load.
    ``dequant_device`` is where experts are dequantized before they move to ``device``
    (default: ``device``); build on the CPU with ``dequant_device="cuda"`` to dequantize fast.
    ``attn_implementation``: None is the family's own choice for pdflash's model (eager for both:
    gpt-oss's attention sinks need it; see offload/qwen3_moe.py for Qwen3-MoE). ``experts_implementation``: None keeps transformers'
    default choice; the choice made is ``model.config._experts_implementation``.
    Every parameter of the result is a plain tensor on ``device``; the model is in eval mode.
    """
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    device = torch.device(device)
    dequant_device = torch.device(dequant_device) if dequant_device is not None else device
    owned = isinstance(model_dir, (str, Path))
    ckpt = _open(model_dir) if owned else model_dir
    fam = ckpt.family
    cls = fam.library_class()
    try:
        cfg = copy.deepcopy(fam.hf_config)  # config.json without quantization_config
        cfg._attn_implementation = attn_implementation or fam.attn_implementation
        if experts_implementation is not None:
            cfg._experts_implementation = experts_implementation
        cfg.dtype = dtype
        try:
            with torch.device("meta"):
                model = cls(cfg)
        except (ValueError, ImportError) as exc:
            raise PdflashError(f"transformers cannot build {cls.__name__} with these settings: {str(exc).splitlines()[0]}") from None

        specs = ckpt.family.tensor_specs()
        dense = [n for n, s in specs.items() if not s.expert]
        by_layer: dict[int, list[str]] = {}
        for name in dense:  # "model.layers.N.*" grouped per layer; embeddings / norm / head under -1
            parts = name.split(".")
            by_layer.setdefault(int(parts[2]) if parts[1] == "layers" else -1, []).append(name)
        for layer in [-1, *range(ckpt.family.num_layers)]:
            # One layer's tensors at a time: host memory never holds more than one layer.
            state = {}
            for n in by_layer.get(layer, []):
                t = fam.dense_tensor(ckpt.get, n, dtype)
                if t is not None:
                    state[n] = t.to(device)
            if layer >= 0:
                state.update(fam.library_expert_state(ckpt.get, layer, device, dtype, dequant_device))
            _, unexpected = model.load_state_dict(state, strict=False, assign=True)
            if unexpected:
                raise PdflashError(f"internal: checkpoint tensors {unexpected[:3]} have no parameter in {cls.__name__}")
            del state
    finally:
        if owned:
            ckpt.close()
    return finish_loaded_model(model, device, source=str(model_dir))


def encode_prompts(model_dir: str | Path, texts: list[str] | tuple[str, ...]) -> list[list[int]]:
    """Token ids of each text with the checkpoint's tokenizer.json (no special tokens added)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise PdflashError(f"{path} is missing: pass prompts as token ids, or use a checkpoint with a tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    if any(not x for x in ids):
        raise PdflashError("a prompt encodes to no tokens: give non-empty prompts")
    return ids


# -- greedy decoding -------------------------------------------------------------------------
@dataclass
class GreedyRun:
    """One prompt through :func:`greedy_decode`. Times in seconds."""

    token_ids: list[int]
    ttft_s: float  # prefill forward + argmax of the first new token
    step_s: list[float] = field(default_factory=list)  # each decode step after the prefill

    @property
    def decode_tokens(self) -> int:
        return len(self.step_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_kwarg(model: nn.Module) -> str:
    """Name of the KV-cache argument of model.forward ("cache" in newer transformers)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()  # not inference_mode: accelerate's hooks build Parameters during the forward
def greedy_decode(
    model: nn.Module,
    prompt_ids: list[int],
    new_tokens: int,
    device: str | torch.device,
    deadline: float | None = None,
) -> GreedyRun:
    """Greedy decoding of one prompt (batch 1) for ``new_tokens`` tokens with a KV cache.

    ``device`` is where the input ids go (the embedding's execution device). Stops early,
    after the prefill at the least, once ``time.perf_counter()`` passes ``deadline``.
    """
    from transformers import DynamicCache

    if new_tokens < 1:
        raise PdflashError(f"new_tokens must be at least 1, got {new_tokens}")
    if not prompt_ids:
        raise PdflashError("an empty prompt cannot be decoded: give at least one token")
    device = torch.device(device)
    cache = DynamicCache(config=model.config)
    kw = {_cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]

    _sync(device)
    t0 = time.perf_counter()
    logits = model(input_ids=ids, **kw).logits  # [1, 1, V]
    nxt = logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
    tok = int(nxt.item())
    _sync(device)
    run = GreedyRun([tok], time.perf_counter() - t0)
    while len(run.token_ids) < new_tokens:
        if deadline is not None and time.perf_counter() > deadline:
            break
        _sync(device)
        t0 = time.perf_counter()
        logits = model(input_ids=nxt, **kw).logits
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        tok = int(nxt.item())
        _sync(device)
        run.step_s.append(time.perf_counter() - t0)
        run.token_ids.append(tok)
    return run


def _gpu_peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _measure(
    arm: str,
    model: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    device: torch.device,
    time_limit_s: float | None,
    warmup_tokens: int,
    notes: dict,
) -> dict:
    """Run every prompt through greedy_decode and summarise into one arm dict."""
    if not prompts:
        raise PdflashError("no prompts: give at least one prompt")
    if warmup_tokens > 0:  # discarded: first-call costs (cuBLAS handles, allocator growth)
        greedy_decode(model, prompts[0], warmup_tokens, device)
    _reset_peak(device)
    start = time.perf_counter()
    deadline = start + time_limit_s if time_limit_s is not None else None
    runs: list[GreedyRun] = []
    for p in prompts:
        if runs and deadline is not None and time.perf_counter() > deadline:
            break
        runs.append(greedy_decode(model, p, new_tokens, device, deadline))
    steps = [s for r in runs for s in r.step_s]
    decode_s = sum(steps)
    tps = len(steps) / decode_s if steps and decode_s > 0 else None
    notes = dict(notes)
    notes.update(
        decode=DECODE_METHOD,
        warmup_tokens=warmup_tokens,
        time_limit_s=time_limit_s,
        stopped_by_time_limit=len(runs) < len(prompts) or any(len(r.token_ids) < new_tokens for r in runs),
        prompts_requested=len(prompts),
        prompts_run=len(runs),
        arm_wall_s=time.perf_counter() - start,
    )
    return {
        "arm": arm,
        "tokens_per_second": tps,
        "ttft_ms": 1000 * sum(r.ttft_s for r in runs) / len(runs),
        "tpot_ms": 1000 * decode_s / len(steps) if steps else None,
        "new_tokens": new_tokens,
        "decode_tokens": len(steps),  # the tokens tokens_per_second was measured on
        "token_ids": [r.token_ids for r in runs],
        "gpu_memory_peak_gib": _gpu_peak_gib(device),
        "per_prompt": [
            {"prompt_tokens": len(p), "ttft_ms": 1000 * r.ttft_s, "step_ms": [1000 * s for s in r.step_s]}
            for p, r in zip(prompts, runs)
        ],
        "notes": notes,
    }


def _model_notes(model: nn.Module) -> dict:
    import transformers

    cfg = model.config
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": cfg._attn_implementation,
        "experts_implementation": getattr(cfg, "_experts_implementation", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }


# -- arms ------------------------------------------------------------------------------------
def run_resident_arm(
    model: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    time_limit_s: float | None = None,
    warmup_tokens: int = 4,
) -> dict:
    """``transformers-resident``: the model as loaded (every weight on one device)."""
    device = next(model.parameters()).device
    notes = _model_notes(model)
    notes["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    return _measure(RESIDENT, model, prompts, new_tokens, device, time_limit_s, warmup_tokens, notes)


def offload_device_map(
    model: nn.Module,
    gpu_budget_bytes: int,
    cpu_budget_bytes: int | None = None,
    gpu_index: int = 0,
) -> dict[str, int | str]:
    """accelerate's device map for ``model`` with GPU ``gpu_index`` capped at ``gpu_budget_bytes``.

    Modules are placed in registration order (embeddings, decoder layers, norm, head); a
    decoder layer is never split; once a module does not fit, it and everything after it go
    to "cpu" (accelerate keeps room for the largest offloaded layer on the GPU). ``model``
    may live on the meta device. Raises PdflashError when nothing fits on the GPU or the CPU
    budget is too small (accelerate would need a disk).
    """
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    if gpu_budget_bytes <= 0:
        raise PdflashError(f"the GPU budget must be positive, got {gpu_budget_bytes} bytes")
    total = compute_module_sizes(model)[""]
    cpu = cpu_budget_bytes if cpu_budget_bytes is not None else total + GIB
    dmap = infer_auto_device_map(
        model,
        max_memory={gpu_index: int(gpu_budget_bytes), "cpu": int(cpu)},
        no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []),
    )
    devices = set(dmap.values())
    if "disk" in devices:
        raise PdflashError(f"the CPU budget ({cpu / GIB:.1f} GiB) cannot hold the offloaded modules: raise it")
    if gpu_index not in devices:
        raise PdflashError(
            f"a GPU budget of {gpu_budget_bytes / GIB:.2f} GiB holds not even the first module: raise it"
        )
    return dict(dmap)


def placement(dmap: dict, module: str) -> int | str:
    """Device of ``module`` under a device map whose keys may be any of its ancestors."""
    owners = [k for k in dmap if k == "" or module == k or module.startswith(k + ".")]
    if not owners:
        raise KeyError(f"{module} is not covered by the device map")
    return dmap[max(owners, key=len)]


def _map_summary(model: nn.Module, dmap: dict) -> dict:
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    on_gpu = [m for m, d in dmap.items() if d != "cpu"]
    on_cpu = [m for m, d in dmap.items() if d == "cpu"]
    layers = [placement(dmap, f"model.layers.{i}") for i in range(len(model.model.layers))]
    return {
        "modules_on_gpu": on_gpu,
        "modules_on_cpu": on_cpu,
        "decoder_layers_on_gpu": sum(1 for d in layers if d != "cpu"),
        "decoder_layers_on_cpu": sum(1 for d in layers if d == "cpu"),
        "gpu_weights_gib": sum(sizes[m] for m in on_gpu) / GIB,
        "offloaded_weights_gib_per_forward": sum(sizes[m] for m in on_cpu) / GIB,
    }


def run_accelerate_offload_arm(
    model: nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    gpu_budget_bytes: int,
    *,
    cpu_budget_bytes: int | None = None,
    gpu_index: int = 0,
    time_limit_s: float | None = None,
    warmup_tokens: int = 0,
) -> dict:
    """``transformers-accelerate-offload``: ``model`` (all weights on the CPU) dispatched by
    accelerate with the GPU capped at ``gpu_budget_bytes``, then decoded.

    The model is consumed: dispatch attaches hooks and moves or offloads its weights;
    delete it afterwards. Offloaded weights stay in ordinary (pageable) host memory, as
    accelerate leaves them by default.
    """
    from accelerate import dispatch_model

    if not torch.cuda.is_available():
        raise PdflashError(f"the {ACCELERATE_OFFLOAD} arm needs a CUDA GPU")
    for name, p in model.named_parameters():
        if p.device.type != "cpu":
            raise PdflashError(f"internal: {ACCELERATE_OFFLOAD} expects the model on the CPU, {name} is on {p.device}")
    notes = _model_notes(model)
    dmap = offload_device_map(model, gpu_budget_bytes, cpu_budget_bytes, gpu_index)
    notes.update(_map_summary(model, dmap))
    notes["gpu_budget_gib"] = gpu_budget_bytes / GIB
    notes["device_map"] = {k: (v if isinstance(v, str) else f"cuda:{v}") for k, v in dmap.items()}
    device = torch.device("cuda", gpu_index)
    t0 = time.perf_counter()
    dispatch_model(model, device_map=dmap, main_device=gpu_index, skip_keys=[_cache_kwarg(model)])
    notes["dispatch_s"] = time.perf_counter() - t0
    return _measure(ACCELERATE_OFFLOAD, model, prompts, new_tokens, device, time_limit_s, warmup_tokens, notes)


# -- the whole comparison ---------------------------------------------------------------------
@dataclass
class PeerConfig:
    """What ``run_peers`` measures. Budgets in GiB (2**30 bytes)."""

    model_dir: str
    prompts: list[list[int]]
    gpu_budget_gib: float | None = None  # needed by the accelerate arm
    arms: tuple[str, ...] = ARMS
    new_tokens: int = 32  # per prompt, resident arm
    offload_new_tokens: int = 4  # per prompt, accelerate arm (seconds per token)
    time_limit_s: float | None = 120.0  # per arm, decode loop only
    warmup_tokens: int = 4  # resident arm; the accelerate arm runs none
    cpu_budget_gib: float | None = None
    dtype: str = "bfloat16"
    attn_implementation: str = "eager"
    experts_implementation: str | None = None
    device: str = "cuda"

    def __post_init__(self):
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise PdflashError(f"unknown peer arm {unknown[0]!r}: choose from {', '.join(ARMS)}")
        if not self.arms:
            raise PdflashError("no peer arm selected")
        if not self.prompts or any(not p for p in self.prompts):
            raise PdflashError("give at least one non-empty prompt")
        if self.new_tokens < 1 or self.offload_new_tokens < 1:
            raise PdflashError("new_tokens and offload_new_tokens must be at least 1")
        if ACCELERATE_OFFLOAD in self.arms:
            if self.gpu_budget_gib is None or self.gpu_budget_gib <= 0:
                raise PdflashError(f"the {ACCELERATE_OFFLOAD} arm needs a positive GPU budget in GiB")
            if not torch.cuda.is_available():
                raise PdflashError(f"the {ACCELERATE_OFFLOAD} arm needs a CUDA GPU; run it on a GPU machine or drop it")
        if self.time_limit_s is not None and self.time_limit_s < 0:
            raise PdflashError("the time limit must not be negative")
        parse_dtype(self.dtype)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def failed_arm(arm: str, new_tokens: int, exc: BaseException) -> dict:
    """The dict of an arm that raised: nothing measured, the error in notes."""
    return {
        "arm": arm,
        "tokens_per_second": None,
        "ttft_ms": None,
        "tpot_ms": None,
        "new_tokens": new_tokens,
        "decode_tokens": 0,
        "token_ids": [],
        "gpu_memory_peak_gib": None,
        "per_prompt": [],
        "notes": {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                  "traceback": traceback.format_exc(limit=-6)},
    }


def run_peers(cfg: PeerConfig, log=lambda msg: None) -> list[dict]:
    """Every arm of ``cfg`` in order, one dict per arm; GPU memory is freed between arms.

    The model is loaded once: on ``cfg.device`` for the resident arm, then moved to the CPU for
    the accelerate arm (or built on the CPU, dequantized on the GPU, when it runs alone).
    An arm that fails at run time (out of memory, a kernel transformers cannot run here) is
    reported by :func:`failed_arm` and the next arm still runs; PdflashError propagates.
    """
    device = torch.device(cfg.device)
    dtype = parse_dtype(cfg.dtype)
    opts = {"attn_implementation": cfg.attn_implementation, "experts_implementation": cfg.experts_implementation}
    results, model = [], None
    if RESIDENT in cfg.arms:
        try:
            log(f"{RESIDENT}: loading {cfg.model_dir} onto {device}")
            t0 = time.perf_counter()
            model = load_transformers_reference(cfg.model_dir, device, dtype, **opts)
            load_s = time.perf_counter() - t0
            log(f"{RESIDENT}: loaded in {load_s:.1f} s; decoding {len(cfg.prompts)} prompts x {cfg.new_tokens} tokens")
            res = run_resident_arm(
                model, cfg.prompts, cfg.new_tokens, time_limit_s=cfg.time_limit_s, warmup_tokens=cfg.warmup_tokens
            )
            res["notes"]["load_s"] = load_s
        except PdflashError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded in the result, the next arm still runs
            log(f"{RESIDENT}: failed: {type(exc).__name__}: {exc}")
            res = failed_arm(RESIDENT, cfg.new_tokens, exc)
        results.append(res)
        log(f"{RESIDENT}: {_summary(res)}")
    if ACCELERATE_OFFLOAD in cfg.arms:
        try:
            t0 = time.perf_counter()
            if model is not None:
                log(f"{ACCELERATE_OFFLOAD}: moving the model to the CPU")
                model = model.to("cpu")
            else:
                log(f"{ACCELERATE_OFFLOAD}: loading {cfg.model_dir} onto the CPU")
                model = load_transformers_reference(cfg.model_dir, "cpu", dtype, dequant_device=device, **opts)
            _free(device)
            load_s = time.perf_counter() - t0
            log(f"{ACCELERATE_OFFLOAD}: dispatching with {cfg.gpu_budget_gib:.2f} GiB of GPU; "
                f"decoding {len(cfg.prompts)} prompts x {cfg.offload_new_tokens} tokens")
            cpu = int(cfg.cpu_budget_gib * GIB) if cfg.cpu_budget_gib is not None else None
            res = run_accelerate_offload_arm(
                model, cfg.prompts, cfg.offload_new_tokens, int(cfg.gpu_budget_gib * GIB),
                cpu_budget_bytes=cpu, gpu_index=device.index or 0, time_limit_s=cfg.time_limit_s,
            )
            res["notes"]["load_s"] = load_s
        except PdflashError:
            raise
        except Exception as exc:  # noqa: BLE001
            log(f"{ACCELERATE_OFFLOAD}: failed: {type(exc).__name__}: {exc}")
            res = failed_arm(ACCELERATE_OFFLOAD, cfg.offload_new_tokens, exc)
        results.append(res)
        log(f"{ACCELERATE_OFFLOAD}: {_summary(res)}")
    del model
    _free(device)
    return results


def _summary(res: dict) -> str:
    if "error" in res["notes"]:
        return f"error ({res['notes']['error']})"
    tps = res["tokens_per_second"]
    speed = f"{tps:.3g} tokens/s" if tps is not None else "tokens/s not measured"
    return f"{speed} over {res['decode_tokens']} decode tokens, TTFT {res['ttft_ms']:.1f} ms"


# -- budgets and ratios -----------------------------------------------------------------------
def gpu_budget_bytes(model_dir: str | Path, cache_fraction: float, dtype: torch.dtype | str = torch.bfloat16) -> int:
    """pdflash's GPU weight memory for ``model_dir``: the non-expert weights in ``dtype`` plus
    ``cache_fraction`` of all experts in their stored format (MXFP4 bytes for MXFP4 checkpoints),
    as pdflash's expert cache holds them. Slot alignment and activations are not counted:
    pass the measured figure instead where one exists.
    """
    if not 0 <= cache_fraction <= 1:
        raise PdflashError(f"the cache fraction must be between 0 and 1, got {cache_fraction}")
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    dense_elem = torch.empty((), dtype=dtype).element_size()
    ckpt = _open(model_dir)
    try:
        dense = experts = 0
        for name, spec in ckpt.family.tensor_specs().items():
            numel = math.prod(spec.shape)
            if spec.expert:
                experts += numel * ckpt.dtype(name).itemsize
            elif not name.endswith("_scale_inv"):  # FP8 scales are folded into their dequantized weights
                dense += numel * dense_elem
    finally:
        ckpt.close()
    return dense + math.ceil(cache_fraction * experts)


def tokens_per_second_ratios(pdflash_result: dict, peer_results: list[dict]) -> dict[str, dict]:
    """{peer arm: {ratio, pdflash_tokens_per_second, peer_tokens_per_second, peer_decode_tokens}}.

    ratio = pdflash tokens/s / peer tokens/s (above 1: pdflash is faster); None when either
    side was not measured.
    """
    ours = pdflash_result.get("tokens_per_second")
    out = {}
    for r in peer_results:
        theirs = r.get("tokens_per_second")
        ok = ours is not None and theirs is not None and theirs > 0
        out[r["arm"]] = {
            "ratio": ours / theirs if ok else None,
            "pdflash_tokens_per_second": ours,
            "peer_tokens_per_second": theirs,
            "peer_decode_tokens": r.get("decode_tokens"),
        }
    return out
