"""draft/graphed.py: the draft's passes over a static cache (what CUDA graphs replay) against the
from-scratch reference and the eager pass; buckets, chunks, the eager long append, reuse and
fallbacks; lossless speculative decoding with them. On the CPU the passes run eagerly; on a GPU
the replayed graphs are checked against the same passes run eagerly."""

import json

import pytest
import torch

from pdflash import PdflashError
from pdflash.draft import load_draft, speculative_generate
from pdflash.draft.config import DFlashConfig
from pdflash.draft.graphed import EAGER_CONTEXT_ROWS
from pdflash.draft.model import DFlashDraftModel
from pdflash.draft.speculative import greedy_generate
from pdflash.draft.synthetic import synthetic_draft_tensors
import test_draft_model
from test_draft_model import reference_hidden

pair = test_draft_model.pair  # the fixture: a tiny float32 target, its synthetic draft (blocks of 4) and their folder


def static_draft(pair, max_len=128, **kwargs):
    target, _, root = pair
    draft = load_draft(root / "draft", target)
    assert draft.use_graphs(max_len, graphs=False, **kwargs) and draft.graphed
    return draft


def test_static_passes_match_the_reference(pair):
    """Context a few tokens at a time, then in the forward itself (chunks of at most the trained
    block, here 4): the reference's hidden rows; the cache holds what the eager pass writes."""
    target, _, root = pair
    draft = static_draft(pair)
    torch.manual_seed(0)
    feats = torch.randn(1, 11, 3 * 32)
    block = draft.block_ids(17, 4, "cpu")
    want = reference_hidden(draft, feats, block)
    for lo, hi in ((0, 3), (3, 5), (5, 11)):  # 6 rows: a chunk of 4 and one of 2
        draft.append_context(feats[:, lo:hi])
    torch.testing.assert_close(draft(block, start=11), want, rtol=1e-5, atol=1e-5)
    assert draft.context_length == 11
    draft.reset_context()
    assert draft.context_length == 0 and draft.graphed
    draft.append_context(feats[:, :2])
    torch.testing.assert_close(draft(block, start=11, context=feats[:, 2:]), want, rtol=1e-5, atol=1e-5)
    eager = load_draft(root / "draft", target)
    eager.append_context(feats)
    for name in ("keys", "values"):
        torch.testing.assert_close(getattr(draft.cache, name)[:, :, :, :11], getattr(eager.cache, name)[:, :, :, :11],
                                   rtol=1e-5, atol=1e-6)
    assert draft._graphs.replays > 0


def test_long_context_appends_eagerly_and_blocks_cross_buckets(pair):
    """A prompt's worth of context (over EAGER_CONTEXT_ROWS) goes through the eager pass once; then
    steps of blocks 2..4 with a few committed tokens each, crossing key-length buckets of 16, 32,
    64: every step's hidden rows are the eager draft's."""
    target, _, root = pair
    draft = static_draft(pair, max_len=160, min_bucket=16)
    eager = load_draft(root / "draft", target)
    torch.manual_seed(1)
    n0 = EAGER_CONTEXT_ROWS + 5
    feats = torch.randn(1, 160, 3 * 32)
    for d in (draft, eager):
        d.append_context(feats[:, :n0])
    at, buckets = n0, set()
    for step, (b, n) in enumerate([(2, 1), (4, 3), (3, 2), (4, 4), (2, 7), (4, 1)] * 4):
        block = draft.block_ids(step % 90, b, "cpu")
        ctx = feats[:, at: at + n]
        at += n
        got, want = draft(block, start=at, context=ctx), eager(block, start=at, context=ctx)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        buckets.add(draft._graphs.bucket(at + b))
    assert buckets == {128, 164}  # 164: the whole cache (160 + a block of 4)
    assert draft.graphed


