"""Lossless speculative decoding with a DFlash draft.

Shape legend: B = block size of this step, V = vocabulary, K*H = concatenated target features.

Per step, with ``start`` = position of the last committed token t (whose target K/V is not yet
cached; the target cache and the draft context both hold ``start`` positions):

1. draft:  one non-causal draft forward over [t, MASK x (B-1)] at positions start .. start+B-1;
           its logits at block positions 1 .. B-1 give proposals x_1 .. x_{B-1}.
2. verify: one target forward over [t, x_1 .. x_{B-1}]; target logits at block position i are
           the distribution of the token after position start+i.
3. accept: greedy — the longest prefix with x_i == argmax(target logits at i-1), plus one token
           from the target at the first mismatch (or after the last proposal): n_acc + 1 tokens.
           sampling — see :func:`accept_sampling`.
4. commit: crop the target cache to start + n_acc + 1 positions (t and the accepted proposals),
           hand the draft the target features of those same positions (appended in one batch
           by the next draft forward, in the same pass over its layers, so plain steps pay
           nothing for the draft).

With a block planner (``--block-size auto``, :mod:`pdflash.draft.planner`) B changes per step:
B = 1 skips the draft (a plain step through the verify path). With a ``GraphedDecoder`` the
target forwards are its static-cache segments, replayed as CUDA graphs per block length
(``pdflash.offload.graphs``).

Greedy output is token-for-token the target's own greedy output: every committed token is the
target's argmax given the committed prefix, computed in the verify forward.

The target is a transformers MoE causal LM of a supported family (gpt-oss, Qwen3-MoE): a plain model, or the offload
runtime's model (the same module with its experts swapped). The target's KV cache is a
``DynamicCache`` without a config, so every layer keeps full length and can be cropped at any
length; sliding-window layers still attend only within their window through the attention mask.
"""

from __future__ import annotations

import functools
import inspect
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pdflash import GenerationInterrupted, PdflashError
from pdflash.draft.model import DFlashDraftModel
from pdflash.draft.oracle import OracleProposer
from pdflash.draft.planner import BlockPlanner
from pdflash.draft.route_ahead import RouteAhead
from pdflash.draft.taps import FeatureTap
from pdflash.offload.prompt import chunked_prefill


# -- target calls -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_kwarg(target: nn.Module) -> str:
    """Name of the KV-cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return _cache_kwarg_of(type(target))


def new_target_cache():
    from transformers import DynamicCache

    return DynamicCache()


def target_forward(target: nn.Module, ids: torch.Tensor, start: int, cache, logits_to_keep: int = 0) -> torch.Tensor:
    """Run the target on ids [1, T] at positions start .. start+T-1 -> logits [1, T or keep, V]."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    kwargs = {_cache_kwarg(target): cache}
    out = target(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    return out.logits


def crop_cache(cache, length: int) -> None:
    """Cut the target cache back to ``length`` positions (negative crop: portable across versions)."""
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise RuntimeError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if extra:
        cache.crop(-extra)


class _ModuleTarget:
    """The target module itself: a DynamicCache, forward hooks for the draft's features."""

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]):
        self.target = target
        self.cache = new_target_cache()
        self.taps = FeatureTap(target, layer_ids) if layer_ids else None

    def _capture(self):
        return self.taps.capture() if self.taps is not None else nullcontext()

    def _take(self):
        return self.taps.take() if self.taps is not None else None

    def prefill(self, ids: list[int], route_ahead: RouteAhead | None):
        """The prompt in chunks through the KV cache (bounded memory); the last position's logits
        and every position's tapped features."""
        device = _device_of(self.target)
        feats = []

        def run(chunk: torch.Tensor, start: int) -> torch.Tensor:
            with self._capture():
                out = target_forward(self.target, chunk, start, self.cache, logits_to_keep=1)
            f = self._take()
            if f is not None:
                feats.append(f)
            return out

        with route_ahead.prefill() if route_ahead else nullcontext():
            logits = chunked_prefill(run, torch.tensor([ids], device=device))
        return logits[0, -1], (torch.cat(feats, dim=1) if feats else None)

    def verify(self, ids: list[int], start: int, route_ahead: RouteAhead | None):
        block = torch.tensor([ids], device=_device_of(self.target))  # [1, b]
        with self._capture(), (route_ahead.verify() if route_ahead else nullcontext()):
            vlogits = target_forward(self.target, block, start, self.cache)[0]  # [b, V]
        return vlogits, self._take()

    def commit(self, length: int) -> None:
        crop_cache(self.cache, length)

    def close(self) -> None:
        if self.taps is not None:
            self.taps.close()


