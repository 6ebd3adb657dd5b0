"""Oracle-acceptance mode: measured speculation cost with a chosen acceptance rate.

A draft with random weights accepts nothing, so GPU benchmarks on synthetic checkpoints would
never exercise multi-token verification. In oracle mode the draft model still runs every step (its
cost is real) but its proposals are replaced by the target's own greedy tokens (the *reference*),
and each proposed position gets an acceptance draw, true with probability P. Verification accepts
the longest prefix whose proposals equal the target's argmax *and* whose draws are true, then
commits the target's argmax at the first refusal, as always: E[accepted drafts] = P + P^2 + ... +
P^(B-1), and the output is still exactly what the verify passes compute.

Same arithmetic, no repairs. The reference must be what the verify pass itself computes, or a
proposal the draw accepted is refused for a rounding tie (bf16 block and single-token forwards
round apart) and acceptance falls below P. So:

1. the reference comes from the verify path: :func:`pdflash.draft.speculative.verify_sweep` runs
   the run's own target forwards (the graphed decoder on CUDA) over blocks of the run's block
   length, taking a plain greedy continuation as its guesses and keeping what the blocks' argmaxes
   say (lossless speculative decoding with the guesses as the draft), untimed before the run;
2. every verify pass then *heals* the reference: its argmax at each position whose prefix matched
   (also past the draw's refusal, since every proposal is a reference token) replaces the
   reference there; a changed token drops the now-stale rest of the reference (a *divergence*).

A reference too short for the next block (after a divergence) is extended by ``refresh`` (a plain
greedy run on the committed tokens, ``refresh_window`` tokens at a time; those target forwards
go through the offload runtime and are timed apart as ``oracle_refresh_seconds``); without one the
missing positions get tokens whose draws are false. Divergences and refreshes are counted in the
report: with the reference from the verify path both stay 0 wherever the verify pass's rows round
alike across block lengths.
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
        refresh_window: int | None = None,
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
        self.refresh_window = refresh_window
        self._rng = random.Random(seed)
        self.draws: list[bool] = []  # the last proposals' acceptance draws
        self.divergences = 0
        self.refreshes = 0
        self.refresh_seconds = 0.0
        self.healed = 0  # reference tokens confirmed or set by verify passes

    def _repair(self, tokens: Sequence[int], need: int) -> None:
        """Extend a reference that is ``tokens`` plus too few known tokens to ``need`` positions."""
        if self.refresh is None or len(self.reference) >= min(need, self.total_length):
            return
        more = max(0, self.total_length - len(self.reference))
        if self.refresh_window is not None:
            more = min(more, max(self.refresh_window, need - len(self.reference)))
        t0 = time.perf_counter()
        cont = self.refresh(list(self.reference), more)
        self.refresh_seconds += time.perf_counter() - t0
        self.refreshes += 1
        self.reference.extend(cont)

    def propose(self, tokens: Sequence[int], n: int) -> list[int]:
        """n proposals for the positions right after ``tokens`` (all committed tokens so far); their
        acceptance draws are in :attr:`draws`."""
        end = len(tokens)
        if list(tokens) != self.reference[:end]:  # committed tokens the verify passes did not report
            self.divergences += 1
            self.reference = list(tokens)
        self._repair(tokens, end + n)
        out, self.draws = [], []
        for i in range(n):
            pos = end + i
            if pos < len(self.reference):
                out.append(self.reference[pos])
                self.draws.append(self._rng.random() < self.acceptance)
            else:  # nothing known here: a token no draw accepts
                out.append(self._rng.randrange(self.vocab_size))
                self.draws.append(False)
        return out

    def limit(self) -> int:
        """Proposals the draws accept: the length of their leading run of trues."""
        n = 0
        while n < len(self.draws) and self.draws[n]:
            n += 1
        return n

    def observe(self, committed: int, block: Sequence[int], best: Sequence[int]) -> None:
        """A verify pass over ``block`` (its first token at position ``committed`` - 1) chose the
        argmaxes ``best``: row i is the token at position ``committed`` + i wherever block[1 .. i]
        equal best[0 .. i-1]. Those rows replace the reference; a changed token drops the rest."""
        for i, tok in enumerate(best):
            if i > 0 and (i >= len(block) or block[i] != best[i - 1]):
                break  # row i's prefix holds a proposal the target refused
            pos, tok = committed + i, int(tok)
            if pos < len(self.reference):
                if self.reference[pos] == tok:
                    self.healed += 1
                    continue
                self.divergences += 1
                del self.reference[pos:]
            if pos != len(self.reference):
                break  # a gap before this position: nothing to attach it to
            self.reference.append(tok)
            self.healed += 1

    def report(self) -> dict:
        return {
            "oracle_acceptance": self.acceptance,
            "oracle_divergences": self.divergences,
            "oracle_refreshes": self.refreshes,
            "oracle_refresh_seconds": self.refresh_seconds,
        }
