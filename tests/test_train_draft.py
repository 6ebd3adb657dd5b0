"""tools/train_draft.py: the batched training forward against the inference forward, the
distillation data against target-only greedy decoding and the runtime's feature tap, the metrics."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import GptOssConfig, GptOssForCausalLM

from pdflash.draft import DFlashConfig, FeatureTap, greedy_generate
from pdflash.draft.model import DFlashDraftModel


@pytest.fixture(scope="module")
def td(load_script):
    return load_script("tools/train_draft.py")


def tiny_draft(block=4, layers=2, hidden=32, vocab=64, k=2, seed=0):
    cfg = DFlashConfig(hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=vocab, block_size=block, mask_token_id=1,
                       target_layer_ids=list(range(k)), num_target_layers=k, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg, nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a norm applied to the wrong tensor shows
                p.uniform_(0.5, 1.5)
    return draft


def tiny_target(vocab=64, hidden=32, layers=2, seed=0):
    cfg = GptOssConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
                       layer_types=["sliding_attention", "full_attention"][:layers], pad_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return GptOssForCausalLM(cfg).eval().requires_grad_(False)


@torch.no_grad()
def test_block_forward_equals_the_inference_forward_per_row_anchors(td):
    block, n, t = 4, 3, 20
    draft = tiny_draft(block=block)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(n, t, 2 * 32, generator=gen)
    seqs = torch.randint(0, 64, (n, t), generator=gen)
    anchors = torch.tensor([[0, 5, 16], [3, 3, 9], [12, 1, 7]])  # different per row; a + block <= t
    got = td.block_forward(draft, feats, seqs, anchors, block)
    assert got.shape == (n, 3, block - 1, 64)
    for i in range(n):
        for j in range(3):
            a = int(anchors[i, j])
            draft.reset_context()
            draft.append_context(feats[i : i + 1, :a])
            hidden = draft(draft.block_ids(int(seqs[i, a]), block, "cpu"), a)
            want = draft.lm_head(hidden[:, 1:])[0]
            torch.testing.assert_close(got[i, j], want, atol=1e-4, rtol=1e-4)
    labels = td.block_labels(seqs, anchors, block)
    assert labels[1, 2].tolist() == seqs[1, 10:13].tolist()


@torch.no_grad()
def test_sequences_are_target_greedy_with_the_runtime_features(td):
    target = tiny_target()
    train_ids = torch.randint(3, 64, (400,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    train_ids[[50, 120, 260]] = td.EOS_ID
    held_ids = torch.randint(3, 64, (200,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    gen_len, layer_ids = 6, [0, 1]
    (seqs, feats, plen), (v_seqs, v_feats, v_plen) = td.make_sequences(
        target, train_ids, held_ids, 5, 4, gen_len, 2, (3, 9), 0.5, layer_ids, 0, torch.device("cpu"), lambda _m: None)
    assert seqs.shape == (5, 9 + gen_len) and feats.shape == (5, 9 + gen_len, 64) and v_seqs.shape[0] == 4
    assert sorted(set(plen.tolist()) | set(v_plen.tolist())) == [3, 6, 9]  # one length per generation batch
    for s_, f_, p_, src in ((seqs, feats, plen, train_ids), (v_seqs, v_feats, v_plen, held_ids)):
        for row, feat, p in zip(s_, f_, p_.tolist()):
            prompt = row[:p].tolist()
            assert any(prompt == src[s : s + p].tolist() for s in range(src.numel() - p))  # a window of its own stream
            assert row[p : p + gen_len].tolist() == greedy_generate(target, prompt, gen_len)
            assert (row[p + gen_len :] == td.PAD_ID).all() and (feat[p + gen_len - 1 :] == 0).all()
            with FeatureTap(target, layer_ids) as tap, tap.capture():
                target.model(input_ids=row[None, : p + gen_len - 1])
                want = tap.take()[0]
            torch.testing.assert_close(feat[: p + gen_len - 1].float(), want.to(torch.bfloat16).float(), atol=3e-2, rtol=3e-2)


def test_block_metrics_count_the_matching_prefix(td):
    labels = torch.tensor([[[5, 6, 7], [5, 6, 7]]])  # [1, 2 blocks, 3 positions]
    logits = torch.full((1, 2, 3, 10), -1.0)
    for j, guess in enumerate(([5, 0, 7], [5, 6, 0])):  # block 0: 1 match then a miss; block 1: 2 matches
        for i, tok in enumerate(guess):
            logits[0, j, i, tok] = 1.0
    acc, accept = td.block_metrics(logits, labels)
    assert acc == [1.0, 0.5, 0.5]
    assert accept == pytest.approx(1 + (1 + 2) / 2)


def test_repeat_fraction_and_file_starts(td):
    seqs = torch.tensor([[9, 1, 2, 1, 2, 1, 2, 3]])
    # bigrams of the generated positions 3..7: (2,1) new, (1,2) seen, (2,1) seen, (1,2) seen, (2,3) new
    assert td.repeat_fraction(seqs, torch.tensor([3]), 5, n=2) == pytest.approx(3 / 5)
    ids = torch.tensor([4, 4, 0, 5, 5, 5, 0, 6])
    assert td.file_starts(ids, 0, 2).tolist() == [0, 3]  # 7 leaves only one token
    lens = td.prompt_lengths(5, 8, 128, torch.Generator().manual_seed(0))
    assert sorted(lens) == [8, 38, 68, 98, 128]


def test_argument_problems(td):
    args = SimpleNamespace(block_size=8, draft_gen_len=80, draft_sequences=16, draft_val_sequences=4, draft_gen_batch=8,
                           draft_batch=4, draft_anchors=4, draft_max_steps=5, draft_val_every=2, draft_layers=3,
                           draft_prompt_min=8, draft_prompt_max=128, draft_file_start=0.25, draft_data_share=0.5,
                           draft_init=None)
    assert td.argument_problem(args) is None
    assert "--draft-gen-len" in td.argument_problem(SimpleNamespace(**{**vars(args), "draft_gen_len": 8}))
    assert "--draft-prompt-min" in td.argument_problem(SimpleNamespace(**{**vars(args), "draft_prompt_min": 200}))
    assert "--draft-file-start" in td.argument_problem(SimpleNamespace(**{**vars(args), "draft_file_start": 2.0}))
    assert "--draft-init" in td.argument_problem(SimpleNamespace(**{**vars(args), "draft_init": "/nonexistent"}))


def test_verify_walk_replays_the_loop(td):
    # anchors 0..5 of one row; the walk visits 0 (commits 3), 3 (commits 1), 4 (commits 2): 6 tokens, 3 passes
    walk = td.verify_walk([[3, 8, 8, 1, 2, 8]], block=4)
    assert walk["verify_passes"] == 3 and walk["acceptance_length"] == pytest.approx(2.0)
    assert walk["accepted_by_position"] == pytest.approx([2 / 3, 1 / 3, 0.0], abs=1e-3)