class _DecoderTarget:
    """A ``pdflash.offload.graphs.GraphedDecoder``: static KV cache, every block length replayed
    as CUDA graphs (or the same segments run eagerly)."""

    def __init__(self, decoder, layer_ids: Sequence[int]):
        self.decoder = decoder
        decoder.tap_layers = list(layer_ids)

    def prefill(self, ids: list[int], route_ahead: RouteAhead | None):
        with (route_ahead.prefill_on(self.decoder) if route_ahead else nullcontext()):
            logits, features = self.decoder.prefill_with_features(ids)
        return logits[0], features

    def verify(self, ids: list[int], start: int, route_ahead: RouteAhead | None):
        if start != self.decoder.length:
            raise RuntimeError(f"verify block at {start} but the decoder holds {self.decoder.length} positions")
        with (route_ahead.verify_on(self.decoder) if route_ahead else nullcontext()):
            return self.decoder.forward(ids)

    def commit(self, length: int) -> None:
        self.decoder.truncate(length)

    def close(self) -> None:
        self.decoder.tap_layers = []


def _device_of(target: nn.Module) -> torch.device:
    return target.model.embed_tokens.weight.device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy_generate(
    target: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """Plain target-only greedy decoding, one token per forward; returns the generated ids."""
    if not input_ids:
        raise PdflashError("the prompt is empty; give at least one token")
    device = _device_of(target)
    cache = new_target_cache()
    ids = torch.tensor([list(input_ids)], device=device)
    logits = chunked_prefill(lambda chunk, at: target_forward(target, chunk, at, cache, logits_to_keep=1), ids)
    out: list[int] = []
    pos = len(input_ids)
    eos = set(eos_token_ids)
    while len(out) < max_new_tokens:
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in eos or len(out) == max_new_tokens:
            break
        logits = target_forward(target, torch.tensor([[tok]], device=device), pos, cache, logits_to_keep=1)
        pos += 1
    return out


@torch.inference_mode()
def verify_sweep(
    target: nn.Module,
    input_ids: Sequence[int],
    guess: Sequence[int],
    max_new_tokens: int,
    block_size: int,
    *,
    decoder=None,
    eos_token_ids: Sequence[int] = (),
) -> list[int]:
    """The greedy continuation as verify passes compute it (oracle mode's reference).

    Lossless speculative decoding with ``guess`` (e.g. a plain greedy continuation) as the draft:
    blocks of ``block_size`` tokens through the same target path a speculative run uses
    (``decoder``, a fresh ``GraphedDecoder``, or ``target``'s own forward), keeping each block's
    argmaxes up to its first refused guess. Where a block and a single-token step round a near tie
    apart, this follows the block.
    """
    if block_size < 1:
        raise PdflashError(f"block_size must be at least 1, got {block_size}")
    tgt = _ModuleTarget(target, []) if decoder is None else _DecoderTarget(decoder, [])
    eos = set(eos_token_ids)
    prompt = list(input_ids)
    try:
        last, _ = tgt.prefill(prompt, None)
        out = [int(last.argmax())]
        while out[-1] not in eos and len(out) < max_new_tokens:
            start = len(prompt) + len(out) - 1
            b = min(block_size, max_new_tokens - len(out))
            tail = list(guess[len(out): len(out) + b - 1])
            tail += [out[-1]] * (b - 1 - len(tail))
            vlogits, _ = tgt.verify([out[-1]] + tail, start, None)
            n_acc, nxt = accept_greedy(tail, vlogits)
            new = tail[:n_acc] + [nxt]
            tgt.commit(start + len(new))
            for tok in new:
                out.append(tok)
                if tok in eos or len(out) == max_new_tokens:
                    break
        return out
    finally:
        tgt.close()


# -- acceptance rules ---------------------------------------------------------------------------


def accept_greedy(proposals: torch.Tensor | Sequence[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """proposals [n] (token ids, a tensor or a list), target_logits [n+1, V] -> (accepted count, next token).

    Accept x_i while x_i == argmax(target_logits[i]); the next token is the target's argmax at the
    first mismatch (or the bonus after all n). The argmaxes come to the host in one read.
    """
    best = target_logits.float().argmax(-1).tolist()  # in float32: exact, and PyTorch's CPU argmax of bf16 is 2-3x slower
    props = proposals.tolist() if isinstance(proposals, torch.Tensor) else proposals
    n_acc = matching_prefix(props, best)
    return n_acc, best[n_acc]


def matching_prefix(guesses: Sequence[int], best: Sequence[int]) -> int:
    """How many leading guesses equal the target's argmaxes ``best`` (greedy acceptance)."""
    n = 0
    while n < len(guesses) and guesses[n] == best[n]:
        n += 1
    return n


def accept_sampling(
    proposals: torch.Tensor,  # [n]   x_i ~ q_i
    draft_probs: torch.Tensor,  # [n, V] q_i
    target_probs: torch.Tensor,  # [n+1, V] p_i
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling: the committed tokens are distributed exactly as target sampling.

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection i, draw the
    replacement from norm(max(0, p_i - q_i)); if all n are accepted, draw a bonus from p_n.
    Then P(token = y) = min(p(y), q(y)) + (1 - sum_z min(p(z), q(z))) * norm(max(0, p - q))(y)
    = p(y) at every position, given the prefix.
    """
    n = proposals.shape[0]
    if n:
        idx = torch.arange(n, device=proposals.device)
        p_x = target_probs[idx, proposals]
        q_x = draft_probs[idx, proposals]
        u = torch.rand(n, device=proposals.device, generator=generator)
        ok = (u * q_x) <= p_x  # u < p/q without dividing; q_x > 0 because x was drawn from q
        n_acc = int(ok.long().cumprod(0).sum())
    else:
        n_acc = 0
    if n_acc < n:
        residual = (target_probs[n_acc] - draft_probs[n_acc]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if float(total) > 0 else target_probs[n_acc]
    else:
        dist = target_probs[n]
    nxt = int(torch.multinomial(dist, 1, generator=generator))
    return n_acc, nxt


def _accept(guesses: list[int], proposals: torch.Tensor | None, draft_probs: torch.Tensor | None,
            vlogits: torch.Tensor, tokens: list[int], oracle, greedy: bool, temperature: float,
            generator) -> tuple[int, int]:
    """A verify block's outcome: (accepted proposals, next token). ``guesses``: the block's
    proposals as ids; ``proposals`` [n] and ``draft_probs`` [n, V]: the same on the device and
    their draft probabilities (sampling; None where nothing was drafted); ``tokens``: the sequence
    before the block (the oracle records what the target chose there). Reads the outcome to the
    host: the device is synchronised after it."""
    block = [tokens[-1]] + guesses
    if oracle is not None:
        best = vlogits.float().argmax(-1).tolist()
        oracle.observe(len(tokens), block, best)
        n_acc = matching_prefix(guesses[: oracle.limit()], best)
        return n_acc, best[n_acc]
    if greedy:
        return accept_greedy(guesses, vlogits)
    if proposals is None:
        proposals = torch.empty(0, dtype=torch.long, device=vlogits.device)
    if draft_probs is None:
        draft_probs = vlogits.new_empty((0, vlogits.shape[-1]))
    return accept_sampling(proposals, draft_probs, _probs(vlogits, temperature), generator)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


class RepeatIndex:
    """Whether the sequence's last ``n`` tokens occurred earlier in it (the planner's hint that the
    text copies itself), and what followed them the last time; updated incrementally as tokens
    are committed."""

    def __init__(self, tokens: Sequence[int], n: int = 3):
        self.n = n
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> position just after its latest earlier occurrence
        self.indexed = 0  # n-grams ending before this position are in ``after``
        self._index(tokens, len(tokens) - 1)

    def _index(self, tokens: Sequence[int], end: int) -> None:
        for i in range(max(self.indexed, self.n), end + 1):
            self.after[tuple(tokens[i - self.n: i])] = i
        self.indexed = max(self.indexed, end + 1)

    def repeating(self, tokens: Sequence[int]) -> bool:
        """True if tokens[-n:] also ends at an earlier position."""
        if len(tokens) <= self.n:
            return False
        self._index(tokens, len(tokens) - 1)
        return tuple(tokens[-self.n:]) in self.after

    def continuation(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of tokens[-n:] ([] if none)."""
        if len(tokens) <= self.n or k < 1:
            return []
        self._index(tokens, len(tokens) - 1)
        i = self.after.get(tuple(tokens[-self.n:]))
        return [] if i is None else list(tokens[i: i + k])


# -- statistics ---------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What one speculative step did (passed to ``on_step``)."""

    step: int
    block_size: int
    accepted: int  # proposals accepted (0 .. block_size-1)
    committed: list[int]  # tokens appended to the output this step
    generated: int  # output length after this step
    draft_seconds: float
    verify_seconds: float
    route_ahead_submitted: int  # (layer, expert) pairs sent to the prefetcher this step
    predicted_seconds: float | None = None  # the block planner's prediction of this step (auto)
    planner_measured_seconds: float | None = None  # the same step in the planner's clock
    shadow_block: int = 0  # a shadow probe: positions drafted but not verified (block_size is 1)


@dataclass
class SpeculativeStats:
    """Counters of one speculative generation. Position i (1-based) is the i-th draft token."""

    block_size: int
    verify_steps: int = 0
    committed_tokens: int = 0  # tokens committed by verify steps (accepted proposals + one each)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0  # prompt in -> first token chosen
    decode_seconds: float = 0.0  # first token -> last token (oracle refreshes excluded)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    blocks: dict[int, int] = field(default_factory=dict)  # verified block length -> steps
    decode_bytes: float | None = None  # bytes over the link between the first and the last token
    copied_steps: int = 0  # steps whose leading proposals were copied from earlier text (lookup)

    def __post_init__(self) -> None:
        if not self.drafted_per_position:
            self.drafted_per_position = [0] * (self.block_size - 1)
            self.accepted_per_position = [0] * (self.block_size - 1)

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.committed_tokens += accepted + 1
        self.blocks[drafted + 1] = self.blocks.get(drafted + 1, 0) + 1
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verify pass (1 = no proposal ever accepted)."""
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of the blocks that drafted position i in which position i was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def block_histogram(self) -> dict[str, int]:
        return {str(b): n for b, n in sorted(self.blocks.items())}

    @property
    def bytes_per_committed_token(self) -> float | None:
        """Link bytes of the decode phase per token committed by verify steps (None unmeasured)."""
        if self.decode_bytes is None or not self.committed_tokens:
            return None
        return self.decode_bytes / self.committed_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "block_histogram": self.block_histogram(),
            "bytes_per_committed_token": self.bytes_per_committed_token,
            "verify_steps": self.verify_steps,
            "committed_tokens": self.committed_tokens,
            "acceptance_length": self.acceptance_length,
            "acceptance_per_position": self.acceptance_per_position,
            "prefill_ms": 1e3 * self.prefill_seconds,
            "decode_ms": 1e3 * self.decode_seconds,
            "draft_ms": 1e3 * self.draft_seconds,
            "verify_ms": 1e3 * self.verify_seconds,
            "copied_steps": self.copied_steps,
        }


@dataclass
class SpeculativeResult:
    token_ids: list[int]  # generated ids (prompt excluded)
    stats: SpeculativeStats
    route_ahead: dict[str, Any] | None = None
    oracle: dict[str, Any] | None = None  # present (with "oracle_acceptance") only in oracle mode
    planner: dict[str, Any] | None = None  # the block planner's report (--block-size auto)
    verify_rows: int | None = None  # fixed rows of every verify forward (batch-invariant verify), or None
    # oracle mode's check whether verify blocks round as single steps (draft/offloaded.py rows_agree):
    # "agree" (no fixed rows needed), "differ" (fixed rows), None (not checked)
    verify_rows_check: str | None = None

    @property
    def tokens_per_second(self) -> float | None:
        """Decode rate after the first token, (n - 1) / decode time; None with one token."""
        n = len(self.token_ids) - 1
        return n / self.stats.decode_seconds if n > 0 and self.stats.decode_seconds > 0 else None

    def to_dict(self) -> dict[str, Any]:
        out = {"token_ids": self.token_ids, "tokens_per_second": self.tokens_per_second, **self.stats.to_dict()}
        out["verify_rows"] = self.verify_rows
        out["verify_rows_check"] = self.verify_rows_check
        if self.route_ahead is not None:
            out["route_ahead"] = self.route_ahead
        if self.oracle is not None:
            out.update(self.oracle)
        if self.planner is not None:
            out["planner"] = self.planner
        return out


def check_block_size(block_size: int | None, trained: int) -> int:
    """The verify block size to use: ``block_size`` in [1, trained], or ``trained`` when None."""
    if block_size is None:
        return trained
    if not 1 <= block_size <= trained:
        raise PdflashError(
            f"--block-size must be between 1 and the draft's trained block size {trained}, got {block_size}"
        )
    return block_size


# -- the loop -----------------------------------------------------------------------------------


@torch.inference_mode()
def speculative_generate(
    target: nn.Module,
    draft: DFlashDraftModel,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    block_size: int | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_ids: Sequence[int] = (),
    route_ahead: RouteAhead | None = None,
    oracle: OracleProposer | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    planner: BlockPlanner | None = None,
    moved_bytes: Callable[[], float] | None = None,
    decoder=None,
    lookup: bool = True,
) -> SpeculativeResult:
    """Generate up to ``max_new_tokens`` after ``input_ids`` with draft-then-verify steps.

    ``temperature`` 0 is greedy (lossless: identical to target-only greedy); > 0 samples with
    speculative sampling (``generator`` on the target's device makes it reproducible).
    ``block_size`` may lower the draft's trained block size (1 = no proposals, plain decoding
    through the verify path). ``oracle`` switches on oracle-acceptance mode (greedy only).
    ``planner`` (a :class:`~pdflash.draft.planner.BlockPlanner`, ``--block-size auto``) picks each
    step's block length in 1 .. its ``max_block``; ``block_size`` is then ignored.
    ``moved_bytes`` (cumulative link bytes) measures the decode phase's bytes per committed token.
    ``decoder`` (a ``GraphedDecoder`` over ``target``'s runtime, holding prompt + max_new_tokens
    positions) runs the prefill and every verify block instead of ``target``'s own forward.
    ``lookup`` (greedy, no oracle): when the last 3 committed tokens occurred earlier and what
    followed them then differs from the draft's first proposal, those tokens replace the draft's
    leading proposals (the verify pass decides; output unchanged).
    """
    if not input_ids:
        raise PdflashError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise PdflashError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise PdflashError(f"temperature must be >= 0, got {temperature}")
    if oracle is not None and temperature > 0:
        raise PdflashError("oracle-acceptance mode (--draft-acceptance) needs greedy decoding (--temperature 0)")
    if planner is not None:
        b_max = check_block_size(planner.max_block, draft.config.block_size)
    else:
        b_max = check_block_size(block_size, draft.config.block_size)
    greedy = temperature == 0
    device = _device_of(target)
    stats = SpeculativeStats(block_size=b_max)
    draft.reset_context()
    eos = set(eos_token_ids)
    tokens = list(input_ids)
    generated: list[int] = []
    layer_ids = draft.config.target_layer_ids
    tgt = _ModuleTarget(target, layer_ids) if decoder is None else _DecoderTarget(decoder, layer_ids)
    try:
        # Prefill: target over the prompt; logits of the last position only, features of all.
        t0 = time.perf_counter()
        last_logits, features = tgt.prefill(tokens, route_ahead)
        pending = [features]  # target features not yet in the draft's context (appended before a draft)
        if greedy:
            first = int(last_logits.argmax())
        else:
            first = int(torch.multinomial(_probs(last_logits, temperature), 1, generator=generator))
        tokens.append(first)
        generated.append(first)
        _sync(device)
        stats.prefill_seconds = time.perf_counter() - t0
        done = first in eos
        t_decode = time.perf_counter()
        bytes_at_start = moved_bytes() if moved_bytes is not None else None
        refresh_at_start = oracle.refresh_seconds if oracle else 0.0

        repeats = RepeatIndex(tokens)
        step = 0
        while not done and len(generated) < max_new_tokens:
            start = len(tokens) - 1
            limit = min(b_max, max_new_tokens - len(generated))  # one verify commits at most b tokens
            # The repetition hint says a draft that reads the text would follow it; the oracle's
            # proposals ignore the text (their acceptance is P wherever it repeats).
            repeating = planner is not None and oracle is None and repeats.repeating(tokens)
            if planner is not None and planner.decide_plain(limit, repeating):
                b = 1  # a plain step decided ahead: nothing priced, no probe due, nothing drafted
            elif planner is not None:
                planner.begin_step()
                b = planner.plan_draft(limit, repeating, can_shadow=greedy)
            else:
                b = limit
            n = b - 1
            plain_step = planner is not None and n == 0  # no proposals, no route-ahead: plain decoding
            shadow = planner.shadow_block if plain_step else 0  # a probe drafted but not verified
            drafted = max(b, planner.draft_block) if planner is not None else b  # overdraft: past the block
            tail: list[int] = []  # proposals drafted past the verified block, checked against later tokens
            # 1. draft (a block of `drafted`)
            t_draft = time.perf_counter()
            refresh_before = oracle.refresh_seconds if oracle else 0.0
            if route_ahead is not None and not plain_step:
                route_ahead.begin_step()
            proposals = draft_probs = None  # [n], [n, V] where drafted
            if drafted > 1:
                context = torch.cat(pending, dim=1) if len(pending) > 1 else pending[0]
                pending = []
                hidden = draft(draft.block_ids(tokens[-1], drafted, device), start, context=context)  # [1, drafted, H]
                if route_ahead is not None and not plain_step:
                    route_ahead.after_draft(hidden[:, :b])
                if greedy:
                    proposals = draft.propose(hidden[0, 1:])  # [n]
                else:
                    draft_probs = _probs(draft.head(hidden[:, 1:])[0], temperature)  # [n, V]
                    proposals = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
                if oracle is not None:
                    proposals = torch.tensor(oracle.propose(tokens, drafted - 1), dtype=torch.long, device=device)
                elif greedy and lookup:  # the text copies itself: what followed last time leads the block
                    copied = repeats.continuation(tokens, drafted - 1)
                    if copied and copied[0] != int(proposals[0]):
                        proposals = torch.cat((torch.tensor(copied, dtype=torch.long, device=device),
                                               proposals[len(copied):]))
                        if not shadow:  # a copy counts where its block is verified
                            stats.copied_steps += 1
                if drafted > b:  # a shadow probe (b = 1) or an overdraft: checked against later tokens
                    checked = proposals.tolist()
                    if oracle is not None:  # the draws refuse what follows their accepted run
                        lim = oracle.limit()
                        checked = checked[:lim] + [-1] * (len(checked) - lim)
                    if shadow:
                        planner.shadow_proposals(checked)
                    else:
                        tail = checked[n:]
                    proposals = proposals[:n]
            if drafted > 1:
                _sync(device)
            draft_s = time.perf_counter() - t_draft - ((oracle.refresh_seconds - refresh_before) if oracle else 0.0)
            if planner is not None and drafted > 1:
                planner.after_draft(drafted, draft_s)

            # 2. verify
            t_verify = time.perf_counter()
            guesses = proposals.tolist() if n else []  # [n]; a plain step reads nothing from the device
            block = [tokens[-1]] + guesses  # [b]
            vlogits, features = tgt.verify(block, start, None if plain_step else route_ahead)  # [b, V], [1, b, K*H]

            # 3. accept
            n_acc, nxt = _accept(guesses, proposals, draft_probs, vlogits, tokens, oracle, greedy, temperature,
                                 generator)  # read to the host: the device is synchronised

            # 4. commit
            tgt.commit(start + n_acc + 1)
            pending.append(features[:, : n_acc + 1])
            new = guesses[:n_acc] + [nxt]
            verify_s = time.perf_counter() - t_verify

            stats.record(n, n_acc)
            predicted = planner_measured = None
            if planner is not None:
                choice = planner.current()
                predicted = choice.predicted_seconds if choice is not None else None
                planner.end_step(b, n_acc, len(new), draft_s + verify_s, draft_s if drafted > 1 else 0.0, tokens=new,
                                 tail=tail)
                planner_measured = planner.last_measured_seconds
            stats.draft_seconds += draft_s
            stats.verify_seconds += verify_s
            for i, tok in enumerate(new):
                if tok in eos:
                    new = new[: i + 1]
                    done = True
                    break
            tokens.extend(new)
            generated.extend(new)
            step += 1
            if on_step is not None:
                on_step(StepInfo(
                    step=step, block_size=b, accepted=n_acc, committed=new, generated=len(generated),
                    draft_seconds=draft_s, verify_seconds=verify_s,
                    route_ahead_submitted=route_ahead.submitted_last_step if route_ahead and not plain_step else 0,
                    predicted_seconds=predicted, planner_measured_seconds=planner_measured, shadow_block=shadow,
                ))
        _sync(device)
        stats.decode_seconds = time.perf_counter() - t_decode - (
            (oracle.refresh_seconds - refresh_at_start) if oracle else 0.0)
        if bytes_at_start is not None:
            stats.decode_bytes = moved_bytes() - bytes_at_start
        if pending:  # after the timings: the draft's context ends holding every committed token but the last
            draft.append_context(torch.cat(pending, dim=1))
    except KeyboardInterrupt:
        raise GenerationInterrupted(generated) from None
    finally:
        tgt.close()
    return SpeculativeResult(
        token_ids=generated,
        stats=stats,
        route_ahead=route_ahead.report.to_dict() if route_ahead is not None else None,
        oracle=oracle.report() if oracle is not None else None,
        planner=planner.to_dict() if planner is not None else None,
    )


def make_oracle(
    target: nn.Module,
    input_ids: Sequence[int],
    max_new_tokens: int,
    acceptance: float,
    *,
    reference: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    refresh_window: int | None = None,
) -> OracleProposer:
    """An :class:`OracleProposer` over the target's greedy continuation of ``input_ids``.

    ``reference`` (generated ids of a plain greedy run already made, e.g. the baseline arm of a
    benchmark, or better :func:`verify_sweep`'s) saves computing it again. A reference cut short
    by a divergence is extended by fresh greedy runs, ``refresh_window`` tokens at a time (None:
    to the end).
    """
    prompt = list(input_ids)
    cont = list(reference) if reference is not None else greedy_generate(target, prompt, max_new_tokens, eos_token_ids)

    def refresh(tokens: list[int], more: int) -> list[int]:
        return greedy_generate(target, tokens, more, eos_token_ids) if more > 0 else []

    vocab = int(target.config.vocab_size)
    return OracleProposer(prompt + cont, acceptance, vocab, seed=seed, refresh=refresh, refresh_window=refresh_window)
