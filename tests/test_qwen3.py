"""The Qwen3-MoE family adapter (offload/qwen3_moe.py): FP8 block dequantization, routing, presets,
checkpoint validation and the commands on a Qwen3-MoE checkpoint. Exactness of the offloaded
runtime against transformers is in test_offload_exact.py."""

import json

import pytest
import torch

from pdflash import PdflashError
from pdflash.draft import DFlashConfig, TargetShape
from pdflash.offload.config import SPECIAL_TOKENS, ModelPreset
from pdflash.offload.family import find_family
from pdflash.offload.qwen3_moe import dequantize_fp8, fp8_to_float32
from pdflash.offload.synthetic import write_checkpoint

IDS = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}


def test_fp8_dequantization_matches_a_block_by_block_float32_reference():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2, 96, 64, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)  # [n, R, C]
    s = torch.rand(2, 3, 2, generator=g) + 0.01  # blocks of 32 x 32
    want = torch.empty(2, 96, 64)
    for n in range(2):
        for i in range(3):
            for j in range(2):
                block = w[n, 32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)].float()
                want[n, 32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)] = block * s[n, i, j].item()
    assert torch.equal(dequantize_fp8(w, s, torch.float32), want)
    assert torch.equal(dequantize_fp8(w, s, torch.bfloat16), want.to(torch.bfloat16))
    with pytest.raises(PdflashError, match="scale grid"):
        dequantize_fp8(w[:, :91], s, torch.float32)
    # the experts' per-call path: this thread's scratch buffers, never handed out
    a = dequantize_fp8(w, s, torch.float32, scratch=True)
    b = dequantize_fp8(w[:1], s[:1], torch.bfloat16, scratch=True)
    assert torch.equal(a, want) and torch.equal(b, want[:1].to(torch.bfloat16))
    c = dequantize_fp8(w.flip(0), s.flip(0), torch.float32, scratch=True)
    assert torch.equal(a, want) and torch.equal(c, want.flip(0))  # a's storage is its own
    with torch.inference_mode():  # buffers grown inside inference mode (a decode) serve outside it too
        big = torch.cat([w, w], 1)
        assert torch.equal(dequantize_fp8(big, torch.cat([s, s], 1), torch.float32, scratch=True), torch.cat([want, want], 1))
    assert torch.equal(dequantize_fp8(w, s, torch.float32, scratch=True), want)
    from pdflash.offload.qwen3_moe import _SCRATCH

    assert _SCRATCH.h.numel() == _SCRATCH.q.numel() == 96 * 128  # one weight's size, however many go through


def test_fp8_to_float32_is_torchs_conversion_for_every_code():
    """The CPU conversion (float16 bit patterns) gives torch's own float8_e4m3fn -> float32 for all
    256 codes (subnormals, both zeros, both NaNs), for NaNs among other codes, for a strided view
    (an expert's piece of a packed row) and for an empty tensor."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = every.to(torch.float32)
    got = fp8_to_float32(every)
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 2
    assert torch.equal(got.nan_to_num(1e9), want.nan_to_num(1e9))
    assert torch.equal(torch.signbit(got[1:127]), torch.signbit(want[1:127])) and got[128].item() == 0.0
    assert torch.signbit(got[128])  # -0.0 stays negative
    g = torch.Generator().manual_seed(1)
    for nan in (None, 0x7F, 0xFF):
        codes = torch.randint(0, 256, (40, 70), generator=g, dtype=torch.uint8)
        codes[codes & 0x7F == 0x7F] = 0x11
        if nan is not None:
            codes[3, 5] = nan
        w = codes.view(torch.float8_e4m3fn)
        for view in (w, w[:, 6:38], w.t()):
            a, b = fp8_to_float32(view), view.to(torch.float32)
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))
    assert fp8_to_float32(every[:0]).shape == (0,)


def test_selection_is_the_library_routers():
    """select(logits) picks the experts transformers' Qwen3MoeTopKRouter picks (softmax, top-k)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = ModelPreset.from_name("qwen3-tiny").hf_config(IDS)
    fam = find_family(cfg, "test")
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig.from_dict(cfg))
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(32, cfg["hidden_size"])
    logits, weights, indices = router(x)
    assert torch.equal(fam.select(logits), indices)
    assert torch.allclose(weights.sum(-1), torch.ones(32))  # renormalised (norm_topk_prob)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-coder-30b-a3b"])
