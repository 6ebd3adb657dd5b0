"""Speculative decoding on the offload runtime (``pdflash.offload.runtime.OffloadedModel``).

    block = draft_block_size(draft_dir, block_size)                  # before loading the target
    rt = OffloadedModel.load(model_dir, ..., block_tokens=block)     # cache minimum covers a block
    draft = load_runtime_draft(rt, draft_dir)
    result = speculative_on_runtime(rt, draft, ids, 128, block_size=block, predictor="draft-router")

The verify pass runs on ``rt.model`` (the library model with offloaded experts); route-ahead
predictions go to ``rt.prefetcher.prefetch_experts`` at the runtime's route-ahead band, paced by
a window sized to the expert cache (:func:`~pdflash.draft.route_ahead.window_for_cache`).

Oracle-acceptance mode (``acceptance`` = P): the target's greedy continuation is first computed
on the same runtime and the same target path as the verify passes (:func:`oracle_reference`, not
part of the result's timings); the runtime's cache and statistics are then reset (and an
all-resident cache preloaded again), so the reported figures cover the speculative run alone.

Batch-invariant verify (:func:`verify_decoder`): every verify forward, and the reference's, runs the
draft's trained block length of rows (offload/graphs.py, fixed rows), so a position's logits do
not depend on the block it was verified in. In oracle mode in a 16-bit dtype the reference and the
verify passes must round alike, or the oracle's draws are refused for rounding and its acceptance
falls below P: there, by default, a check (:func:`rows_agree`) first runs blocks of every length
against single steps, and the fixed rows are used only where they round apart on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from pdflash.draft.config import DFlashConfig
from pdflash.draft.model import DFlashDraftModel
from pdflash import PdflashError
from pdflash.offload.prompt import check_context
from pdflash.offload.warmup import warm_linears
from pdflash.draft.route_ahead import RouteAhead, check_predictor_name, window_for_cache
from pdflash.draft.speculative import SpeculativeResult, StepInfo, check_block_size, make_oracle, speculative_generate


AUTO = "auto"


def parse_block_size(text: str | int | None) -> int | str | None:
    """``--block-size``: "auto" (the block planner), an integer, or None (unset)."""
    if text is None or isinstance(text, int):
        return text
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise PdflashError(f"--block-size must be auto or a whole number, got {text!r}", exit_code=2) from None


def draft_block_size(draft_dir: str | Path, block_size: int | str | None) -> int:
    """The largest verify block a run with this draft uses (checked against the draft's config):
    ``block_size``, or the trained block size for None / "auto"; load the runtime with
    ``block_tokens`` set to it."""
    trained = DFlashConfig.from_dir(draft_dir).block_size
    return check_block_size(None if block_size == AUTO else block_size, trained)


PLANNER_ENV = "PDFLASH_PLANNER"  # a JSON object of BlockPlanner keyword arguments (benchmarks' A/B of a fresh process)


def planner_variant() -> dict:
    """The BlockPlanner keyword arguments in ``PDFLASH_PLANNER`` ({} when unset); PdflashError
    naming what is wrong otherwise."""
    from pdflash.draft.planner import parse_variant

    text = os.environ.get(PLANNER_ENV, "").strip()
    if not text:
        return {}
    try:
        return parse_variant(f"{PLANNER_ENV}={text}")[1]
    except ValueError as exc:
        raise PdflashError(f"{exc}; set it to a JSON object of BlockPlanner keyword arguments, e.g. "
                           f"{PLANNER_ENV}='{{\"plain_while_placing\": false}}', or unset it", exit_code=2) from None


def make_planner(rt, max_block: int, **options):
    """A :class:`~pdflash.draft.planner.BlockPlanner` over the runtime's cache, scheduler counters
    and shared cost model (``rt.cost``); remove its routing observer after the run
    (``rt.remove_routing_observer(planner.on_routed)``). ``options``: BlockPlanner keyword
    arguments (benchmarks; e.g. ``home_block``), over those of ``PDFLASH_PLANNER`` (a fresh
    process's A/B, recorded as the planner's ``variant`` in --json)."""
    from pdflash.draft.planner import BlockPlanner

    fam = rt.family

    # Steps are timed in wall seconds on every device, what tokens per second are made of. On a
    # CPU device the planner once timed them in process CPU seconds plus the seconds blocked on
    # the link, to be robust to other processes on the cores; that counts a parallel region once
    # per thread, and on the embedded pair (`make demo` setting) wall time gave the higher median
    # ratio to --no-draft in 4 of 4 alternating pairs of runs (docs/benchmarks.md).
    # misses the host computed instead of fetching them (hybrid execution): cumulative, read per step
    host_counter = (lambda: rt.cache.stats.cpu) if rt.placer is not None else None
    # the hybrid guard's kept arm: plain steps while it first tries its arms, then a fresh start
    guard = rt.placer.guard if rt.placer is not None else None
    options.setdefault("placement", (lambda: guard.kept) if guard is not None else None)
    variant = planner_variant()
    try:
        planner = BlockPlanner(max_block, rt.cost, num_layers=fam.num_layers, num_experts=fam.num_experts,
                               top_k=fam.top_k, cache=rt.cache, link_counters=rt.scheduler.link_totals,
                               host_counter=host_counter, **{**variant, **options})
    except (TypeError, ValueError) as exc:
        if not variant:
            raise
        raise PdflashError(f"{PLANNER_ENV}: {exc}; fix or unset it", exit_code=2) from None
    planner.variant = variant
    rt.add_routing_observer(planner.on_routed)
    return planner


# What `generate --draft` prefetches for its verify blocks when not told: nothing. Measured, the
# route-ahead prefetch of the "previous" rule cost more than it saved under the block planner: on
# the CPU (embedded pair, `make demo` setting) default generate ran at 0.89x / 0.94x (median /
# geometric mean over 8 prompts) of --no-draft with it and 0.99x / 1.06x without it; on the H200
# (bench-priority, gpt-oss-20b shape, P = 0.7) the on-demand arm beat the route-ahead ones by 1.16x
# (docs/benchmarks.md). `--route-ahead-predictor` turns it on; bench-priority measures the band.
DEFAULT_PREDICTOR = "none"


def load_runtime_draft(rt, draft_dir: str | Path) -> DFlashDraftModel:
    """The draft at ``draft_dir`` for runtime ``rt``'s model, as generate runs it: on a CPU device
    it computes in float32, whose small matrices run faster there than bf16 (embedded pair: a draft
    step of 8 positions 1.9 -> 1.5 ms), and a small one (hidden size under SMALL_HIDDEN, the size
    whose CPU decode runs on one PyTorch thread) runs each pass as one native call
    (``DFlashDraftModel.use_native``: 2.6-4.3x faster for the embedded draft); elsewhere in the
    target's dtype. Proposals are verified as ever, so the output does not depend on it."""
    from pdflash.draft.model import load_draft
    from pdflash.offload.threads import SMALL_HIDDEN

    cpu = rt.device.type == "cpu"
    draft = load_draft(draft_dir, rt.model, dtype=torch.float32 if cpu else None)
    if cpu and draft.config.hidden_size < SMALL_HIDDEN:
        draft.use_native()
    return draft


def draft_pass_kind(draft: DFlashDraftModel) -> str:
    """How the draft's passes run now: "cuda-graphs" (static cache, replayed graphs), "static"
    (the same passes eagerly), "native" (the CPU draft pass) or "operators" (PyTorch's)."""
    if draft.graphed:
        return "cuda-graphs" if draft._graphs.graphs else "static"
    return "native" if draft.native else "operators"


def speculative_options(
    draft_dir: str | Path | None,
    *,
    block_size: int | str | None,
    predictor: str,
    acceptance: float | None,
    temperature: float,
    default_predictor: str = DEFAULT_PREDICTOR,
    lookup: bool = True,
    batch_invariant: bool | None = None,
) -> dict | None:
    """Check the command-line options of a draft run before anything is loaded.

    Returns None without a draft (then the draft-only options must be unset: exit code 2
    otherwise), else the keyword arguments of :func:`generate_with_draft` minus the run's own.
    ``block_size`` in the result is the resolved largest verify block (load the runtime with
    ``block_tokens`` set to it); ``auto`` (True for ``--block-size auto`` or unset) switches the
    block planner on.
    """
    block_size = parse_block_size(block_size)
    if draft_dir is None:
        used = [flag for flag, on in (("--block-size", block_size is not None),
                                      ("--route-ahead-predictor", predictor != default_predictor),
                                      ("--draft-acceptance", acceptance is not None),
                                      ("--batch-invariant", batch_invariant is not None)) if on]
        if used:
            verb = "applies" if len(used) == 1 else "apply"
            raise PdflashError(f"{', '.join(used)} only {verb} to speculative decoding: add --draft DIR", exit_code=2)
        return None
    if isinstance(block_size, int) and block_size < 1:
        raise PdflashError(f"--block-size must be at least 1, got {block_size}", exit_code=2)
    check_predictor_name(predictor)
    if acceptance is not None:
        if not 0.0 <= acceptance <= 1.0:
            raise PdflashError(f"--draft-acceptance must be between 0 and 1, got {acceptance}", exit_code=2)
        if temperature > 0:
            raise PdflashError("--draft-acceptance (oracle-acceptance mode) needs greedy decoding: drop --temperature",
                               exit_code=2)
    if block_size in (None, AUTO):
        planner_variant()  # a malformed PDFLASH_PLANNER is refused before the model loads
    return {"draft_dir": Path(draft_dir), "block_size": draft_block_size(draft_dir, block_size),
            "auto": block_size in (None, AUTO), "predictor": predictor, "acceptance": acceptance, "lookup": lookup,
            "batch_invariant": batch_invariant}


def verify_decoder(rt, draft: DFlashDraftModel, max_len: int, acceptance: float | None, *,
                   batch_invariant: bool | None = None, graphs: bool | None = None, at: int | None = None,
                   blocks: Sequence[int] = (), probe: Sequence[int] | None = None):
    """The ``GraphedDecoder`` verify passes (and the oracle's reference) go through, or None for
    the library model's own forward: graphed on CUDA (``graphs``). Shared per runtime, so a
    reference and the runs that follow it use one decoder. Graphs for blocks of ``blocks`` tokens
    (default: 1 .. the draft's trained block) at ``at`` positions are captured now.

    Batch-invariant verify: ``batch_invariant`` True runs every step with ``draft``'s trained block
    length of rows (``decoder.rows``), eager where not graphed; False never. None (the default)
    asks for it in oracle-acceptance mode in a 16-bit dtype, and there first checks whether this
    machine needs it (:func:`rows_agree`, on ``probe``, default a few fixed token ids): where the
    unpadded decoder's blocks already round as its single steps, it serves, without the padding
    rows' cost, its CPU experts' calls batch invariant. The outcome is ``decoder.rows_check``
    ("agree", "differ"; None where nothing was checked). A check goes through the runtime's cache:
    it is reset afterwards."""
    from pdflash.offload.graphs import GraphedDecoder

    check = batch_invariant is None and acceptance is not None and rt.dtype in (torch.bfloat16, torch.float16)
    if batch_invariant is None:
        batch_invariant = check
    if graphs is None:
        graphs = rt.device.type == "cuda"
    outcome = None
    if check:  # every length the draft can verify, once per runtime: a reference and the runs after it agree
        plain = GraphedDecoder.shared(rt, max_len, rows=None, graphs=graphs)
        plain.invariant = True  # as it would serve: its CPU experts' calls batch invariant
        outcome = "agree" if _rows_agree_once(rt, plain, probe, range(1, int(draft.config.block_size) + 1)) else "differ"
        plain.invariant = False
        if outcome == "agree":
            batch_invariant = False
    rows = int(draft.config.block_size) if batch_invariant else None
    if not graphs and rows is None and outcome is None:
        return None
    dec = GraphedDecoder.shared(rt, max_len, rows=rows, graphs=graphs)
    dec.invariant = rows is not None or outcome == "agree"
    dec.rows_check = outcome
    if graphs and at is not None:
        dec.prepare(at, tokens=blocks)
    return dec


def rows_agree(dec, prompt: Sequence[int], lengths: Sequence[int], tokens: Sequence[int] | None = None,
               span: int | None = None) -> bool:
    """Whether ``dec`` computes each position's logits to the same bits in blocks of every length
    of ``lengths`` as in single-token steps. After ``prompt``, ``span`` tokens (default: twice the
    longest length, at least 8; fewer where ``dec.max_len`` has no room) of ``tokens`` (default: the
    decoder's own greedy continuation, what oracle mode's verify blocks hold) are fed one at a
    time, then as blocks of each length L at every L-aligned start (each position checked at
    several places in a block, against several key lengths); every logit of the vocabulary is
    compared bit for bit. Whether blocks and steps round alike depends on the machine's kernels
    for each row count (cuBLAS on an H100 at the gpt-oss-20b shape: alike for 1..8 rows,
    benchmarks/probe_row_invariant_linear.py) and, where a step attends to just its keys (eager),
    on the values summed: a check, not a proof; oracle mode counts any divergence that follows.
    Leaves ``dec`` holding ``prompt``."""
    prompt = [int(t) for t in prompt]
    n = min(span or max(8, 2 * max(lengths)), dec.max_len - len(prompt))
    wanted = [b for b in sorted(set(lengths)) if 2 <= b <= n]
    if not prompt or not wanted:
        return True
    logits = dec.prefill(prompt)
    at = dec.length
    feed = [int(t) for t in tokens[:n]] if tokens is not None else [int(logits.argmax())]
    singles = []
    while len(singles) < n:
        singles.append(dec.decode(feed[len(singles)]))
        if len(feed) < n:
            feed.append(int(singles[-1].argmax()))
    singles = torch.cat(singles)  # [n, V]
    for b in wanted:
        for start in range(0, n - b + 1, b):
            dec.truncate(at + start)
            if not torch.equal(dec.forward(feed[start:start + b])[0], singles[start:start + b]):
                dec.truncate(at)
                return False
    dec.truncate(at)
    return True


def _rows_agree_once(rt, dec, probe: Sequence[int] | None, lengths: Sequence[int]) -> bool:
    """:func:`rows_agree` once per runtime, graphed or not: the kernels a row count gets do not
    change within a process, and every run on the runtime must take the path its oracle reference
    took. The check's fetches leave the cache as a fresh one (``fresh_cache``)."""
    memo = rt.__dict__.setdefault("_rows_agree", {})
    key = bool(dec.graphs)
    if key not in memo:
        if probe is None:
            vocab = int(rt.config.vocab_size)
            probe = [1 + (37 * i) % (vocab - 1) for i in range(8)]
        memo[key] = rows_agree(dec, probe, lengths)
        fresh_cache(rt)
    return memo[key]


def fresh_cache(rt) -> None:
    """Empty the runtime's cache and statistics after untimed work; an all-resident cache starts
    warm again, as after loading."""
    rt.reset_cache()
    fam = rt.family
    if rt.cache.capacity >= fam.num_layers * fam.num_experts:
        rt.preload()


def prepare_draft(rt, draft: DFlashDraftModel, decoder, prompt_len: int, max_new_tokens: int, blocks) -> None:
    """Ready ``draft`` for a run whose verify passes go through ``decoder`` (:func:`verify_decoder`):
    with a graphed decoder the draft's passes are CUDA graphs too, those of each drafted length of
    ``blocks`` captured now (before the prompt, outside the timings); otherwise each length's
    first-call setup runs now (``warm_up``)."""
    drafts = [b for b in blocks if b >= 2]
    if decoder is not None and decoder.graphs:
        draft.use_graphs(prompt_len + max_new_tokens, graphs=True, before_capture=rt.cache.drain, at=prompt_len,
                         blocks=drafts)
    else:
        draft.use_graphs(enable=False)
        draft.warm_up(drafts)


def oracle_reference(rt, input_ids: Sequence[int], max_new_tokens: int, block_size: int, *, decoder=None,
                     eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Oracle mode's reference continuation, from the arithmetic of the verify passes: a plain
    greedy run (through ``decoder`` when given: the graphed path), then
    :func:`~pdflash.draft.speculative.verify_sweep` over blocks of ``block_size`` on the same path.
    Untimed work that goes through the runtime's cache: reset it afterwards."""
    from pdflash.draft.speculative import greedy_generate, verify_sweep

    prompt = [int(t) for t in input_ids]
    eos = set(eos_token_ids)
    if decoder is None:
        plain = greedy_generate(rt.model, prompt, max_new_tokens, list(eos))
    else:
        plain = [int(decoder.prefill(prompt).argmax())]
        while plain[-1] not in eos and len(plain) < max_new_tokens:
            plain.append(int(decoder.decode(plain[-1]).argmax()))
    return verify_sweep(rt.model, prompt, plain, max_new_tokens, block_size, decoder=decoder,
                        eos_token_ids=list(eos))


def speculative_on_runtime(
    rt,
    draft: DFlashDraftModel,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    block_size: int | None = None,
    predictor: str | None = "previous",
    acceptance: float | None = None,
    reference: Sequence[int] | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    on_step: Callable[[StepInfo], None] | None = None,
    graphs: bool | None = None,
    lookup: bool = True,
    batch_invariant: bool | None = None,
    planner_options: dict | None = None,
) -> SpeculativeResult:
    """Speculative generation on ``rt``; ``graphs`` (default: on CUDA) runs the prefill and every
    verify block through a ``GraphedDecoder`` whose graphs for block lengths 1 .. B are captured
    before the prompt runs (outside the timings); ``predictor`` None or "none" switches route-ahead off,
    ``acceptance`` switches oracle-acceptance mode on (``reference``: the target's greedy
    continuation when already known, which skips the reference run). ``eos_token_ids`` defaults
    to the checkpoint's. ``block_size`` "auto" lets the block planner pick each step's block
    length up to the draft's trained block size. ``batch_invariant`` (default: in oracle mode in
    a 16-bit dtype) runs every verify forward with the trained block's rows (:func:`verify_decoder`).
    ``planner_options`` are keyword arguments of the block planner (benchmarks). The warm-ups
    and the loop run with the runtime's decode threads (offload/threads.py)."""
    with rt.decode_threads():
        eos = list(rt.eos_token_ids if eos_token_ids is None else eos_token_ids)
        prompt = [int(t) for t in input_ids]
        check_context(rt.config, len(prompt), max_new_tokens)
        auto = parse_block_size(block_size) == AUTO
        block = check_block_size(None if auto else block_size, draft.config.block_size)
        lengths = range(1, block + 1) if auto else sorted({1, block})
        decoder = verify_decoder(rt, draft, len(prompt) + max_new_tokens, acceptance, batch_invariant=batch_invariant,
                                 graphs=graphs, at=len(prompt), blocks=lengths, probe=prompt)
        if decoder is None:  # each verify length's first-call setup, before the prompt (as plain decoding warms its one)
            warm_linears([rt.model], lengths)
        prepare_draft(rt, draft, decoder, len(prompt), max_new_tokens, lengths)
        oracle = None
        if acceptance is not None:
            if reference is None:
                reference = oracle_reference(rt, prompt, max_new_tokens, block, decoder=decoder, eos_token_ids=eos)
                fresh_cache(rt)
            oracle = make_oracle(rt.model, prompt, max_new_tokens, acceptance, reference=reference,
                                 eos_token_ids=eos, seed=seed, refresh_window=4 * block)
        route_ahead = None
        if predictor not in (None, "none") and rt.cpu_mode != "all":  # under "all" nothing is fetched
            fam = rt.family
            route_ahead = RouteAhead(
                rt.model, predictor, rt.prefetcher.prefetch_experts, block_size=block,
                priority=rt.prefetcher.route_ahead_priority, bytes_per_expert=rt.host.layout.expert_bytes,
                window_layers=window_for_cache(rt.cache.capacity, fam.num_experts, fam.top_k, block),
            )
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=rt.device).manual_seed(seed)
        planner = make_planner(rt, block, **(planner_options or {})) if auto else None

        def moved_bytes() -> float:
            return float(rt.scheduler.link_totals()[0])

        try:
            res = speculative_generate(
                rt.model, draft, prompt, max_new_tokens, block_size=block, temperature=temperature,
                generator=generator, eos_token_ids=eos, route_ahead=route_ahead, oracle=oracle, on_step=on_step,
                planner=planner, moved_bytes=moved_bytes, decoder=decoder, lookup=lookup,
            )
            res.verify_rows = decoder.rows if decoder is not None else None
            res.verify_rows_check = decoder.rows_check if decoder is not None else None
            return res
        finally:
            if route_ahead is not None:
                route_ahead.close()
            if planner is not None:
                rt.remove_routing_observer(planner.on_routed)


def generate_with_draft(
    rt,
    input_ids: Sequence[int],
    *,
    draft_dir: str | Path,
    max_new_tokens: int,
    block_size: int | None = None,
    auto: bool = False,
    predictor: str | None = "previous",
    acceptance: float | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    on_step: Callable | None = None,
    on_verify: Callable[[StepInfo], None] | None = None,
    graphs: bool | None = None,
    lookup: bool = True,
    batch_invariant: bool | None = None,
    planner_options: dict | None = None,
) -> tuple[object, dict]:
    """``pdflash generate --draft``: returns (a GenerationResult as plain decoding returns it,
    extra report fields).

    ``on_step`` gets ``pdflash.offload.generate.StepInfo`` once per verify pass (index of the last
    committed token, decode rate so far; elapsed counts decode time only), ``on_verify`` this
    module's :class:`StepInfo` of the pass. Extra fields: ``draft``, ``block_size``,
    ``verify_steps``, ``acceptance_length``, ``acceptance_per_position``, ``draft_ms``,
    ``verify_ms``, ``route_ahead`` (None when off), ``draft_pass`` (:func:`draft_pass_kind`),
    ``verify_rows`` (the fixed rows of batch-invariant verify, or None) and, in oracle-acceptance mode only,
    ``oracle_acceptance`` = P with the oracle's divergence counters.
    """
    from pdflash.offload.generate import GenerationResult
    from pdflash.offload.generate import StepInfo as TokenStep

    draft = load_runtime_draft(rt, draft_dir)
    eos = list(rt.eos_token_ids)
    decode_s = [0.0]

    def step_hook(info: StepInfo) -> None:
        decode_s[0] += info.draft_seconds + info.verify_seconds
        if on_verify is not None:
            on_verify(info)
        if on_step is not None:
            d = decode_s[0]
            on_step(TokenStep(info.generated - 1, info.committed[-1], d, (info.generated - 1) / d if d > 0 else None))

    res = speculative_on_runtime(rt, draft, input_ids, max_new_tokens, block_size=AUTO if auto else block_size,
                                 predictor=predictor,
                                 acceptance=acceptance, temperature=temperature, seed=seed, eos_token_ids=eos,
                                 on_step=step_hook, graphs=graphs, lookup=lookup, batch_invariant=batch_invariant,
                                 planner_options=planner_options)
    n = len(res.token_ids)
    st = res.stats
    gen = GenerationResult(
        token_ids=res.token_ids,
        prompt_tokens=len(input_ids),
        stop_reason="eos" if res.token_ids and res.token_ids[-1] in set(eos) else "length",
        ttft_ms=st.prefill_seconds * 1e3,
        tpot_ms=st.decode_seconds / (n - 1) * 1e3 if n > 1 else None,
        tokens_per_second=res.tokens_per_second,
        total_s=st.prefill_seconds + st.decode_seconds,
        stats=rt.stats(),
    )
    extra = {
        "draft": str(draft_dir),
        "block_size": AUTO if auto else st.block_size,
        "max_block_size": st.block_size,
        "block_histogram": st.block_histogram(),
        "bytes_per_committed_token": st.bytes_per_committed_token,
        "verify_steps": st.verify_steps,
        "acceptance_length": st.acceptance_length,
        "acceptance_per_position": st.acceptance_per_position,
        "draft_ms": st.draft_seconds * 1e3,
        "verify_ms": st.verify_seconds * 1e3,
        "route_ahead": res.route_ahead,
        "copied_steps": st.copied_steps,
        "draft_pass": draft_pass_kind(draft),  # how the draft's passes ran at the end
        "draft_graphs_failure": draft._graphs.failure if draft.graphed else None,  # why graphs were given up
        "verify_rows": res.verify_rows,
        "verify_rows_check": res.verify_rows_check,
    }
    if res.planner is not None:
        extra["planner"] = res.planner
    if res.oracle is not None:
        extra.update(res.oracle)
    return gen, extra
