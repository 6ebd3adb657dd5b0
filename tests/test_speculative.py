"""Speculative decoding: greedy is lossless against transformers' own greedy generate, sampling
reproduces the target distribution, oracle-acceptance mode, block size limits, route-ahead scoring."""

import json
import math
import shutil

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from pdflash import PdflashError
from pdflash.draft import (
    OracleProposer,
    RouteAhead,
    RouteAheadReport,
    accept_sampling,
    greedy_generate,
    load_draft,
    make_oracle,
    speculative_generate,
    write_synthetic_draft,
)
from pdflash.draft.route_ahead import _RouterBank

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}
PROMPT = [5, 9, 2, 44, 7, 1, 3, 8, 60, 12]  # longer than the sliding window (6)



def tiny_target(vocab=96, seed=0, logit_scale=1.0):
    cfg = GptOssConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=6, max_position_embeddings=4096, rope_parameters=dict(YARN),
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # spread routing so blocks touch varied experts
            layer.mlp.router.weight.normal_(0, 0.5)
        model.lm_head.weight.mul_(logit_scale)
    return model


def make_pair(tmp_path, **kw):
    target = tiny_target(**kw)
    target.config.save_pretrained(tmp_path / "target")
    write_synthetic_draft(tmp_path / "draft", "tiny", target_dir=tmp_path / "target", seed=1)
    return target, load_draft(tmp_path / "draft", target)


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spec")


@pytest.fixture(scope="module")
def pair(pair_dir):
    return make_pair(pair_dir)


@pytest.fixture(scope="module")
def reference(pair):
    """transformers' own greedy generate: the independent reference."""
    target, _ = pair
    with torch.no_grad():
        out = target.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


# -- greedy is lossless -------------------------------------------------------------------------


def test_plain_greedy_matches_transformers(pair, reference):
    target, _ = pair
    assert greedy_generate(target, PROMPT, 40) == reference


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_greedy_speculation_is_lossless_with_the_draft(pair, reference, block_size):
    target, draft = pair
    result = speculative_generate(target, draft, PROMPT, 37, block_size=block_size)
    assert result.token_ids == reference[:37]
    assert result.stats.block_size == block_size and result.oracle is None


@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_greedy_speculation_is_lossless_when_proposals_are_accepted(pair, reference, block_size):
    """Oracle proposals (P = 0.6) make verify passes accept several tokens, crop after partial
    acceptance and feed multi-token context to the draft: the output must not change."""
    target, draft = pair
    oracle = make_oracle(target, PROMPT, 40, 0.6, reference=reference, seed=block_size)
    result = speculative_generate(target, draft, PROMPT, 40, block_size=block_size, oracle=oracle)
    assert result.token_ids == reference
    assert result.stats.acceptance_length > 1.2
    assert oracle.divergences == 0