def test_full_size_presets_have_the_published_shape(preset):
    p = ModelPreset.from_name(preset)
    for quant, expert_weights in ((None, 2), ("fp8", 1)):
        fam = find_family(p.hf_config(IDS, quant=quant), preset)
        assert (fam.num_layers, fam.num_experts, fam.top_k, fam.hidden, fam.inter) == (48, 128, 8, 2048, 768)
        c = fam.hf_config
        assert (c.num_attention_heads, c.num_key_value_heads, fam.head_dim, c.vocab_size) == (32, 4, 128, 151936)
        specs = fam.tensor_specs()
        assert specs["model.layers.47.self_attn.q_norm.weight"].shape == (128,)
        assert specs["model.layers.0.mlp.gate.weight"].shape == (128, 2048)
        assert specs["model.layers.0.mlp.experts.127.down_proj.weight"].shape == (2048, 768)
        stored = {"gate_up_proj": torch.bfloat16, "down_proj": torch.bfloat16}
        if quant:
            stored = {"gate_up_proj": torch.float8_e4m3fn, "down_proj": torch.float8_e4m3fn,
                      "gate_up_proj_scale_inv": torch.float32, "down_proj_scale_inv": torch.float32}
            assert specs["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (6, 16)
            assert specs["model.layers.0.self_attn.q_proj.weight"].dtypes == ("F8_E4M3",)
            assert specs["model.layers.0.mlp.gate.weight"].dtypes != ("F8_E4M3",)  # the router stays bf16
        layout = fam.expert_layout(stored)
        weights = sum(pc.nbytes for pc in layout.pieces if not pc.name.endswith("scale_inv"))
        assert weights == 3 * 2048 * 768 * expert_weights  # 9.44 MB bf16, half that in FP8


def test_the_coder_draft_preset_fits_the_coder_target():
    target = TargetShape.from_config(ModelPreset.from_name("qwen3-coder-30b-a3b").hf_config(IDS))
    cfg = DFlashConfig.from_preset("Qwen3-Coder-30B-A3B-DFlash", target)
    assert cfg.num_target_layers == 48 and max(cfg.target_layer_ids) < 48 and cfg.hidden_size == 2048
    with pytest.raises(PdflashError, match="hidden size"):
        DFlashConfig.from_preset("Qwen3-Coder-30B-A3B-DFlash", TargetShape.from_config(ModelPreset.from_name("gpt-oss-20b").hf_config(IDS)))


def test_unsupported_qwen3_configs_are_one_clear_error():
    cfg = ModelPreset.from_name("qwen3-tiny").hf_config(IDS)
    with pytest.raises(PdflashError, match="dense MLP layers"):
        find_family(dict(cfg, mlp_only_layers=[1]), "c")
    with pytest.raises(PdflashError, match="quantization 'awq'"):
        find_family(dict(cfg, quantization_config={"quant_method": "awq"}), "c")
    with pytest.raises(PdflashError, match="no mxfp4 format"):
        ModelPreset.from_name("qwen3-tiny").hf_config(IDS, quant="mxfp4")


def test_checkpoint_with_an_expert_of_another_dtype_is_refused(tmp_path):
    """Every expert of every layer must share the layout: a per-expert tensor of another dtype is
    named in the error."""
    from safetensors.torch import load_file, save_file

    from pdflash.offload.runtime import OffloadedModel

    path = write_checkpoint(tmp_path / "q", ModelPreset.from_name("qwen3-tiny"), seed=3)
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PdflashError, match=name.replace(".", r"\.")):
        OffloadedModel.load(path)


