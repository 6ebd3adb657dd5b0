"""Token generation on an OffloadedModel: free functions, one KV cache, batch 1.

    result = generate(rt, input_ids, max_new_tokens=64, temperature=0.0, seed=0)
    result.token_ids, result.ttft_ms, result.tpot_ms, result.tokens_per_second, result.stats

Timing: ttft_ms is prompt in -> first token chosen (prefill); tpot_ms is the mean
time per token after the first; tokens_per_second is the decode rate, (n - 1) /
decode time. With one generated token the decode figures are None (not measured).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdflash import GenerationInterrupted, PdflashError
from pdflash.offload.prompt import check_context, chunked_prefill


@dataclass
class StepInfo:
    """Passed to ``on_step`` after each generated token."""

    index: int  # 0 for the first generated token
    token_id: int
    elapsed_s: float  # since generate() started
    tokens_per_second: float | None  # decode rate so far


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids (prompt excluded)
    prompt_tokens: int
    stop_reason: str  # "eos" or "length"
    ttft_ms: float
    tpot_ms: float | None
    tokens_per_second: float | None
    total_s: float
    stats: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(rt, input_ids: torch.Tensor, kv, chunk: int | None = None) -> torch.Tensor:
    """Run the prompt [1, T] in chunks through ``kv`` (offload/prompt.py); returns the last
    position's logits [1, V] (float32)."""

    def run_chunk(ids: torch.Tensor, start: int) -> torch.Tensor:
        return rt.forward(ids, cache=kv, logits_to_keep=1).logits[:, -1, :]

    return chunked_prefill(run_chunk, input_ids, chunk).float()


def decode_one_token(rt, token_id: int, kv) -> torch.Tensor:
    """Feed one token; returns its next-token logits [1, V] (float32)."""
    ids = torch.tensor([[token_id]], dtype=torch.long)
    out = rt.forward(ids, cache=kv)
    return out.logits[:, -1, :].float()


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy (argmax) when temperature == 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(torch.argmax(logits[0]).item())
    probs = torch.softmax(logits[0].to("cpu") / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def generate(
    rt,
    input_ids: torch.Tensor | list[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    on_step: Callable[[StepInfo], None] | None = None,
    eos_token_ids: list[int] | None = None,
    cuda_graphs: bool = False,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([T] or [1, T]).

    The prompt and ``max_new_tokens`` must fit the model's context (PdflashError otherwise);
    the prompt runs in chunks (offload/prompt.py). Ctrl-C raises
    :class:`pdflash.GenerationInterrupted` carrying the tokens generated so far.

    Stops early at any of ``eos_token_ids`` (default: the checkpoint's eos ids; pass []
    to never stop early). ``stats`` in the result is ``rt.stats()`` at the end
    (cumulative since load or the last reset_cache()).

    ``cuda_graphs`` decodes through graphs.GraphedDecoder: each layer's non-expert part replayed
    as a CUDA graph (captured before the prompt runs, so outside the timings).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise PdflashError(f"input_ids must be one sequence [T] or [1, T], got shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise PdflashError("the prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise PdflashError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise PdflashError(f"temperature must be >= 0, got {temperature}")
    check_context(rt.config, int(ids.shape[1]), max_new_tokens)
    eos = set(rt.eos_token_ids if eos_token_ids is None else eos_token_ids)
    gen = torch.Generator().manual_seed(seed)
    dev = rt.device
    if cuda_graphs:
        from pdflash.offload.graphs import GraphedDecoder

        if dev.type != "cuda":
            raise PdflashError("--cuda-graphs needs --device cuda")
        dec = GraphedDecoder(rt, max_len=int(ids.shape[1]) + max_new_tokens, graphs=True)
        rt.begin_sequence(max_new_tokens)  # before the captures: a short run needs only its first arm's
        dec.prepare(int(ids.shape[1]))  # the bucket of the first decode step
        step_prefill, step_decode = dec.prefill, dec.decode
    else:
        from pdflash.offload.warmup import warm_linears

        with rt.decode_threads():  # the decode shape's first-call setup, before the prompt
            warm_linears([rt.model], [1])
        kv = rt.new_kv_cache()
        rt.begin_sequence(max_new_tokens)  # a short run may keep the guard's first arm unchecked
        step_prefill = lambda p: prefill(rt, p, kv)  # noqa: E731
        step_decode = lambda t: decode_one_token(rt, t, kv)  # noqa: E731

    out: list[int] = []
    try:
        with rt.decode_threads():  # one PyTorch thread for a small model on the CPU (offload/threads.py)
            t0 = time.perf_counter()
            logits = step_prefill(ids)
            tok = sample(logits, temperature, gen)  # .item() synchronises the device
            t_first = time.perf_counter()
            out.append(tok)
            stop = "eos" if tok in eos else "length"
            if on_step:
                on_step(StepInfo(0, tok, t_first - t0, None))
            while stop == "length" and len(out) < max_new_tokens:
                logits = step_decode(tok)
                tok = sample(logits, temperature, gen)
                out.append(tok)
                if tok in eos:
                    stop = "eos"
                if on_step:
                    now = time.perf_counter()
                    on_step(StepInfo(len(out) - 1, tok, now - t0, (len(out) - 1) / (now - t_first)))
    except KeyboardInterrupt:
        raise GenerationInterrupted(out) from None
    _sync(dev)
    t_end = time.perf_counter()
    n_decode = len(out) - 1
    decode_s = t_end - t_first
    return GenerationResult(
        token_ids=out,
        prompt_tokens=int(ids.shape[1]),
        stop_reason=stop,
        ttft_ms=(t_first - t0) * 1e3,
        tpot_ms=decode_s / n_decode * 1e3 if n_decode else None,
        tokens_per_second=n_decode / decode_s if n_decode and decode_s > 0 else None,
        total_s=t_end - t0,
        stats=rt.stats(),
    )
