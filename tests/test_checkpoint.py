"""Synthetic checkpoints have the real format; Checkpoint validates every kind of bad input."""

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdflash import PdflashError
from pdflash.offload.checkpoint import Checkpoint
from pdflash.offload.config import ModelPreset
from pdflash.offload.gpt_oss import GptOssFamily
from pdflash.offload.synthetic import write_checkpoint

TINY = ModelPreset.from_name("tiny")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "dense", TINY, seed=1)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    # small shards: exercises the index with several files
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "mx", TINY, seed=1, mxfp4=True, max_shard_bytes=150_000)


@pytest.fixture
def broken(tmp_path, dense_dir):
    """A fresh copy of the dense checkpoint to damage."""
    dst = tmp_path / "broken"
    shutil.copytree(dense_dir, dst)
    return dst


def _all_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


# -- the format is the real one ----------------------------------------------------------------------
def test_dense_names_shapes_match_transformers_model(dense_dir):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig.from_pretrained(dense_dir)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in _all_tensors(dense_dir).items()}
    assert got == expected
    config = json.loads((dense_dir / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["architectures"] == ["GptOssForCausalLM"]
    assert "quantization_config" not in config
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}


def test_mxfp4_layout_and_index(mxfp4_dir):
    config = json.loads((mxfp4_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    index = json.loads((mxfp4_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    t = _all_tensors(mxfp4_dir)
    assert set(index["weight_map"]) == set(t)
    E, H, I = TINY.num_local_experts, TINY.hidden_size, TINY.intermediate_size
    p = "model.layers.2.mlp.experts."
    assert t[p + "gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16) and t[p + "gate_up_proj_blocks"].dtype == torch.uint8
    assert t[p + "gate_up_proj_scales"].shape == (E, 2 * I, H // 32) and t[p + "gate_up_proj_scales"].dtype == torch.uint8
    assert t[p + "down_proj_blocks"].shape == (E, H, I // 32, 16)
    assert t[p + "down_proj_scales"].shape == (E, H, I // 32)
    assert t[p + "gate_up_proj_bias"].dtype == torch.bfloat16 and t[p + "down_proj_bias"].shape == (E, H)
    assert not any(k.endswith("experts.gate_up_proj") for k in t)


def test_gpt_oss_20b_preset_matches_reference_shapes():
    cfg = ModelPreset.from_name("gpt-oss-20b").hf_config({"<|return|>": 1, "<|endoftext|>": 2, "<|startoftext|>": 0}, mxfp4=True)
    fam = GptOssFamily(cfg)
    specs = fam.tensor_specs()
    p = "model.layers.23.mlp.experts."
    assert specs[p + "gate_up_proj_blocks"].shape == (32, 5760, 90, 16)
    assert specs[p + "gate_up_proj_scales"].shape == (32, 5760, 90)
    assert specs[p + "down_proj_blocks"].shape == (32, 2880, 90, 16)
    assert specs[p + "down_proj_scales"].shape == (32, 2880, 90)
    layout = fam.expert_layout({piece: torch.bfloat16 if "bias" in piece else torch.uint8 for piece in fam.expert_sources(0)})
    assert layout.payload_bytes == 13_236_480  # one MXFP4 expert of gpt-oss-20b
    assert fam.num_layers == 24 and fam.num_experts == 32 and fam.top_k == 4
    assert specs["model.embed_tokens.weight"].shape == (201088, 2880)
    assert specs["model.layers.0.self_attn.q_proj.weight"].shape == (4096, 2880)


def test_gpt_oss_120b_preset_has_20b_experts_in_more_layers():
    ids = {"<|return|>": 1, "<|endoftext|>": 2, "<|startoftext|>": 0}
    fam = GptOssFamily(ModelPreset.from_name("gpt-oss-120b").hf_config(ids, mxfp4=True))
    specs = fam.tensor_specs()
    assert fam.num_layers == 36 and fam.num_experts == 128 and fam.top_k == 4
    assert specs["model.layers.35.mlp.experts.gate_up_proj_blocks"].shape == (128, 5760, 90, 16)
    layout = fam.expert_layout({piece: torch.bfloat16 if "bias" in piece else torch.uint8 for piece in fam.expert_sources(0)})
    assert layout.payload_bytes == 13_236_480  # the same expert as gpt-oss-20b: 36 x 128 of them, 61 GB


def test_seeded(tmp_path, dense_dir):
    again = write_checkpoint(tmp_path / "again", TINY, seed=1)
    other = write_checkpoint(tmp_path / "other", TINY, seed=2)
    a, b, c = _all_tensors(dense_dir), _all_tensors(again), _all_tensors(other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.experts.gate_up_proj"], c["model.layers.0.mlp.experts.gate_up_proj"])


def test_routing_is_not_degenerate(dense_dir):
    """Random routers spread tokens over the experts (no expert takes everything)."""
    t = _all_tensors(dense_dir)
    x = torch.randn(512, TINY.hidden_size)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    for layer in range(TINY.num_hidden_layers):
        w = t[f"model.layers.{layer}.mlp.router.weight"].float()
        b = t[f"model.layers.{layer}.mlp.router.bias"].float()
        top = torch.topk(x @ w.T + b, TINY.num_experts_per_tok, dim=-1).indices
        share = torch.bincount(top.reshape(-1), minlength=TINY.num_local_experts).float() / top.numel()
        assert share.max() < 0.5 and int((share > 0).sum()) == TINY.num_local_experts


def test_tokenizer_and_chat_template(dense_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense_dir)
    text = "The router keeps the best experts."
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < TINY.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|start|>user<|message|>hi<|end|><|start|>assistant<|message|>"
    config = json.loads((dense_dir / "config.json").read_text())
    assert tok.convert_ids_to_tokens(config["eos_token_id"]) == "<|return|>"


def test_checkpoint_opens_both_forms(dense_dir, mxfp4_dir):
    with Checkpoint(dense_dir) as c:
        assert not c.family.quantized and c.stored_dtype == torch.bfloat16
        assert c.get("model.layers.1.mlp.experts.down_proj").shape == (8, 64, 64)
    with Checkpoint(mxfp4_dir) as c:
        assert c.family.quantized
        assert c.dtype("model.layers.3.mlp.experts.down_proj_scales") == torch.uint8


# -- bad input: one clear line each ------------------------------------------------------------------
def _err(path) -> str:
    with pytest.raises(PdflashError) as info:
        Checkpoint(path)
    msg = str(info.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_missing_directory(tmp_path):
    assert "no such directory" in _err(tmp_path / "nope")


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    assert "is not a directory" in _err(f)


def test_missing_config(broken):
    (broken / "config.json").unlink()
    assert "no config.json" in _err(broken)


def test_malformed_config(broken):
    (broken / "config.json").write_text('{"model_type": "gpt_oss", ')
    assert "config.json is not valid JSON" in _err(broken)


def test_config_not_an_object(broken):
    (broken / "config.json").write_text("[1, 2]")
    assert "must hold a JSON object" in _err(broken)


def test_unsupported_architecture(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (broken / "config.json").write_text(json.dumps(cfg))
    msg = _err(broken)
    assert "unsupported model" in msg and "llama" in msg


def test_unsupported_quantization(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (broken / "config.json").write_text(json.dumps(cfg))
    assert "gptq" in _err(broken)


def test_invalid_config_values(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_experts_per_tok"] = 99
    (broken / "config.json").write_text(json.dumps(cfg))
    assert "num_experts_per_tok" in _err(broken)


def test_no_weights(broken):
    (broken / "model.safetensors").unlink()
    assert "no model.safetensors" in _err(broken)


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) * 2 // 3])
    msg = _err(broken)
    assert "model.safetensors is not a readable safetensors file" in msg and "download it again" in msg


def test_corrupt_header(broken):
    f = broken / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + n] = b"!" * n
    f.write_bytes(bytes(data))
    assert "not a readable safetensors file" in _err(broken)


def test_missing_shard(tmp_path, mxfp4_dir):
    dst = tmp_path / "mx"
    shutil.copytree(mxfp4_dir, dst)
    victim = sorted(dst.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = _err(dst)
    assert victim.name in msg and "missing" in msg


def test_malformed_index(tmp_path, mxfp4_dir):
    dst = tmp_path / "mx"
    shutil.copytree(mxfp4_dir, dst)
    (dst / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    assert "index.json is malformed" in _err(dst)


def test_missing_tensor(broken):
    t = _all_tensors(broken)
    del t["model.layers.2.self_attn.sinks"]
    save_file(t, str(broken / "model.safetensors"))
    msg = _err(broken)
    assert "model.layers.2.self_attn.sinks is missing" in msg


def test_shape_mismatch(broken):
    t = _all_tensors(broken)
    t["model.layers.1.mlp.router.weight"] = torch.zeros(8, 32, dtype=torch.bfloat16)
    save_file(t, str(broken / "model.safetensors"))
    msg = _err(broken)
    assert "model.layers.1.mlp.router.weight has shape [8, 32]" in msg and "[8, 64]" in msg


def test_dtype_mismatch(tmp_path, mxfp4_dir):
    dst = tmp_path / "mx"
    shutil.copytree(mxfp4_dir, dst)
    t = _all_tensors(dst)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    t[name] = t[name].to(torch.int32)
    for f in dst.glob("model*"):
        f.unlink()
    save_file(t, str(dst / "model.safetensors"))
    assert f"{name} has dtype I32" in _err(dst)