def test_draft_context_holds_target_features_of_every_committed_token(pair, pair_dir, reference, tmp_path):
    """After generation the draft's context K/V equal those of one fresh append of the target's
    features (transformers' output_hidden_states[i + 1]) over all committed tokens but the last."""
    target, _ = pair
    src = tmp_path / "mid"
    shutil.copytree(pair_dir / "draft", src)
    raw = json.loads((src / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 2]  # avoid the last layer, whose index is final-normed
    (src / "config.json").write_text(json.dumps(raw))
    draft = load_draft(src, target)
    oracle = make_oracle(target, PROMPT, 30, 0.6, reference=reference[:30], seed=5)
    result = speculative_generate(target, draft, PROMPT, 30, block_size=4, oracle=oracle)
    assert result.stats.acceptance_length > 1.5
    committed = PROMPT + result.token_ids
    got = [tuple(t.clone() for t in draft.cache.get(i)) for i in range(draft.config.num_hidden_layers)]
    assert draft.context_length == len(committed) - 1
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([committed[:-1]]), output_hidden_states=True).hidden_states
    draft.reset_context()
    draft.append_context(torch.cat([hs[i + 1] for i in (0, 1, 2)], dim=-1))
    for i, (k, v) in enumerate(got):
        torch.testing.assert_close(k, draft.cache.get(i)[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v, draft.cache.get(i)[1], rtol=1e-4, atol=1e-4)


def test_acceptance_bookkeeping_at_oracle_extremes(pair, reference):
    target, draft = pair
    full = speculative_generate(target, draft, PROMPT, 40, block_size=4,
                                oracle=make_oracle(target, PROMPT, 40, 1.0, reference=reference))
    s = full.stats
    assert full.token_ids == reference
    assert s.verify_steps == math.ceil((40 - 1) / 4)  # first token from the prefill, then 4 per verify
    assert s.acceptance_per_position == [1.0, 1.0, 1.0]
    assert s.committed_tokens == 39 and s.acceptance_length == 39 / s.verify_steps
    d = full.to_dict()
    assert d["oracle_acceptance"] == 1.0 and d["acceptance_length"] == s.acceptance_length

    none = speculative_generate(target, draft, PROMPT, 20, block_size=4,
                                oracle=make_oracle(target, PROMPT, 20, 0.0, reference=reference[:20]))
    assert none.token_ids == reference[:20]
    assert none.stats.acceptance_length == 1.0 and none.stats.acceptance_per_position == [0.0, 0.0, 0.0]


def test_oracle_acceptance_draws():
    ref = list(range(1000))
    oracle = OracleProposer(ref, 0.7, vocab_size=2000, seed=0)
    proposals = oracle.propose(ref[:10], 900)
    assert proposals == ref[10:910]  # every proposal is the reference token; the draws decide
    assert abs(sum(oracle.draws) / 900 - 0.7) < 0.05  # binomial sd 0.015
    assert oracle.draws[oracle.limit()] is False and all(oracle.draws[: oracle.limit()])
    short = oracle.propose(ref[:998], 4)  # past the reference's end: no draw accepts
    assert short[:2] == [998, 999] and oracle.draws[2:] == [False, False]
    with pytest.raises(PdflashError, match="between 0 and 1"):
        OracleProposer(ref, 1.5, vocab_size=10)


def test_oracle_heals_its_reference_from_verify_rows():
    oracle = OracleProposer([1, 2, 3, 4, 5, 6], 1.0, vocab_size=50)
    # block [3, 4, 5, 6] after tokens [1, 2, 3]: rows give positions 3, 4, 5, 6
    oracle.observe(3, [3, 4, 5, 6], [4, 5, 9, 11])  # row 2 differs: position 5 becomes 9, the rest goes
    assert oracle.reference == [1, 2, 3, 4, 5, 9] and oracle.divergences == 1
    oracle.observe(6, [9, 7], [7, 8])  # extends the reference (row 1 valid: 7 was confirmed)
    assert oracle.reference == [1, 2, 3, 4, 5, 9, 7, 8]
    oracle.observe(6, [9, 1], [7, 8])  # row 1's prefix holds a refused proposal: ignored
    assert oracle.reference == [1, 2, 3, 4, 5, 9, 7, 8] and oracle.divergences == 1


def test_oracle_repairs_a_wrong_reference(pair, reference):
    target, draft = pair
    wrong = reference[:15] + [(t + 1) % 96 for t in reference[15:]]
    oracle = make_oracle(target, PROMPT, 40, 1.0, reference=wrong)
    result = speculative_generate(target, draft, PROMPT, 40, block_size=4, oracle=oracle)
    assert result.token_ids == reference
    assert oracle.refreshes == 1 and result.oracle["oracle_divergences"] == 1
    assert result.stats.acceptance_length > 3.0  # full acceptance again after the repair


def test_stops_at_eos_like_plain_greedy(pair, reference):
    target, draft = pair
    eos = reference[12]
    want = greedy_generate(target, PROMPT, 40, eos_token_ids=[eos])
    assert want[-1] == eos and len(want) <= 13
    oracle = make_oracle(target, PROMPT, 40, 1.0, reference=reference)
    got = speculative_generate(target, draft, PROMPT, 40, block_size=4, eos_token_ids=[eos], oracle=oracle)
    assert got.token_ids == want


@pytest.mark.parametrize("block_size", [0, 5, -1])
def test_block_size_outside_the_draft_range(pair, block_size):
    target, draft = pair
    with pytest.raises(PdflashError, match="between 1 and the draft's trained block size 4"):
        speculative_generate(target, draft, PROMPT, 5, block_size=block_size)


def test_bad_arguments(pair, reference):
    target, draft = pair
    with pytest.raises(PdflashError, match="empty"):
        speculative_generate(target, draft, [], 5)
    with pytest.raises(PdflashError, match="greedy"):
        speculative_generate(target, draft, PROMPT, 5, temperature=0.8,
                             oracle=make_oracle(target, PROMPT, 5, 0.5, reference=reference[:5]))


# -- sampling is distribution-preserving ---------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 3.29 is p = 0.0005."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    stat, df = 0.0, -1
    for cell, p in probs.items():
        expected = n * p
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        df += 1
    return stat, df


def _run_rule(rule, p_at, q_at, length, block, gen):
    """Generate ``length`` tokens with draft-then-verify steps where the target's distribution at
    absolute position t is p_at[t] and the draft's is q_at[t], independent of the prefix."""
    out = []
    while len(out) < length:
        t = len(out)
        n = min(block - 1, length - t - 1)
        q = q_at[t : t + n]
        x = torch.multinomial(q, 1, generator=gen)[:, 0] if n else torch.empty(0, dtype=torch.long)
        n_acc, nxt = rule(x, q, p_at[t : t + n + 1], gen)
        out += x[:n_acc].tolist() + [nxt]
    return tuple(out[:length])


def _resample_from_p(proposals, q, p, gen):
    """A wrong rule (rejections redrawn from p, not from norm(max(0, p - q)))."""
    n = proposals.shape[0]
    idx = torch.arange(n)
    ok = torch.rand(n, generator=gen) * q[idx, proposals] <= p[idx, proposals]
    n_acc = int(ok.long().cumprod(0).sum())
    return n_acc, int(torch.multinomial(p[n_acc], 1, generator=gen))


@pytest.mark.parametrize("rule, should_pass", [(accept_sampling, True), (_resample_from_p, False)])
def test_speculative_sampling_rule_reproduces_target_distribution(rule, should_pass):
    gen = torch.Generator().manual_seed(7)
    vocab, length, n = 4, 3, 6000
    p_at = torch.softmax(torch.randn(length, vocab, generator=gen) * 1.5, -1)
    q_at = torch.softmax(torch.randn(length, vocab, generator=gen) * 1.5, -1)
    counts: dict = {}
    for _ in range(n):
        seq = _run_rule(rule, p_at, q_at, length, 3, gen)
        counts[seq] = counts.get(seq, 0) + 1
    probs = {}
    for a in range(vocab):
        for b in range(vocab):
            for c in range(vocab):
                probs[(a, b, c)] = float(p_at[0, a] * p_at[1, b] * p_at[2, c])
    stat, df = _chi2(counts, probs, n)
    assert (stat < _chi2_critical(df)) == should_pass, (stat, _chi2_critical(df))


@pytest.mark.parametrize("planned", [False, True], ids=["block-3", "planner"])
def test_end_to_end_sampling_matches_target_distribution(tmp_path, planned):
    """Tokens 2 and 3 after the prompt come from verify passes (accepted proposals, residual draws
    and bonus tokens), or with a block planner from its cold start's plain steps, which the loop
    runs as plain decoding (decided ahead); their joint frequency must match the target's exact
    joint distribution."""
    from pdflash.draft.planner import BlockPlanner
    from pdflash.offload.cost import CostModel

    target, draft = make_pair(tmp_path, vocab=4, logit_scale=10.0)
    prompt, temp, n = [1, 2, 3, 0, 1], 1.0, 500
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1] / temp, -1)
        seqs = torch.tensor([prompt + [a, b] for a in range(4) for b in range(4)])
        logits = target(input_ids=seqs).logits / temp  # [16, P+2, V]
    probs = {}
    for i, (a, b) in enumerate((a, b) for a in range(4) for b in range(4)):
        p2 = torch.softmax(logits[i, len(prompt)], -1)  # P(t2 = b | t1 = a) is row 4a+*, position P
        p3 = torch.softmax(logits[i, len(prompt) + 1], -1)  # P(t3 | t1 = a, t2 = b)
        for c in range(4):
            probs[(b, c)] = probs.get((b, c), 0.0) + float(p1[a] * p2[b] * p3[c])
    gen = torch.Generator().manual_seed(11)
    counts: dict = {}
    accepted = 0
    cfg = target.config
    for _ in range(n):
        planner = BlockPlanner(3, CostModel(1_000_000), num_layers=cfg.num_hidden_layers, num_experts=cfg.num_local_experts,
                               top_k=cfg.num_experts_per_tok) if planned else None
        r = speculative_generate(target, draft, prompt, 3, block_size=3, temperature=temp, generator=gen, planner=planner)
        key = tuple(r.token_ids[1:3])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(r.stats.accepted_per_position)
        if planned:
            assert r.planner["block_histogram"] == {"1": 2}  # both steps plain, decided ahead
    if not planned:
        assert 0.1 * n < accepted < 0.9 * n  # both acceptance and rejection were exercised
    probs = {k: v for k, v in probs.items() if v * n >= 5}  # pool the rare cells
    counts = {k: counts.get(k, 0) for k in probs} | {"rest": n - sum(counts.get(k, 0) for k in probs)}
    rest = 1.0 - sum(probs.values())
    if rest * n >= 5:
        probs["rest"] = rest
    else:
        counts.pop("rest")
    stat, df = _chi2(counts, probs, n)
    assert stat < _chi2_critical(df), (stat, df)


