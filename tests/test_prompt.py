"""offload/prompt.py: a prompt run in chunks through the KV cache gives the logits and tokens of one
whole forward, in every prefill path (plain, graphed decoder, speculative), and the context check."""

import importlib

import pytest
import torch

from pdflash import PdflashError
from pdflash.draft import load_draft, speculative_generate, write_synthetic_draft
from pdflash.draft.speculative import greedy_generate
from pdflash.offload.config import ModelPreset
from pdflash.offload.graphs import GraphedDecoder
from pdflash.offload.prompt import check_context, chunked_prefill
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint
from references import gpt_oss_reference  # noqa: E402

prefill_mod = importlib.import_module("pdflash.offload.prompt")
gen_mod = importlib.import_module("pdflash.offload.generate")
TINY = ModelPreset.from_name("tiny")
# 29 tokens: several chunks of 5 (not a multiple), across the sliding window (8)
PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90, 12, 60, 61, 7, 8, 150, 33, 34, 2, 99, 120, 18, 19, 5, 6,
          230, 41]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill")
    write_checkpoint(root / "t", TINY, seed=21, dtype="float32", mxfp4=True)
    write_synthetic_draft(root / "d", "tiny", target_dir=root / "t", seed=22)
    return root


@pytest.fixture
def rt(ckpt):
    with OffloadedModel.load(ckpt / "t", expert_cache_experts=6, dtype="float32") as m:
        yield m


def test_chunks_are_consecutive_and_the_last_result_is_returned():
    seen = []
    out = chunked_prefill(lambda c, start: seen.append((start, c.tolist())) or start, torch.arange(10)[None], chunk=4)
    assert seen == [(0, [[0, 1, 2, 3]]), (4, [[4, 5, 6, 7]]), (8, [[8, 9]])] and out == 8
    with pytest.raises(PdflashError, match="empty"):
        chunked_prefill(lambda c, s: None, torch.zeros((1, 0), dtype=torch.long))


def test_eager_prefill_in_chunks_equals_one_forward(rt, monkeypatch):
    ids = torch.tensor([PROMPT])
    whole = gen_mod.prefill(rt, ids, rt.new_kv_cache(), chunk=len(PROMPT))
    forwards = []
    real = rt.forward
    monkeypatch.setattr(rt, "forward", lambda *a, **k: forwards.append(a[0].shape[1]) or real(*a, **k))
    chunked = gen_mod.prefill(rt, ids, rt.new_kv_cache(), chunk=5)
    assert forwards == [5, 5, 5, 5, 5, 4]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(rt, "forward", real)

    want = gen_mod.generate(rt, PROMPT, max_new_tokens=12, eos_token_ids=[]).token_ids  # default chunk: one forward
    monkeypatch.setattr(prefill_mod, "PREFILL_CHUNK", 5)
    assert gen_mod.generate(rt, PROMPT, max_new_tokens=12, eos_token_ids=[]).token_ids == want


def test_graphed_decoder_prefill_in_chunks_equals_one_forward(rt, monkeypatch):
    whole = GraphedDecoder(rt, max_len=48, graphs=False)
    want = whole.prefill(PROMPT)
    want_next = whole.decode(int(want.argmax()))
    monkeypatch.setattr(prefill_mod, "PREFILL_CHUNK", 5)
    dec = GraphedDecoder(rt, max_len=48, graphs=False)
    got = dec.prefill(PROMPT)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec.decode(int(got.argmax())), want_next, rtol=1e-5, atol=1e-5)
    assert dec.length == whole.length == len(PROMPT) + 1


def test_speculative_prefill_in_chunks_gives_the_same_tokens_and_draft_context(ckpt, monkeypatch):

    target = gpt_oss_reference(ckpt / "t", dtype=torch.float32).eval()
    draft = load_draft(ckpt / "d", target)
    want = speculative_generate(target, draft, PROMPT, 16)
    want_ctx = draft.cache.length
    reference = greedy_generate(target, PROMPT, 16)
    monkeypatch.setattr(prefill_mod, "PREFILL_CHUNK", 5)
    got = speculative_generate(target, draft, PROMPT, 16)
    assert got.token_ids == want.token_ids == reference  # lossless, chunked or not
    assert draft.cache.length == want_ctx  # the draft saw the features of every prompt position
    assert greedy_generate(target, PROMPT, 16) == reference


def test_context_check():
    cfg = {"max_position_embeddings": 64}
    check_context(cfg, 60, 4)  # exactly full
    with pytest.raises(PdflashError, match="lower --max-new-tokens to 4 or less"):
        check_context(cfg, 60, 5)
    with pytest.raises(PdflashError, match="shorten the prompt to 63 tokens or fewer"):
        check_context(cfg, 64, 1)
    with pytest.raises(PdflashError, match="lower --max-new-tokens below 64 and shorten the prompt"):
        check_context(cfg, 70, 64)
    check_context({}, 10**6, 10)  # no context in the config: nothing to check


def test_generate_refuses_past_the_context_before_any_forward(rt, monkeypatch):
    calls = []
    monkeypatch.setattr(rt, "forward", lambda *a, **k: calls.append(1))
    ctx = rt.config.max_position_embeddings
    with pytest.raises(PdflashError, match="context holds"):
        gen_mod.generate(rt, PROMPT, max_new_tokens=ctx)
    assert calls == []
