"""Peer baselines (pdflash.bench.peers) on the tiny synthetic gpt-oss checkpoints.

References are independent of the loader under test: transformers' own
``from_pretrained`` + ``generate`` on a bf16 checkpoint, and for MXFP4 a bf16
checkpoint written here from the dequantized experts; expert placement is also
checked element by element against values decoded by hand from the raw bytes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdflash import PdflashError
from pdflash.bench import peers
from pdflash.offload.config import ModelPreset
from pdflash.offload.mxfp4 import dequantize
from pdflash.offload.synthetic import write_checkpoint
from references import gpt_oss_reference  # noqa: E402

NEW_TOKENS = 8
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes by the low 3 bits; bit 3 is the sign
cuda = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """tiny checkpoints: bf16, MXFP4, and the MXFP4 one with experts dequantized to bf16 ("ref")."""
    root = tmp_path_factory.mktemp("peers")
    preset = ModelPreset.from_name("tiny")
    bf16 = write_checkpoint(root / "bf16", preset, mxfp4=False, seed=1, workers=1)
    mx = write_checkpoint(root / "mx", preset, mxfp4=True, seed=2, workers=1)
    ref = root / "ref"
    ref.mkdir()
    tensors = load_file(str(mx / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")  # ...experts.gate_up_proj or ...experts.down_proj
        tensors[base] = dequantize(tensors.pop(name), tensors.pop(base + "_scales"), torch.bfloat16)
    save_file(tensors, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mx / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(mx / f, ref / f)
    return {"bf16": bf16, "mx": mx, "ref": ref}


@pytest.fixture(scope="module")
def prompts(ckpts) -> list[list[int]]:
    return peers.encode_prompts(ckpts["bf16"], peers.DEFAULT_PROMPTS[:2])


def _hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' from_pretrained + generate(do_sample=False), EOS disabled."""

    model = gpt_oss_reference(str(model_dir), dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


# -- loader ----------------------------------------------------------------------------------
def test_bf16_loader_equals_from_pretrained_and_decodes_the_same(ckpts, prompts):

    ref = gpt_oss_reference(str(ckpts["bf16"]), dtype=torch.bfloat16).state_dict()
    model = peers.load_transformers_reference(ckpts["bf16"], "cpu", torch.bfloat16)
    mine = model.state_dict()
    assert mine.keys() == ref.keys()
    for name, t in ref.items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    res = peers.run_resident_arm(model, prompts, NEW_TOKENS, warmup_tokens=1)
    assert res["token_ids"] == _hf_greedy(ckpts["bf16"], prompts, NEW_TOKENS)


def test_mxfp4_loader_puts_each_dequantized_value_in_place(ckpts):
    model = peers.load_transformers_reference(ckpts["mx"], "cpu", torch.bfloat16)
    raw = load_file(str(ckpts["mx"] / "model.safetensors"))
    layer = 1
    experts = model.model.layers[layer].mlp.experts
    p = f"model.layers.{layer}.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = raw[p + proj + "_blocks"], raw[p + proj + "_scales"]  # [E, out, in/32, 16], [E, out, in/32]
        w = getattr(experts, proj)  # [E, in, out]
        assert torch.equal(w, dequantize(blocks, scales, torch.bfloat16))
        assert torch.equal(getattr(experts, proj + "_bias"), raw[p + proj + "_bias"])
        # Decode single elements from the bytes by hand: element i of row o is nibble i % 2 of
        # byte (i % 32) // 2 in group i // 32, times 2 ** (scale - 127).
        E, n_in, n_out = w.shape
        rng = random.Random(proj)
        for _ in range(300):
            e, i, o = rng.randrange(E), rng.randrange(n_in), rng.randrange(n_out)
            byte = int(blocks[e, o, i // 32, (i % 32) // 2])
            code = byte & 0x0F if i % 2 == 0 else byte >> 4
            value = (-1 if code & 8 else 1) * E2M1[code & 7] * 2.0 ** (int(scales[e, o, i // 32]) - 127)
            assert float(w[e, i, o]) == value, (proj, e, i, o)
    for name, t in raw.items():  # every non-expert tensor as stored
        if ".experts." not in name:
            assert torch.equal(model.get_parameter(name), t), name


def test_mxfp4_resident_arm_decodes_like_a_dequantized_bf16_checkpoint(ckpts, prompts):
    model = peers.load_transformers_reference(ckpts["mx"], "cpu", "bfloat16")
    res = peers.run_resident_arm(model, prompts, NEW_TOKENS, warmup_tokens=0)
    assert res["token_ids"] == _hf_greedy(ckpts["ref"], prompts, NEW_TOKENS)


def test_loader_rejects_a_directory_without_checkpoint(tmp_path):
    with pytest.raises(PdflashError, match="config.json"):
        peers.load_transformers_reference(tmp_path, "cpu")


# -- arm results -----------------------------------------------------------------------------
def test_arm_dict_counts_decode_steps_only(ckpts, prompts):
    model = peers.load_transformers_reference(ckpts["bf16"], "cpu")
    res = peers.run_resident_arm(model, prompts, 5, warmup_tokens=0)
    assert res["arm"] == peers.RESIDENT and res["new_tokens"] == 5
    assert [len(t) for t in res["token_ids"]] == [5] * len(prompts)
    steps = [s for pp in res["per_prompt"] for s in pp["step_ms"]]
    assert res["decode_tokens"] == len(steps) == 4 * len(prompts)  # the prefill token is not a decode step
    assert res["tokens_per_second"] == pytest.approx(len(steps) / (sum(steps) / 1000))
    assert res["tpot_ms"] == pytest.approx(sum(steps) / len(steps))
    assert res["ttft_ms"] == pytest.approx(sum(pp["ttft_ms"] for pp in res["per_prompt"]) / len(prompts))
    assert res["gpu_memory_peak_gib"] is None  # not measured on the CPU, not 0
    notes = res["notes"]
    assert notes["experts_implementation"] == model.config._experts_implementation
    assert notes["attn_implementation"] == "eager" and "greedy loop" in notes["decode"]
    assert notes["stopped_by_time_limit"] is False and notes["prompts_run"] == len(prompts)


def test_single_token_and_time_limit_report_missing_speed(ckpts, prompts):
    model = peers.load_transformers_reference(ckpts["bf16"], "cpu")
    one = peers.run_resident_arm(model, prompts, 1, warmup_tokens=0)
    assert one["tokens_per_second"] is None and one["tpot_ms"] is None and one["decode_tokens"] == 0
    assert one["notes"]["stopped_by_time_limit"] is False
    cut = peers.run_resident_arm(model, prompts, NEW_TOKENS, time_limit_s=0.0, warmup_tokens=0)
    assert cut["token_ids"] == [one["token_ids"][0]]  # the first prompt's prefill only
    assert cut["tokens_per_second"] is None and cut["notes"]["stopped_by_time_limit"] is True
    assert cut["notes"]["prompts_run"] == 1


# -- accelerate device map -------------------------------------------------------------------
def _meta_model(model_dir: Path):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig.from_dict(cfg))
    return model.to(torch.bfloat16)


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _owner(dmap: dict, module: str):
    """Device of a module: the entry of the longest key that is the module or one of its parents."""
    keys = [k for k in dmap if k == "" or module == k or module.startswith(k + ".")]
    assert keys, module
    return dmap[max(keys, key=len)]


@pytest.mark.filterwarnings("ignore:Current model requires")
def test_offload_device_map_fills_the_gpu_in_order_then_the_cpu(ckpts):
    model = _meta_model(ckpts["bf16"])
    modules = dict(model.named_modules())
    order = ["model.embed_tokens"] + [f"model.layers.{i}" for i in range(len(model.model.layers))] + ["lm_head"]
    layer = _bytes(model.model.layers[0])
    gpu_counts = []
    for n_layers in (2, 3):
        budget = _bytes(model.model.embed_tokens) + n_layers * layer + layer // 2
        dmap = peers.offload_device_map(model, budget)
        # Every parameter is placed exactly once, by a module prefix.
        for pname, _ in model.named_parameters():
            owners = [m for m in dmap if pname == m or pname.startswith(m + ".")]
            assert len(owners) == 1, pname
        placed = [_owner(dmap, m) for m in order]
        assert set(placed) == {0, "cpu"}
        n_gpu = placed.count(0)
        assert placed == [0] * n_gpu + ["cpu"] * (len(order) - n_gpu)  # GPU first, in order, then the CPU
        assert n_gpu >= 2  # the embeddings and at least one decoder layer
        gpu_modules = [m for m, d in dmap.items() if d == 0]
        assert sum(_bytes(modules[m]) for m in gpu_modules) <= budget
        summary = peers._map_summary(model, dmap)
        assert summary["decoder_layers_on_gpu"] == n_gpu - 1
        assert summary["decoder_layers_on_cpu"] == len(model.model.layers) - (n_gpu - 1)
        gpu_counts.append(n_gpu)
    assert gpu_counts[1] > gpu_counts[0]  # a larger budget keeps more layers on the GPU
    everything = peers.offload_device_map(model, 4 * _bytes(model))
    assert set(everything.values()) == {0}
    assert peers._map_summary(model, everything)["decoder_layers_on_cpu"] == 0
    with pytest.raises(PdflashError, match="GPU budget"):
        peers.offload_device_map(model, _bytes(model.model.embed_tokens) // 2)


# -- budget, ratios, config ------------------------------------------------------------------
def test_gpu_budget_counts_dense_in_dtype_and_experts_as_stored(ckpts):
    p = ModelPreset.from_name("tiny")
    H, I, E, L, V = p.hidden_size, p.intermediate_size, p.num_local_experts, p.num_hidden_layers, p.vocab_size
    q, kv = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    attn = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + p.num_attention_heads
    dense = 2 * V * H + H + L * (attn + 2 * H + E * H + E)  # embed + head + norm + layers (attn, norms, router)
    mx_expert = 2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32 + 2 * (2 * I + H)  # blocks, scales, bf16 biases
    bf16_expert = 2 * (H * 2 * I + 2 * I + I * H + H)
    assert peers.gpu_budget_bytes(ckpts["mx"], 0.25) == 2 * dense + math.ceil(0.25 * L * E * mx_expert)
    assert peers.gpu_budget_bytes(ckpts["bf16"], 1.0, "float32") == 4 * dense + L * E * bf16_expert
    with pytest.raises(PdflashError, match="fraction"):
        peers.gpu_budget_bytes(ckpts["mx"], 1.5)


def test_ratios_divide_pdflash_by_peer_and_keep_missing_missing():
    arms = [
        {"arm": peers.RESIDENT, "tokens_per_second": 25.0, "decode_tokens": 93},
        {"arm": peers.ACCELERATE_OFFLOAD, "tokens_per_second": None, "decode_tokens": 0},
    ]
    r = peers.tokens_per_second_ratios({"tokens_per_second": 50.0}, arms)
    assert r[peers.RESIDENT]["ratio"] == 2.0 and r[peers.RESIDENT]["peer_decode_tokens"] == 93
    assert r[peers.ACCELERATE_OFFLOAD]["ratio"] is None
    assert peers.tokens_per_second_ratios({"tokens_per_second": None}, arms)[peers.RESIDENT]["ratio"] is None


def test_peer_config_rejects_bad_input_before_work(ckpts):
    with pytest.raises(PdflashError, match="unknown peer arm"):
        peers.PeerConfig(model_dir=str(ckpts["bf16"]), prompts=[[1]], arms=("resident-ish",))
    with pytest.raises(PdflashError, match="prompt"):
        peers.PeerConfig(model_dir=str(ckpts["bf16"]), prompts=[], arms=(peers.RESIDENT,))
    with pytest.raises(PdflashError, match="GPU budget"):
        peers.PeerConfig(model_dir=str(ckpts["bf16"]), prompts=[[1]], arms=(peers.ACCELERATE_OFFLOAD,))
    if not torch.cuda.is_available():
        with pytest.raises(PdflashError, match="CUDA"):
            peers.PeerConfig(model_dir=str(ckpts["bf16"]), prompts=[[1]], gpu_budget_gib=1.0)


def test_run_peers_records_a_failing_arm_and_goes_on(ckpts, prompts, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(peers, "run_resident_arm", boom)
    cfg = peers.PeerConfig(model_dir=str(ckpts["bf16"]), prompts=prompts, arms=(peers.RESIDENT,), device="cpu")
    (res,) = peers.run_peers(cfg)
    assert res["arm"] == peers.RESIDENT and res["tokens_per_second"] is None and res["token_ids"] == []
    assert res["notes"]["error"].startswith("RuntimeError: CUDA out of memory")


# -- the script ------------------------------------------------------------------------------
def _script():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_writes_json_and_rejects_bad_input(ckpts, tmp_path, capsys):
    script = _script()
    out = tmp_path / "peers.json"
    argv = [str(ckpts["mx"]), "--arms", peers.RESIDENT, "--device", "cpu", "--new-tokens", "3",
            "--warmup-tokens", "0", "--pdflash-tps", "10", "--json", "--out", str(out)]
    assert script.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    (arm,) = printed["arms"]
    assert arm["arm"] == peers.RESIDENT and len(arm["token_ids"]) == len(peers.DEFAULT_PROMPTS)
    assert printed["ratios"][peers.RESIDENT]["ratio"] == pytest.approx(10 / arm["tokens_per_second"])
    assert script.main([str(ckpts["mx"]), "--arms", "nope", "--device", "cpu"]) == 1
    assert "unknown peer arm" in capsys.readouterr().err
    assert script.main([str(ckpts["mx"]), "--out", str(tmp_path / "missing" / "x.json")]) == 1
    assert "cannot be written" in capsys.readouterr().err


# -- CUDA ------------------------------------------------------------------------------------
@cuda
def test_accelerate_offload_arm_decodes_like_the_resident_arm_on_gpu(ckpts, prompts):
    gpu = peers.load_transformers_reference(ckpts["mx"], "cuda", torch.bfloat16)
    resident = peers.run_resident_arm(gpu, prompts, 4, warmup_tokens=1)
    del gpu
    torch.cuda.empty_cache()
    cpu = peers.load_transformers_reference(ckpts["mx"], "cpu", torch.bfloat16, dequant_device="cuda")
    budget = _bytes(cpu.model.embed_tokens) + 2 * _bytes(cpu.model.layers[0]) + 1024
    off = peers.run_accelerate_offload_arm(cpu, prompts, 4, budget)
    assert off["notes"]["decoder_layers_on_cpu"] >= 1 and off["notes"]["decoder_layers_on_gpu"] >= 1
    assert off["token_ids"] == resident["token_ids"]
    assert off["decode_tokens"] == 3 * len(prompts) and off["gpu_memory_peak_gib"] is not None