# -- route-ahead --------------------------------------------------------------------------------


def test_router_bank_equals_the_targets_own_routers(pair):
    target, _ = pair
    bank = _RouterBank(target)
    h = torch.randn(6, 32)
    got = bank.route(h, [0, 2, 3])
    for j, layer in enumerate([0, 2, 3]):
        mod = target.model.layers[layer]
        with torch.no_grad():
            _, _, want = mod.mlp.router(mod.post_attention_layernorm(h))
        assert [set(r) for r in got[j].tolist()] == [set(r) for r in want.tolist()]


def test_report_arithmetic():
    r = RouteAheadReport("x", 1, bytes_per_expert=100, predicted=[0, 0], used=[0, 0], hits=[0, 0])
    r.add({0: {1, 2, 3}, 1: {7}}, {0: {2, 3, 4, 5}, 1: {6}})
    r.add({0: {4}}, {0: {4}, 1: {6}})
    d = r.to_dict()
    assert (d["predicted"], d["used"], d["hits"]) == (5, 7, 3)
    assert d["recall"] == 3 / 7 and d["precision"] == 3 / 5
    assert (d["useful_bytes"], d["wasted_bytes"]) == (300, 200)
    assert d["per_layer"][1] == {"layer": 1, "predicted": 1, "used": 2, "hits": 0, "recall": 0.0, "precision": 0.0}