def test_sliding_window_layers_match_the_eager_pass(pair):
    """Mixed sliding / full layers with a window shorter than the context."""
    target, _, root = pair
    cfg = DFlashConfig.from_dict({**json.loads((root / "draft" / "config.json").read_text()),
                                  "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4})
    state = synthetic_draft_tensors(cfg, 5, torch.float32)
    models = []
    for _ in range(2):
        m = DFlashDraftModel(cfg, target.model.embed_tokens, target.lm_head)
        m.load_state_dict(state)
        models.append(m.pack())
    static, eager = models
    assert static.use_graphs(64, graphs=False, min_bucket=8)
    torch.manual_seed(2)
    feats = torch.randn(1, 20, 3 * 32)
    at = 0
    for b, n in ((4, 7), (2, 3), (4, 5), (3, 5)):
        block = static.block_ids(11, b, "cpu")
        ctx = feats[:, at: at + n]
        at += n
        torch.testing.assert_close(static(block, start=at, context=ctx), eager(block, start=at, context=ctx),
                                   rtol=1e-5, atol=1e-5)


def test_reuse_replaced_weights_and_room(pair):
    """A second use_graphs that fits keeps the object (its graphs are captured once); a weight
    replaced afterwards turns the static passes off for good and the eager pass carries on over
    the same context; a pass beyond the static cache is a clear error; enable=False turns it off."""
    target, _, root = pair
    draft = static_draft(pair, max_len=32)
    first = draft._graphs
    assert draft.use_graphs(16, graphs=False) and draft._graphs is first
    assert draft.use_graphs(64, graphs=False) and draft._graphs is not first  # too small: a new one
    torch.manual_seed(3)
    feats = torch.randn(1, 8, 3 * 32)
    block = draft.block_ids(5, 4, "cpu")
    draft.append_context(feats[:, :6])
    with torch.no_grad():
        draft.layers[0].mlp.down_proj.weight = torch.nn.Parameter(draft.layers[0].mlp.down_proj.weight * 1.5)
    got = draft(block, start=8, context=feats[:, 6:])
    assert not draft.graphed
    fresh = load_draft(root / "draft", target)
    with torch.no_grad():
        fresh.layers[0].mlp.down_proj.weight = torch.nn.Parameter(fresh.layers[0].mlp.down_proj.weight * 1.5)
    torch.testing.assert_close(got, reference_hidden(fresh, feats, block), rtol=1e-5, atol=1e-5)

    small = static_draft(pair, max_len=8)  # holds 8 + 4 positions
    small.append_context(feats)
    with pytest.raises(PdflashError, match="static cache holds 12 positions"):
        small(small.block_ids(5, 4, "cpu")[:, :4], start=12, context=torch.randn(1, 4, 3 * 32))
    assert not small.use_graphs(enable=False) and not small.graphed


def test_a_capture_cuda_refuses_falls_back_to_the_same_passes_eagerly(pair, monkeypatch):
    """If CUDA refuses a capture (at the start or on a new bucket mid-run), every pass runs the
    same functions eagerly from then on and ``failure`` says why; the results are unchanged."""
    target, _, root = pair
    draft = static_draft(pair)
    g = draft._graphs
    g.graphs = True  # as on CUDA; the capture itself is what fails here

    def refuse(fn):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    monkeypatch.setattr(g, "_capture", refuse)
    g.prepare(0, [2, 4])
    assert not g.graphs and g.failure == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    g.graphs = True
    torch.manual_seed(6)
    feats = torch.randn(1, 7, 3 * 32)
    block = draft.block_ids(9, 4, "cpu")
    got = draft(block, start=7, context=feats)
    assert not g.graphs and draft.graphed
    torch.testing.assert_close(got, reference_hidden(draft, feats, block), rtol=1e-5, atol=1e-5)
    from pdflash.draft.offloaded import draft_pass_kind
    assert draft_pass_kind(draft) == "static"
    assert draft.use_graphs(128, graphs=True) and draft._graphs is g  # not tried again: its eager passes serve


def _lossless(pair, block_size):
    target, _, root = pair
    prompt = [5, 17, 33, 2, 41, 8, 19]
    want = greedy_generate(target, prompt, 20)
    draft = static_draft(pair, max_len=len(prompt) + 20)
    res = speculative_generate(target, draft, prompt, 20, block_size=block_size)
    assert res.token_ids == want
    assert draft.graphed and draft._graphs.replays >= res.stats.verify_steps
    return res


@pytest.mark.parametrize("block_size", [2, 4])
def test_speculative_decoding_with_the_static_draft_is_lossless(pair, block_size):
    _lossless(pair, block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_what_the_static_passes_compute(pair, dtype):
    """On a GPU: the replayed graphs give the hidden rows (within rounding) of the same passes run
    eagerly, through chunked appends, an eager long append and a bucket change (graphs captured
    mid-run)."""
    target, _, root = pair
    gpu_target = test_draft_model.tiny_target().to("cuda", dtype)
    drafts = []
    for graphs in (True, False):
        d = load_draft(root / "draft", gpu_target, device="cuda", dtype=dtype)
        assert d.use_graphs(160, graphs=graphs, min_bucket=16, at=0, blocks=[2, 3, 4])
        drafts.append(d)
    torch.manual_seed(4)
    feats = torch.randn(1, 160, 3 * 32, device="cuda", dtype=dtype)
    at = EAGER_CONTEXT_ROWS + 3
    for d in drafts:
        d.append_context(feats[:, :at])
    with torch.inference_mode():
        for step, (b, n) in enumerate([(2, 1), (4, 3), (3, 2), (4, 4), (2, 7)] * 4):
            block = drafts[0].block_ids(step, b, "cuda")
            ctx = feats[:, at: at + n]
            at += n
            got, want = (d(block, start=at, context=ctx) for d in drafts)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"step {step}: {m}")
    assert drafts[0]._graphs.graphs and len(drafts[0]._graphs._graphs) > 4


@pytest.mark.gpu
def test_cuda_a_short_cache_is_one_bucket(pair):
    """With graphs and the default buckets, a cache of at most ONE_BUCKET positions is attended
    whole: the blocks prepared before the run are the only block graphs, however far the run goes
    (no capture when it passes MIN_BUCKET positions), and the rows are the eager passes'."""
    target, _, root = pair
    gpu_target = test_draft_model.tiny_target().to("cuda")
    drafts = []
    for graphs in (True, False):
        d = load_draft(root / "draft", gpu_target, device="cuda")
        assert d.use_graphs(400, graphs=graphs, at=0, blocks=[2, 3, 4])
        drafts.append(d)
    g = drafts[0]._graphs
    assert g.capacity <= g.ONE_BUCKET and g.bucket(1) == g.bucket(300) == g.capacity
    prepared = set(g._graphs)
    torch.manual_seed(6)
    feats = torch.randn(1, 400, 3 * 32, device="cuda")
    at = 0
    with torch.inference_mode():
        for step in range(70):  # past 256 positions
            b, n = (2, 3, 4)[step % 3], 4
            block = drafts[0].block_ids(step, b, "cuda")
            ctx = feats[:, at: at + n]
            at += n
            got, want = (d(block, start=at, context=ctx) for d in drafts)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert at > g.MIN_BUCKET and g.graphs and set(g._graphs) == prepared
