"""benchmarks/bench_embedded.py: its measurement functions on the embedded pair, at small sizes."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from pdflash.draft import load_draft
from pdflash.offload.embedded import embedded_draft, embedded_target
from pdflash.offload.runtime import OffloadedModel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def be(load_script):
    return load_script("benchmarks/bench_embedded.py")


@pytest.fixture(scope="module")
def runtime():
    with OffloadedModel.load(embedded_target(), device="cpu", block_tokens=8) as rt:
        yield rt


@pytest.fixture(scope="module")
def corpus(be):
    root, files = be.held_out_files()
    return files, be.load_tokenizer()


def test_held_out_files_follow_the_training_rule(be, corpus):
    te = be._train_embedded()
    files, _ = corpus
    assert files and [rel for rel, _ in files] == sorted(rel for rel, _ in files)
    assert all(te.is_held_out(rel) and text.strip() for rel, text in files)


def test_held_out_loss_equals_a_window_by_window_computation(be, runtime, corpus):
    files, tok = corpus
    short = [(rel, text[:500]) for rel, text in files[:2]]
    stream, spans = be.encode_stream(tok, short)
    assert stream[spans[0][2] - 1] == tok.token_to_id("<|endoftext|>")  # each file ends with <|endoftext|>
    seq = 32
    res = be.held_out_loss(runtime, stream, spans, seq=seq, max_windows=None, batch=3)

    # reference: one window at a time, log-softmax of the runtime's logits at the next token
    n = stream.numel() // (seq + 1)
    nll, per_file = [], [0, 0]
    for w in range(n):
        x = stream[w * (seq + 1) : (w + 1) * (seq + 1)].long()
        logp = torch.log_softmax(runtime.forward(x[None, :-1]).logits[0].float(), dim=-1)
        nll += (-logp[torch.arange(seq), x[1:]]).tolist()
        for p in range(w * (seq + 1) + 1, (w + 1) * (seq + 1)):
            per_file[0 if p < spans[0][2] else 1] += 1
    assert res["windows"] == n and res["tokens"] == n * seq == len(nll)
    assert res["loss"] == pytest.approx(sum(nll) / len(nll), abs=2e-2)  # bf16 rounding of a batched forward
    assert [f["tokens"] for f in res["per_file"]] == per_file
    assert sum(g["tokens"] for g in res["groups"].values()) == res["tokens"]
    assert 0 < res["loss"] < math.log(runtime.config.vocab_size)  # better than a uniform guess


def test_top_share_against_brute_force(be):
    assert be.top_share(torch.full((2, 16), 5))["overall"] == pytest.approx(0.25)
    one_hot = torch.zeros(2, 16, dtype=torch.long)
    one_hot[:, 3] = 7
    assert be.top_share(one_hot)["per_layer"] == [1.0, 1.0]
    counts = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(1))
    s = be.top_share(counts)
    for layer in range(3):
        row = counts[layer].tolist()
        best = max(sum(row[i] for i in c) for c in itertools.combinations(range(8), 2))
        assert s["per_layer"][layer] == pytest.approx(best / sum(row))
    flat = counts.reshape(-1).tolist()
    assert s["overall"] == pytest.approx(sum(sorted(flat)[-6:]) / sum(flat))
    uni = be.uniform_top_share([1] * 4000, 2, 16, 4, repeats=3)
    assert 0.25 <= uni["overall"] < 0.28  # uniform routing: close to 25 % with a large sample


def test_generations_lossless_acceptance_route_ahead_concentration(be, runtime, corpus):
    files, tok = corpus
    draft = load_draft(embedded_draft(), runtime.model)
    prompts = be.prompt_prefixes(tok, files, 2, 24)
    assert [len(p) for _, p in prompts] == [24, 24]
    gen = be.run_generations(runtime, draft, prompts, 12, cache_experts=32, log=lambda m: None)

    acc = be.acceptance_summary(gen)
    assert acc["lossless"] and acc["mismatches"] == [] and acc["runs_checked"] == 2 * len(be.PREDICTORS)
    assert acc["block_size"] == 8 and acc["acceptance_length"] >= 1.0
    assert all(a is None or 0.0 <= a <= 1.0 for a in acc["acceptance_per_position"])
    assert acc["per_prompt"]["min"] <= acc["per_prompt"]["median"] <= acc["per_prompt"]["max"]

    ra = be.route_ahead_summary(gen)
    assert set(ra) == set(be.PREDICTORS)
    observed = sum(len(ex) for fwd in gen["routing"]["verify"] for ex in fwd.values())
    for name, row in ra.items():
        assert 0.0 <= row["recall"] <= 1.0 and 0.0 <= row["precision"] <= 1.0
        assert 0.0 <= row["cache_hit_rate"] <= 1.0
        assert row["used"] == observed  # the router tap and the runtime's observer saw the same experts
    union = ra["draft-router+previous+lookahead"]["recall"]
    assert union >= max(ra[p]["recall"] for p in ("draft-router", "previous", "lookahead")) - 1e-12

    L, E, K = runtime.family.num_layers, runtime.family.num_experts, runtime.family.top_k
    conc = be.concentration_summary(gen, L, E, K)
    dec = conc["decode_per_token"]
    assert dec["forwards"] == sum(p["reference_tokens"] - 1 for p in gen["prompts"])
    assert dec["uses"] == dec["forwards"] * L * K  # one token's top-k, distinct experts, every layer
    for key in ("decode_per_token", "verify_per_pass"):
        c = conc[key]
        assert 0.25 <= c["overall"] <= 1.0 and all(0.25 <= s <= 1.0 for s in c["per_layer"])
        assert c["uses"] == sum(map(sum, c["counts"]))
        assert 0.25 <= c["uniform_same_sample"]["overall"] <= 1.0


def test_bench_priority_headline_reads_the_shipped_result(be):
    path = ROOT / "docs" / "embedded" / "bm3-embedded.json"
    result = json.loads(path.read_text())
    h = be.bench_priority_headline(result)
    assert h["verdict"] == result["decision"]["verdict"]
    assert set(h["arms"]) == set(result["config"]["arms"])
    for arm in h["arms"].values():
        assert arm["tokens_per_second"]["lo"] <= arm["tokens_per_second"]["mean"] <= arm["tokens_per_second"]["hi"]
