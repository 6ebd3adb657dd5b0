"""The prompt's way into a KV cache: a context check, then fixed-size chunks.

A prompt of T tokens run in one forward makes eager attention hold a [heads, T, T] score
matrix per layer, so memory grows with T squared. Run through the KV cache in chunks of C
tokens, each chunk attends to the positions already cached plus its own: [heads, C, T] at
most, memory linear in T, and the same keys, values and logits as one forward (every chunk
sees exactly the positions it would have seen; tests/test_prompt.py checks it).

Every prefill in pdflash goes through :func:`chunked_prefill`: plain decoding
(offload/generate.py), the graphed decoder (offload/graphs.py) and speculative decoding
(draft/speculative.py).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from pdflash import PdflashError

PREFILL_CHUNK = 512  # prompt tokens per prefill forward

T = TypeVar("T")


def context_length(config) -> int | None:
    """The model's context (``max_position_embeddings``), or None when the config does not say."""
    n = config.get("max_position_embeddings") if isinstance(config, dict) else getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def check_context(config, prompt_tokens: int, max_new_tokens: int) -> None:
    """PdflashError unless the prompt and the tokens to generate fit the model's context."""
    ctx = context_length(config)
    if ctx is None:
        return
    need = prompt_tokens + max_new_tokens
    if need > ctx:
        room, prompt_room = ctx - prompt_tokens, ctx - max_new_tokens
        if room >= 1:
            fix = f"lower --max-new-tokens to {room} or less, or shorten the prompt"
        elif prompt_room >= 1:
            fix = f"shorten the prompt to {prompt_room} tokens or fewer"
        else:
            fix = f"lower --max-new-tokens below {ctx} and shorten the prompt"
        raise PdflashError(
            f"the prompt is {prompt_tokens} tokens and {max_new_tokens} more are to be generated, {need} positions, "
            f"but the model's context holds {ctx}: {fix}"
        )


def chunked_prefill(run_chunk: Callable[[torch.Tensor, int], T], ids: torch.Tensor, chunk: int | None = None) -> T:
    """Run the prompt ``ids`` [1, T] as consecutive chunks of at most ``chunk`` tokens.

    ``run_chunk(chunk_ids [1, c], start)`` runs one chunk at positions start .. start+c-1 through
    the caller's KV cache and returns what the caller needs (e.g. the last position's logits);
    the value returned by the last chunk is returned.
    """
    size = PREFILL_CHUNK if chunk is None else int(chunk)
    if size < 1:
        raise ValueError(f"the prefill chunk must be at least 1 token, got {size}")
    total = int(ids.shape[-1])
    if total == 0:
        raise PdflashError("the prompt is empty: give at least one token")
    out = None
    for start in range(0, total, size):
        out = run_chunk(ids[..., start:start + size], start)
    return out
