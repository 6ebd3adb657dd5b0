"""Oracle-acceptance mode: measured speculation cost with a chosen acceptance rate.

A draft with random weights accepts nothing, so GPU benchmarks on synthetic checkpoints would
never exercise multi-token verification. In oracle mode the draft model still runs every step (its
cost is real) but its proposals are replaced: each proposed position gets the target's own greedy
token with probability P, and otherwise a token that certainly differs from it (a mismatch at rate
1 - P). Greedy verification then accepts a geometric-like prefix, E[accepted drafts] =
P + P^2 + ... + P^(B-1). The output is still the target's greedy output: verification is unchanged.

The target's greedy continuation is computed up front with a plain target-only greedy run
(:func:`pdflash.draft.speculative.greedy_generate`) over the whole output length. Block
verification computes the same logits with different kernel shapes than one-token decoding, so in
low precision the two runs can pick different tokens where two logits nearly tie. When the
committed tokens leave the reference, the oracle is *diverged*: with a ``refresh`` callable it
recomputes the continuation from the committed tokens (a plain greedy run; those target forwards
also go through the offload runtime and are timed apart as ``oracle_refresh_seconds``); without one
its proposals from then on are simply wrong. Both events are counted in the report.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

from pdflash import PdflashError

RefreshFn = Callable[[list[int], int], list[int]]  # (committed tokens, how many more) -> continuation


class OracleProposer:
    """Proposals from a reference sequence (prompt + target greedy continuation)."""

    def __init__(
        self,
        reference: Sequence[int],
        acceptance: float,
        vocab_size: int,
        *,
        seed: int = 0,
        refresh: RefreshFn | None = None,
    ):
        if not 0.0 <= acceptance <= 1.0:
            raise PdflashError(f"--draft-acceptance must be between 0 and 1, got {acceptance}")
        if vocab_size < 2:
            raise PdflashError("oracle acceptance needs a vocabulary of at least 2 tokens")
        self.reference = list(reference)
        self.total_length = len(self.reference)
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.refresh = refresh
        self._rng = random.Random(seed)
        self._checked = 0  # reference[:_checked] is known to equal the committed tokens
        self.divergences = 0
        self.refreshes = 0
        self.refresh_seconds = 0.0

    def _aligned(self, tokens: Sequence[int]) -> bool:
        end = len(tokens)
        if end > len(self.reference):
            return False
        if list(tokens[self._checked : end]) != self.reference[self._checked : end]:
            return False
        self._checked = end
        return True

    def propose(self, tokens: Sequence[int], n: int) -> list[int]:
        """n proposals for the positions right after ``tokens`` (all committed tokens so far)."""
        if not self._aligned(tokens):
            self.divergences += 1
            if self.refresh is not None:
                t0 = time.perf_counter()
                more = self.refresh(list(tokens), max(0, self.total_length - len(tokens)))
                self.refresh_seconds += time.perf_counter() - t0
                self.refreshes += 1
                self.reference = list(tokens) + list(more)
                self._checked = len(tokens)
            else:
                self._checked = len(tokens)  # keep proposing from the stale reference
                self.reference[: len(tokens)] = list(tokens)
        start = len(tokens)
        out = []
        for i in range(n):
            pos = start + i
            ref = self.reference[pos] if pos < len(self.reference) else None
            if ref is not None and self._rng.random() < self.acceptance:
                out.append(ref)
            else:
                tok = self._rng.randrange(self.vocab_size - 1)
                out.append(tok + 1 if ref is not None and tok >= ref else tok)  # never equals ref
        return out

    def report(self) -> dict:
        return {
            "oracle_acceptance": self.acceptance,
            "oracle_divergences": self.divergences,
            "oracle_refreshes": self.refreshes,
            "oracle_refresh_seconds": self.refresh_seconds,
        }