def test_make_synthetic_then_generate_with_a_draft(run, tmp_path):
    out = tmp_path / "q3"
    code, stdout, err = run("make-synthetic", out, "--preset", "qwen3-tiny", "--fp8", "--draft-preset", "tiny", "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["family"] == "qwen3_moe" and info["experts"] == "fp8"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    args = ("generate", "def f(x):", "--model", out, "--max-new-tokens", "12", "--expert-cache-experts", "8", "--json")
    code, plain, err = run(*args, "--no-draft")
    assert code == 0, err
    code, spec, err = run(*args, "--draft", out / "draft", "--block-size", "4")
    assert code == 0, err
    plain, spec = json.loads(plain), json.loads(spec)
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 12  # lossless
    code, _, err = run("make-synthetic", tmp_path / "bad", "--preset", "qwen3-tiny", "--mxfp4")
    assert code == 1 and "no mxfp4 format" in err


@pytest.mark.parametrize("preset,kw,chunk", [("qwen3-tiny", dict(quant="fp8"), None), ("tiny", dict(mxfp4=True), None),
                                             ("tiny", dict(mxfp4=True), 1000)])
def test_in_memory_synthetic_is_the_written_checkpoint(tmp_path, monkeypatch, preset, kw, chunk):
    """SyntheticCheckpoint generates the bytes write_checkpoint writes: the host stores of both
    loads are byte-identical and the greedy tokens equal; its directory goes away on close. With
    small chunks (``chunk``) a tensor is generated in many pieces, each written into its slice."""
    from pdflash.offload import synthetic
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel
    from pdflash.offload.synthetic import SyntheticCheckpoint

    if chunk is not None:
        monkeypatch.setattr(synthetic, "CHUNK_ELEMS", chunk)

    p = ModelPreset.from_name(preset)
    path = write_checkpoint(tmp_path / "m", p, seed=5, **kw)
    with SyntheticCheckpoint(p, seed=5, workers=2, **kw) as ck:
        assert ck.nbytes == sum(f.stat().st_size for f in path.glob("*.safetensors")) - _headers(path)
        with OffloadedModel.load(ck, expert_cache_experts=4) as a, OffloadedModel.load(path, expert_cache_experts=4) as b:
            assert torch.equal(a.host.buf, b.host.buf)
            prompt = [5, 77, 200, 31, 9, 100]
            assert generate(a, prompt, max_new_tokens=6, eos_token_ids=[]).token_ids == \
                generate(b, prompt, max_new_tokens=6, eos_token_ids=[]).token_ids
        where = ck.path
    assert not where.exists()


def _headers(path) -> int:
    import struct

    return sum(8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in path.glob("*.safetensors"))


def test_gpu_benchmark_script_runs_the_qwen3_shape_on_cpu(load_script, tmp_path, monkeypatch):
    """benchmarks/bench_offload_gpu.py end to end on the CPU with the tiny Qwen3 shape in memory:
    every stage runs and pdflash's greedy tokens are the transformers reference's."""
    import sys

    bench = load_script("benchmarks/bench_offload_gpu.py")
    out = tmp_path / "q3.json"
    monkeypatch.setattr(sys, "argv", ["bench", "--in-memory", "--preset", "qwen3-tiny", "--quant", "fp8", "--device", "cpu",
                                      "--link-gbps", "1", "--tokens", "6", "--warmup", "2", "--out", str(out)])
    assert bench.main() == 0
    res = json.loads(out.read_text())
    assert res["synthetic_in_memory"] and res["family"] == "qwen3_moe" and res["experts"] == "fp8"
    names = {r["name"] for r in res["runs"]}
    assert {"pdflash-resident", "pdflash-offload-25pct", "transformers-resident-bf16"} <= names
    for name, s in res["summary"].items():
        if name.startswith("pdflash"):
            assert s["greedy_prefix_equal_to_transformers"] == "9/9", name
            if "offload" in name:
                assert s["bytes_per_token"] > 0 and s["utilisation_of_bound"] > 0


def test_transformers_reference_loader_is_from_pretrained(tmp_path):
    """bench/peers.load_transformers_reference builds transformers' Qwen3MoeForCausalLM from the
    family's pieces (per-expert tensors stacked, FP8 dequantized): the same logits as
    from_pretrained's own loading, bit for bit, from a directory and from the in-memory synthetic."""
    from transformers import Qwen3MoeForCausalLM

    from pdflash.bench.peers import load_transformers_reference
    from pdflash.offload.synthetic import SyntheticCheckpoint

    p = ModelPreset.from_name("qwen3-tiny")
    path = write_checkpoint(tmp_path / "q", p, seed=9, quant="fp8")
    ids = torch.tensor([[5, 77, 200, 31, 9, 100, 250, 17]])
    with torch.no_grad():
        want = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")(ids).logits
        got = load_transformers_reference(path, "cpu", torch.bfloat16)
        assert type(got).__name__ == "Qwen3MoeForCausalLM" and torch.equal(got(ids).logits, want)
        with SyntheticCheckpoint(p, seed=9, quant="fp8", workers=2) as ck:
            assert torch.equal(load_transformers_reference(ck, "cpu", torch.bfloat16)(ids).logits, want)


def test_bench_priority_runs_on_a_qwen3_pair(run, tmp_path):
    """The route-ahead ablation on a Qwen3-MoE target and its draft: every arm runs, a verdict is
    given (the family is invisible to bench/priority.py)."""
    out = tmp_path / "q3"
    assert run("make-synthetic", out, "--preset", "qwen3-tiny", "--draft-preset", "tiny", "--json")[0] == 0
    code, stdout, err = run("bench-priority", "--model", out, "--draft", out / "draft", "--device", "cpu", "--link-gbps", "0.05",
                            "--max-new-tokens", "6", "--repetitions", "2", "--prompts", "1", "--no-timeline", "--json",
                            "--output", tmp_path / "bp.json")
    assert code in (0, 3), err  # 3: a no-ship verdict
    res = json.loads(stdout)
    assert {s["arm"] for s in res["samples"]} == {"banded", "flat", "on-demand", "oracle", "resident"}
    assert res["decision"]["verdict"] in ("ship", "no-ship", "inconclusive", "unmeasurable")


def test_the_qwen3_cpu_benchmark_compares_its_arms(load_script, tmp_path, capsys):
    """benchmarks/bench_qwen3_cpu.py on a small expert: every arm timed for each token count, the
    PyTorch FP8 arms' outputs bit for bit the same and the native ones close (exit 0), its JSON
    written; bad sizes refused (exit 2)."""
    bench = load_script("benchmarks/bench_qwen3_cpu.py")
    out = tmp_path / "fp8.json"
    assert bench.main(["--hidden", "256", "--inter", "128", "--experts", "2", "--repeats", "1", "--tokens", "1,3",
                       "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["tokens"] for r in res["results"]] == [1, 3]
    for r in res["results"]:
        assert r["fp8_arms_identical"] and r["native_close"] and r["fp8_native_of_dram"] > 0
        assert all(r[f"{a}_ms"] > 0 for a in ("bf16_native", "fp8_native", "bf16", "fp8", "fp8_fresh", "fp8_torch"))
    assert res["dram_read_gbps"] > 0 and res["fp8_bytes_per_expert"] < res["bf16_bytes_per_expert"]
    assert bench.main(["--hidden", "100"]) == 2 and "multiples of --block" in capsys.readouterr().err