def _forwards(rows, num_layers):
    """Group recorded rows (one per layer per forward) into forwards: list of (layer -> set, T)."""
    out = []
    for i in range(0, len(rows), num_layers):
        chunk = rows[i : i + num_layers]
        out.append(({layer: s for layer, s, _ in chunk}, chunk[0][2]))
    return out


def test_previous_predictor_scored_against_independently_recorded_experts(pair, reference):
    target, draft = pair
    submissions = []
    ra = RouteAhead(target, "previous", lambda experts, prio: submissions.append((experts, prio)),
                    block_size=4, bytes_per_expert=1000)
    rows: list = []

    def record(layer):
        def hook(module, args):
            rows.append((layer, set(args[1].reshape(-1).tolist()), args[1].shape[0]))
        return hook

    handles = [l.mlp.experts.register_forward_pre_hook(record(i)) for i, l in enumerate(target.model.layers)]
    try:
        result = speculative_generate(target, draft, PROMPT, 30, block_size=4, route_ahead=ra,
                                      oracle=make_oracle(target, PROMPT, 30, 0.7, reference=reference[:30]))
    finally:
        for h in handles:
            h.remove()
        ra.close()
    assert result.token_ids == reference[:30]
    fwd = _forwards(rows, 4)
    verifies = fwd[1:]
    assert len(verifies) == result.stats.verify_steps
    # "previous" first predicts the union of the prefill's last block-size positions, taken here
    # from transformers' router logits, then each verify pass's union
    with torch.no_grad():
        out = target(input_ids=torch.tensor([PROMPT]), output_router_logits=True)
    prev = {l: set(torch.topk(lg, 2, dim=-1).indices[-4:].reshape(-1).tolist()) for l, lg in enumerate(out.router_logits)}
    predicted, used, hits = 0, 0, 0
    for sets, _ in verifies:
        for layer in range(4):
            predicted += len(prev[layer])
            used += len(sets[layer])
            hits += len(prev[layer] & sets[layer])
        prev = sets
    rep = result.route_ahead
    assert (rep["predicted"], rep["used"], rep["hits"]) == (predicted, used, hits)
    assert rep["wasted_bytes"] == (predicted - hits) * 1000 and rep["useful_bytes"] == hits * 1000
    assert sum(len(v) for s, _ in submissions for v in s.values()) == predicted
    assert all(prio == 1 for _, prio in submissions)
    assert all(v == sorted(set(v)) and all(0 <= e < 8 for e in v) for s, _ in submissions for v in s.values())


