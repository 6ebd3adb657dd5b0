"""DFlash draft: config parsing and presets, checkpoint loading and errors, shared embeddings,
the forward against an independent from-scratch reference, and the target feature index."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from pdflash import PdflashError
from pdflash.draft import (
    DFlashConfig,
    DraftKVCache,
    FeatureTap,
    TargetShape,
    draft_tensor_shapes,
    load_draft,
    spread_layer_ids,
    write_synthetic_draft,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def tiny_target(vocab=96, layers=4, hidden=32, seed=0):
    cfg = GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=6, max_position_embeddings=4096, rope_parameters=dict(YARN),
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), pad_token_id=0,
    )
    torch.manual_seed(seed)
    return GptOssForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_target()
    target.config.save_pretrained(root / "target")
    write_synthetic_draft(root / "draft", "tiny", target_dir=root / "target", seed=3)
    return target, load_draft(root / "draft", target), root


# -- config -------------------------------------------------------------------------------------


def test_published_preset_shape_and_config_json():
    cfg = DFlashConfig.from_preset("gpt-oss-20b-DFlash")
    raw = cfg.to_dict()
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": 200000, "target_layer_ids": [1, 6, 11, 16, 21]}
    assert (raw["block_size"], raw["num_hidden_layers"], raw["hidden_size"], raw["intermediate_size"]) == (8, 8, 2880, 7680)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (64, 8, 64)
    assert raw["rope_theta"] == 150000.0 and raw["rope_scaling"]["factor"] == 32.0
    assert DFlashConfig.from_dict(json.loads(cfg.to_json())) == cfg

    shapes = draft_tensor_shapes(cfg)
    assert shapes["fc.weight"] == (2880, 5 * 2880)
    assert shapes["layers.7.self_attn.q_proj.weight"] == (64 * 64, 2880)
    assert shapes["layers.0.self_attn.k_proj.bias"] == (8 * 64,)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (64,)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (7680, 2880)
    assert shapes["layers.0.mlp.down_proj.weight"] == (2880, 7680)
    assert {"hidden_norm.weight", "norm.weight", "layers.3.post_attention_layernorm.weight"} <= set(shapes)
    assert not any("embed" in n or "lm_head" in n for n in shapes)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 0.7e9 < params < 0.9e9  # "about 0.8B parameters"


def test_spread_layer_ids_reproduces_published_choice_and_stays_in_range():
    assert spread_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    for layers in range(1, 12):
        for count in range(1, 6):
            ids = spread_layer_ids(layers, count)
            assert ids == sorted(set(ids)) and all(0 <= i < layers for i in ids)
            assert len(ids) == min(count, max(1, layers - 1))


def test_config_accepts_both_rope_spellings_and_block_size_inside_dflash_config():
    base = DFlashConfig.from_preset("gpt-oss-20b-DFlash").to_dict()
    modern = dict(base)
    modern.pop("rope_theta"), modern.pop("rope_scaling"), modern.pop("block_size")
    modern["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    modern["dflash_config"] = {**base["dflash_config"], "block_size": 16}
    cfg = DFlashConfig.from_dict(modern)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 5e5} and cfg.block_size == 16


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash draft"),
        ({"dflash_config": None}, "dflash_config"),
        ({"dflash_config": {"target_layer_ids": [1, 6]}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": 999999, "target_layer_ids": [1]}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 30]}}, "target_layer_ids"),
        ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": []}}, "target_layer_ids"),
        ({"block_size": 1}, "block_size"),
        ({"num_key_value_heads": 7}, "multiple"),
        ({"hidden_size": "big"}, "hidden_size"),
    ],
)
def test_bad_config_is_one_clear_error(patch, message):
    raw = {**DFlashConfig.from_preset("gpt-oss-20b-DFlash").to_dict(), **patch}
    with pytest.raises(PdflashError, match=message):
        DFlashConfig.from_dict(raw)


def test_missing_or_unreadable_draft_dir(tmp_path, pair):
    target, _, _ = pair
    with pytest.raises(PdflashError, match="does not exist"):
        load_draft(tmp_path / "nope", target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PdflashError, match="no config.json"):
        load_draft(tmp_path / "empty", target)
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(PdflashError, match="not valid JSON"):
        load_draft(tmp_path / "empty", target)


# -- checkpoints --------------------------------------------------------------------------------


def test_synthetic_checkpoint_names_dtypes_and_seed(tmp_path, pair):
    from safetensors import safe_open

    _, _, root = pair
    cfg = write_synthetic_draft(tmp_path / "a", "tiny", target_dir=root / "target", seed=1, dtype="bfloat16")
    write_synthetic_draft(tmp_path / "b", "tiny", target_dir=root / "target", seed=1, dtype="bfloat16")
    write_synthetic_draft(tmp_path / "c", "tiny", target_dir=root / "target", seed=2, dtype="bfloat16")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    on_disk = json.loads((tmp_path / "a" / "config.json").read_text())
    assert on_disk["dtype"] == "bfloat16" and DFlashConfig.from_dict(on_disk) == cfg
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{m}_proj.{w}" for m in "qkvo" for w in ("weight", "bias")}
        expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        expected |= {p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected


def test_tiny_preset_is_fitted_to_the_target(pair):
    target, draft, _ = pair
    shape = TargetShape.from_config(target.config)
    cfg = draft.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (32, 96, 4)
    assert cfg.mask_token_id == 95 and cfg.target_layer_ids == [1, 2, 3]
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0
    cfg.check_fits(shape)
    with pytest.raises(PdflashError, match="fitted to a target"):
        DFlashConfig.from_preset("tiny")
    with pytest.raises(PdflashError, match="unknown draft preset"):
        DFlashConfig.from_preset("huge")


def test_embeddings_and_head_are_shared_not_copied(pair):
    target, draft, _ = pair
    assert draft.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    own = dict(draft.named_parameters())
    assert not any("embed" in n or "lm_head" in n for n in own)
    assert set(draft.state_dict()) == set(draft_tensor_shapes(draft.config))
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not target_ptrs & {p.data_ptr() for p in own.values()}


def test_head_of_a_block_slice_is_the_target_head_row_by_row(pair):
    target, draft, _ = pair
    torch.manual_seed(3)
    hidden = torch.randn(1, 5, target.config.hidden_size)
    got = draft.head(hidden[:, 1:])  # a slice: its leading stride is the full block's
    assert got.shape == (1, 4, target.config.vocab_size)
    want = torch.stack([target.lm_head(hidden[0, i].contiguous()) for i in range(1, 5)])[None]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "target_kwargs, message",
    [({"hidden": 64}, "hidden size"), ({"vocab": 97}, "vocabulary"), ({"layers": 2}, "layers")],
)
def test_draft_that_does_not_fit_the_target(pair, target_kwargs, message):
    _, _, root = pair
    with pytest.raises(PdflashError, match=message):
        load_draft(root / "draft", tiny_target(**target_kwargs))


def test_missing_tensor_and_corrupt_weights(tmp_path, pair):
    from safetensors.torch import load_file, save_file

    target, _, root = pair
    write_synthetic_draft(tmp_path / "d", "tiny", target_dir=root / "target")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(PdflashError, match="missing layers.1.mlp.up_proj.weight"):
        load_draft(tmp_path / "d", target)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(PdflashError, match="cannot be read"):
        load_draft(tmp_path / "d", target)
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(PdflashError, match="no model.safetensors"):
        load_draft(tmp_path / "d", target)


# -- forward ------------------------------------------------------------------------------------


def _norm(x, weight, eps):
    mod = Qwen3RMSNorm(weight.shape[0], eps=eps)
    mod.weight.data.copy_(weight)
    return mod(x)


def reference_hidden(draft, features, block_ids):
    """From-scratch DFlash forward over the whole context, written from the format description
    with transformers' Qwen3 rotary and eager attention (no draft cache involved)."""
    cfg, sd, eps = draft.config, draft.state_dict(), draft.config.rms_norm_eps
    c, b, d = features.shape[1], block_ids.shape[1], cfg.head_dim
    ctx = _norm(F.linear(features, sd["fc.weight"]), sd["hidden_norm.weight"], eps)
    x = draft.embed_tokens(block_ids)
    rot = Qwen3RotaryEmbedding(Qwen3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=d,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(cfg.rope_parameters)))
    cos, sin = rot(x, torch.arange(c + b)[None])
    module = SimpleNamespace(num_key_value_groups=cfg.num_attention_heads // cfg.num_key_value_heads, training=False)
    mask = None
    if cfg.sliding_window is not None:
        q_pos, k_pos = torch.arange(c, c + b)[:, None], torch.arange(c + b)[None]
        mask = torch.where(q_pos - k_pos < cfg.sliding_window, 0.0, float("-inf"))[None, None]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = _norm(x, sd[p + "input_layernorm.weight"], eps)
        q = F.linear(h, sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.q_proj.bias"]).view(1, b, -1, d)
        q = _norm(q, sd[p + "self_attn.q_norm.weight"], eps).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=1)  # context first
        k = F.linear(kv_in, sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.k_proj.bias"]).view(1, c + b, -1, d)
        k = _norm(k, sd[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
        v = F.linear(kv_in, sd[p + "self_attn.v_proj.weight"], sd[p + "self_attn.v_proj.bias"])
        v = v.view(1, c + b, -1, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, c:], sin[:, c:])
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        attn, _ = eager_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
        x = x + F.linear(attn.reshape(1, b, -1), sd[p + "self_attn.o_proj.weight"], sd[p + "self_attn.o_proj.bias"])
        h = _norm(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate = F.linear(h, sd[p + "mlp.gate_proj.weight"])
        x = x + F.linear(F.silu(gate) * F.linear(h, sd[p + "mlp.up_proj.weight"]), sd[p + "mlp.down_proj.weight"])
    return _norm(x, sd["norm.weight"], eps)


def test_forward_matches_from_scratch_reference_with_chunked_context(pair):
    """Context appended a few committed tokens at a time, or handed to the forward itself (one
    pass over the layers for the new context and the block): both match the reference."""
    target, draft, _ = pair
    torch.manual_seed(0)
    feats = torch.randn(1, 9, 3 * 32)
    block = draft.block_ids(17, 4, "cpu")
    want = reference_hidden(draft, feats, block)
    draft.reset_context()
    for lo, hi in ((0, 3), (3, 5), (5, 9)):  # context arrives a few committed tokens at a time
        draft.append_context(feats[:, lo:hi])
    torch.testing.assert_close(draft(block, start=9), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block starts at 8"):
        draft(block, start=8)
    draft.reset_context()
    draft.append_context(feats[:, :6])
    torch.testing.assert_close(draft(block, start=9, context=feats[:, 6:]), want, rtol=1e-5, atol=1e-5)
    assert draft.context_length == 9
    with pytest.raises(ValueError, match="holds 11 context positions"):
        draft(block, start=9, context=feats[:, :2])


def test_packed_weights_are_views_and_fall_back_when_replaced(pair):
    """load_draft stacks q / k / v and gate / up as row views of one tensor (no copy, same
    state_dict); a layer whose weight is replaced afterwards runs on its own again."""
    target, draft, root = pair
    att, mlp = draft.layers[0].self_attn, draft.layers[0].mlp
    stacked = att._qkv.weight
    assert att.q_proj.weight.data_ptr() == stacked.data_ptr()
    assert att.k_proj.weight.data_ptr() == stacked[att.q_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp._gate_up.weight[mlp.gate_proj.out_features:].data_ptr()
    fresh = load_draft(root / "draft", target)
    assert set(fresh.state_dict()) == set(draft_tensor_shapes(fresh.config))
    torch.manual_seed(5)
    feats = torch.randn(1, 6, 3 * 32)
    block = fresh.block_ids(17, 4, "cpu")
    want = reference_hidden(fresh, feats, block)
    with torch.no_grad():
        fresh.layers[1].self_attn.k_proj.weight = torch.nn.Parameter(fresh.layers[1].self_attn.k_proj.weight * 2)
        fresh.layers[1].mlp.gate_proj.weight = torch.nn.Parameter(fresh.layers[1].mlp.gate_proj.weight + 0.1)
    assert not fresh.layers[1].self_attn._qkv.intact() and fresh.layers[0].self_attn._qkv.intact()
    fresh.append_context(feats)
    got = fresh(block, start=6)
    torch.testing.assert_close(got, reference_hidden(fresh, feats, block), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, want)  # the replaced weights are the ones used
    moved = load_draft(root / "draft", target).to(torch.float64)  # Module.to swaps the data in place
    assert not moved.layers[0].self_attn._qkv.intact() and not moved.layers[0].mlp._gate_up.intact()
    moved.append_context(feats.double())
    torch.testing.assert_close(moved(block, start=6), want.double(), rtol=1e-5, atol=1e-5)


def test_forward_is_non_causal_and_reads_the_context(pair):
    _, draft, _ = pair
    torch.manual_seed(1)
    feats = torch.randn(1, 5, 3 * 32)
    draft.reset_context()
    draft.append_context(feats)
    a = draft(torch.tensor([[3, 95, 95, 95]]), start=5)
    b = draft(torch.tensor([[3, 95, 95, 7]]), start=5)
    assert not torch.allclose(a[:, 1], b[:, 1])  # position 1 sees position 3
    draft.reset_context()
    draft.append_context(feats + 1.0)
    c = draft(torch.tensor([[3, 95, 95, 95]]), start=5)
    assert not torch.allclose(a, c)


def test_sliding_window_layers_match_reference(pair):
    target, _, root = pair
    cfg = DFlashConfig.from_dict({**json.loads((root / "draft" / "config.json").read_text()),
                                  "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4})
    from pdflash.draft.model import DFlashDraftModel
    from pdflash.draft.synthetic import synthetic_draft_tensors

    model = DFlashDraftModel(cfg, target.model.embed_tokens, target.lm_head)
    model.load_state_dict(synthetic_draft_tensors(cfg, 5, torch.float32))
    feats = torch.randn(1, 7, 3 * 32)
    model.append_context(feats)
    block = model.block_ids(11, 4, "cpu")
    got = model(block, start=7)
    # the reference applies the window to every layer, so compare layer-uniform configs
    cfg_all = DFlashConfig.from_dict({**cfg.to_dict(), "layer_types": ["sliding_attention"] * 2})
    uniform = DFlashDraftModel(cfg_all, target.model.embed_tokens, target.lm_head)
    uniform.load_state_dict(model.state_dict())
    uniform.append_context(feats)
    torch.testing.assert_close(uniform(block, start=7), reference_hidden(uniform, feats, block), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, uniform(block, start=7))  # the full-attention layer sees further back


def test_kv_cache_grows_in_place_and_crops():
    cache = DraftKVCache(num_layers=2, kv_heads=1, head_dim=2, device="cpu", dtype=torch.float32, capacity=2)
    chunks = [torch.randn(1, 1, n, 2) for n in (1, 2, 4)]
    for chunk in chunks:
        cache.reserve(chunk.shape[2])
        cache.write(0, chunk, -chunk)
        cache.write(1, 2 * chunk, chunk)
        cache.advance(chunk.shape[2])
    k0, v0 = cache.get(0)
    torch.testing.assert_close(k0, torch.cat(chunks, dim=2))
    torch.testing.assert_close(v0, -torch.cat(chunks, dim=2))
    assert cache.capacity >= 7 and cache.length == 7
    cache.crop(3)
    torch.testing.assert_close(cache.get(1)[0], 2 * torch.cat(chunks, dim=2)[:, :, :3])
    with pytest.raises(ValueError):
        cache.crop(4)


# -- target features ----------------------------------------------------------------------------


def test_feature_index_is_output_of_decoder_layer(pair):
    """Feature of layer i == hidden_states[i + 1] of output_hidden_states (index 0 = embeddings);
    the last layer's raw output is the pre-final-norm state."""
    target, _, _ = pair
    ids = torch.tensor([[5, 9, 2, 44, 7, 1, 3, 8]])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        tap = FeatureTap(target, [0, 2, 3])
        with tap.capture():
            target(input_ids=ids)
        feats = tap.take()
        tap.close()
    hs = out.hidden_states
    assert len(hs) == 5 and feats.shape == (1, 8, 3 * 32)
    torch.testing.assert_close(feats[..., :32], hs[1])
    torch.testing.assert_close(feats[..., 32:64], hs[3])
    torch.testing.assert_close(target.model.norm(feats[..., 64:]), hs[4])
    with torch.no_grad():  # removed hooks record nothing
        target(input_ids=ids)
    with pytest.raises(RuntimeError):
        tap.take()


def test_warm_up_leaves_the_context_and_outputs_unchanged(pair):
    _, draft, _ = pair
    torch.manual_seed(2)
    feats = torch.randn(1, 6, 3 * 32)
    block = draft.block_ids(11, 4, "cpu")
    draft.reset_context()
    draft.append_context(feats)
    before = draft(block, start=6)
    draft.warm_up(range(1, 9))
    assert draft.context_length == 6
    torch.testing.assert_close(draft(block, start=6), before, rtol=0, atol=0)
    draft.reset_context()
    draft.warm_up([2, 4])
    assert draft.context_length == 0 and draft.cache is None