@pytest.mark.parametrize("predictor, window", [
    ("draft-router", None), ("lookahead", None), ("draft-router+previous", None), ("draft-router+previous", 1),
    ("lookahead", 2),
])
def test_predictions_are_submitted_before_the_layers_they_name_run(pair, reference, predictor, window):
    """Each prefetch naming layer M reaches the sink before layer M starts in the verify pass, and
    with a window W no earlier than when layer M - W starts (before the pass: only M < W)."""
    target, draft = pair
    events = []
    ra = RouteAhead(target, predictor, lambda experts, prio: events.append(("prefetch", set(experts))),
                    block_size=4, lookahead_depth=2, window_layers=window)

    def mark(kind, layer):
        def hook(module, *args):
            events.append((kind, layer))
        return hook

    layers = target.model.layers
    handles = [l.register_forward_pre_hook(mark("start", i)) for i, l in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(mark("end", 3)))
    steps = []
    try:
        result = speculative_generate(target, draft, PROMPT, 25, block_size=4, route_ahead=ra,
                                      on_step=lambda info: steps.append(info))
    finally:
        for h in handles:
            h.remove()
        ra.close()
    assert result.token_ids == reference[:25]
    assert sum(i.route_ahead_submitted for i in steps) == result.route_ahead["predicted"]
    current, bad = -1, []  # current: layer running in a verify pass, -1 between passes
    for kind, what in events[5:]:  # skip the prefill's 4 starts and its end
        if kind == "start":
            current = what
        elif kind == "end":
            current = -1
        else:
            for m in what:
                if m <= current or (window is not None and m > (current + window if current >= 0 else window - 1)):
                    bad.append((m, current))
    assert not bad
    rep = result.route_ahead
    assert rep["steps"] == result.stats.verify_steps and 0 < rep["recall"] <= 1 and 0 < rep["precision"] <= 1
    if predictor == "lookahead":
        assert rep["per_layer"][0]["predicted"] == 0  # nothing runs before layer 0 in a verify pass


def test_unknown_predictor(pair):
    target, _ = pair
    with pytest.raises(PdflashError, match="unknown route-ahead predictor"):
        RouteAhead(target, "psychic", None, block_size=4)


def test_prompt_lookup_copies_earlier_text_and_stays_lossless(pair):
    """A prompt that repeats itself: what followed the last 3 tokens earlier leads the verify block
    when the draft proposes otherwise; the output is transformers' greedy either way."""
    target, draft = pair
    prompt = PROMPT * 3
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    on = speculative_generate(target, draft, prompt, 30, block_size=4)
    off = speculative_generate(target, draft, prompt, 30, block_size=4, lookup=False)
    assert on.token_ids == want and off.token_ids == want
    assert on.stats.copied_steps > 0 and off.stats.copied_steps == 0
    assert on.to_dict()["copied_steps"] == on.stats.copied_steps


def test_repeat_index_continuation():
    from pdflash.draft.speculative import RepeatIndex

    t = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    r = RepeatIndex(t)
    assert r.continuation(t, 2) == [4, 5] and r.continuation(t, 10) == [4, 5, 6, 1, 2, 3]
    t += [9, 1, 2, 3]
    assert r.continuation(t, 2) == [9, 1]  # the latest earlier occurrence
    assert r.continuation([1, 2, 3], 2) == [] and r.continuation(t, 0) == []
