"""The hybrid benchmarks' own options, run small on the CPU: check_hybrid_gpu.py (--breakdown,
--cprofile, --prewake-us, mode checks) and bench_cpu_experts.py (--gaps, --prewake)."""

import importlib.util
import os
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_check_hybrid_breakdown_and_profile_then_restores_the_code(tmp_path):
    from pdflash.native.cpu_experts import CpuExperts
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.experts import OffloadedExperts
    from pdflash.offload.host_exchange import HostExchange

    before = (OffloadedExperts.forward, OffloadedExperts._cpu_compute, HostExchange.routing, HostExchange.upload,
              CpuExperts._experts)
    mod = _load("check_hybrid_gpu")
    out = tmp_path / "h.json"
    rc = mod.main(["--in-memory", "tiny", "--device", "cpu", "--dtypes", "float32", "--modes", "off,all", "--tokens", "5",
                   "--link-gbps", "0.05", "--breakdown", "--cprofile", str(tmp_path / "prof"), "--out", str(out)])
    assert rc == 0
    after = (OffloadedExperts.forward, OffloadedExperts._cpu_compute, HostExchange.routing, HostExchange.upload,
             CpuExperts._experts)
    assert after == before  # every wrapper removed
    res = json.loads(out.read_text())
    off, all_ = res["runs"]
    assert all_["identical_to_first_mode"]  # float32: every expert on the CPU gives fetch-only's tokens
    assert off["host_handoff"] is None and all_["host_handoff"] is None  # no host steps without CUDA graphs
    n_layers = ModelPreset.from_name("tiny").num_hidden_layers
    bd = all_["layer_breakdown_us"]
    assert bd["layers"] == off["layer_breakdown_us"]["layers"] == 4 * n_layers  # 4 one-token forwards after the prefill
    assert bd["kernel_call"] > 0 and bd["module"] >= bd["kernel_call"] + bd["cpu_compute_beside_kernel"]
    assert "cpu_compute_beside_kernel" not in off["layer_breakdown_us"]  # fetch-only computes no expert from host memory
    for mode in ("off", "all"):
        text = (tmp_path / "prof" / f"float32_{mode}.txt").read_text()
        assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text


def test_check_hybrid_runs_an_in_memory_qwen3_fp8_checkpoint(tmp_path):
    """--in-memory with a Qwen3-MoE preset: a synthetic FP8 checkpoint (its expert count read from
    the family's config key), every mode run and exact in float32, the CPU experts on the native
    kernel's row formats."""
    from pdflash.native.cpu_experts import detect_level

    mod = _load("check_hybrid_gpu")
    out = tmp_path / "q.json"
    assert mod.main(["--in-memory", "qwen3-tiny", "--device", "cpu", "--dtypes", "float32", "--modes", "off,all,auto",
                     "--tokens", "4", "--link-gbps", "0.05", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["total_experts"] == 4 * 8 and [r["asked"] for r in res["runs"]] == ["off", "all", "auto"]
    assert all(r["identical_to_first_mode"] for r in res["runs"])
    assert res["runs"][1]["cpu_experts"]["level"] == detect_level()


def test_check_hybrid_refuses_unknown_modes(capsys):
    mod = _load("check_hybrid_gpu")
    with pytest.raises(SystemExit) as e:
        mod.main(["--in-memory", "tiny", "--device", "cpu", "--modes", "off,fast"])
    assert e.value.code == 2
    assert "unknown mode(s) fast" in capsys.readouterr().err


def test_bench_cpu_experts_layer_calls_after_idle_gaps(tmp_path):
    mod = _load("bench_cpu_experts")
    out = tmp_path / "k.json"
    rc = mod.main(["--small", "--threads", "1", "--tokens", "1", "--layer", "2", "--gaps", "0,50", "--torch-experts", "0",
                   "--calls", "4", "--experts", "4", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    layer = json.loads(out.read_text())["runs"][0]["layer"]
    assert sorted((r["tokens"], r["gap_us"]) for r in layer) == [(1, 0.0), (1, 50.0), (4, 0.0), (4, 50.0)]
    assert all(r["median_ms"] > 0 and r["experts_per_call"] == 2 for r in layer)


def test_bench_cpu_experts_prewake_runs_each_gap_with_and_without(tmp_path):
    mod = _load("bench_cpu_experts")
    out = tmp_path / "k.json"
    rc = mod.main(["--small", "--threads", "2", "--tokens", "1", "--layer", "2", "--gaps", "0,300", "--prewake", "0,400",
                   "--lead", "100", "--torch-experts", "0", "--calls", "4", "--experts", "4", "--repeats", "1",
                   "--out", str(out)])
    assert rc == 0
    layer = json.loads(out.read_text())["runs"][0]["layer"]
    got = sorted((r["tokens"], r["gap_us"], r["prewake_us"], r["lead_us"]) for r in layer)
    assert got == [(t, g, p, 100.0 if p else 0) for t in (1, 4) for g, p in ((0.0, 0), (300.0, 0), (300.0, 400))]


def test_bench_cpu_experts_kernel_calls_with_prewake_and_a_bf16_model_arm(tmp_path):
    mod = _load("bench_cpu_experts")
    out = tmp_path / "k.json"
    rc = mod.main(["--small", "--threads", "2", "--tokens", "1,4", "--layer", "0", "--kernel-prewake", "300", "--lead", "50",
                   "--torch-experts", "0", "--calls", "4", "--experts", "4", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    kernel = json.loads(out.read_text())["runs"][0]["kernel"]
    assert sorted((r["tokens"], r["x_dtype"], r["model"]) for r in kernel) == [
        (t, x, m) for t in (1, 4) for x, m in (("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32"))]
    assert all(r["prewake_us"] == 300 and r["lead_us"] == 50.0 and r["median_ms"] > 0 for r in kernel)


def test_check_hybrid_prewake_values_run_each_cpu_mode_and_restore_the_default(tmp_path):
    from pdflash.offload.cpu_compute import CpuExpertRunner

    default = CpuExpertRunner.prewake_us
    mod = _load("check_hybrid_gpu")
    out = tmp_path / "h.json"
    rc = mod.main(["--in-memory", "tiny", "--device", "cpu", "--dtypes", "float32", "--modes", "off,all", "--tokens", "3",
                   "--link-gbps", "0.05", "--prewake-us", "0,300", "--out", str(out)])
    assert rc == 0 and CpuExpertRunner.prewake_us == default
    runs = json.loads(out.read_text())["runs"]
    assert [(r["asked"], r["prewake_us"]) for r in runs] == [("off", None), ("all", 0), ("all", 300)]
    assert all(r["identical_to_first_mode"] for r in runs)


@pytest.mark.parametrize("args, message", [(["--prewake", "0,fast"], "--prewake"), (["--prewake", "100001"], "--prewake"),
                                           (["--prewake", "1.5"], "--prewake"), (["--gaps", "-5"], "--gaps"),
                                           (["--lead", "-1"], "--lead"), (["--threads", "x"], "--threads"),
                                           (["--threads", "0"], "--threads"), (["--tokens", "17"], "--tokens"),
                                           (["--kernel-prewake", "100001"], "--kernel-prewake"),
                                           (["--kernel-prewake", "-1"], "--kernel-prewake")])
def test_bench_cpu_experts_refuses_bad_numbers(capsys, args, message):
    mod = _load("bench_cpu_experts")
    with pytest.raises(SystemExit) as e:
        mod.main(["--small", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "fast", "100001"])
def test_check_hybrid_refuses_bad_prewake(capsys, value):
    mod = _load("check_hybrid_gpu")
    with pytest.raises(SystemExit) as e:
        mod.main(["--in-memory", "tiny", "--device", "cpu", "--prewake-us", value])
    assert e.value.code == 2
    assert "--prewake-us" in capsys.readouterr().err


def test_profile_decode_needs_one_checkpoint_source(capsys, tmp_path):
    mod = _load("profile_decode")
    for extra in ([], ["--in-memory", "--checkpoint-dir", str(tmp_path / "ck")]):
        with pytest.raises(SystemExit) as e:
            mod.main(["--out-dir", str(tmp_path / "p"), *extra])
        assert e.value.code == 2
        assert "give --checkpoint-dir DIR or --in-memory" in capsys.readouterr().err


def test_probe_graph_wait_refuses_bad_input_and_a_machine_without_cuda(capsys):
    import torch

    mod = _load("probe_graph_wait")
    assert mod.main(["--delays", "10,x"]) == 2
    assert "--delays" in capsys.readouterr().err
    assert mod.main(["--repeats", "0"]) == 2
    capsys.readouterr()
    if not torch.cuda.is_available():
        assert mod.main([]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs a CUDA device" in err[0]


def test_hybrid_variants_runs_each_variant_then_restores_the_code(tmp_path, capsys):
    """benchmarks/hybrid_variants.py: one check_hybrid_gpu.py run per variant with its knobs
    (threads, workers, chunks, a plan fetching nothing, no background fills, the library's
    attention, the residual's torch ops), each JSON written (a repeated variant to a file of its
    own), the patched methods and the environment restored after; a malformed variant is refused
    with status 2."""
    import os

    from pdflash.offload.cpu_compute import CpuPlacement
    from pdflash.offload.runtime import OffloadedModel

    before = (CpuPlacement.split_plan, CpuPlacement.note_host, OffloadedModel.__dict__["load"])  # load: never patched
    mod = _load("hybrid_variants")
    assert "PDFLASH_FUSED_ATTENTION" not in os.environ and "PDFLASH_FUSED_RESIDUAL" not in os.environ
    rc = mod.main(["auto-model:t1:w3:c2:zero:nofill:libattn:resops,off:w1,off:w1", str(tmp_path), "--in-memory", "tiny",
                   "--device", "cpu", "--dtypes", "float32", "--tokens", "3"])
    assert rc == 0
    assert (CpuPlacement.split_plan, CpuPlacement.note_host, OffloadedModel.__dict__["load"]) == before
    assert "PDFLASH_FUSED_ATTENTION" not in os.environ and "PDFLASH_FUSED_RESIDUAL" not in os.environ
    model = json.loads((tmp_path / "auto-model_t1_w3_c2_zero_nofill_libattn_resops.json").read_text())["runs"][0]
    off = json.loads((tmp_path / "off_w1.json").read_text())["runs"][0]
    again = json.loads((tmp_path / "off_w1_2.json").read_text())["runs"][0]  # the repeat: a file of its own
    assert again["asked"] == "off" and again["token_ids"] == off["token_ids"]
    assert model["cpu_threads"] == 1 and model["asked"] == "auto-model" and off["asked"] == "off"
    assert model["scheduler_workers"] == 3 and off["scheduler_workers"] == 1
    assert model["fused_attention"] is False  # the CPU: the fused layer runs only on CUDA (or the interpreter, asked)
    assert model["token_ids"] == off["token_ids"]  # float32: the model arm keeps fetch-only's tokens
    err = capsys.readouterr().err
    assert "== off:w1" in err and "GB/s" in err
    assert mod.main(["auto-model:x3", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown option 'x3'" in err and "resops" in err


def test_handoff_benchmark_refuses_bad_sizes_and_a_machine_without_cuda(capsys):
    """benchmarks/handoff_gpu.py: one line on stderr and status 2 for bad sizes, and for a
    machine without a CUDA device (it measures graphs with host nodes)."""
    import torch

    mod = _load("handoff_gpu")
    assert mod.main(["--layers", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith("Error: --layers")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the benchmark would run")
    assert mod.main(["--layers", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("Error: ") and "CUDA device" in err and "\n" not in err


def test_the_bookkeeping_benchmark_times_host_steps_and_restores_the_code(capsys):
    """benchmarks/bench_host_bookkeeping.py: host steps of mode "all" on the 36 x 128 tiny shape,
    every timed step a host step, the bookkeeping part of the time outside the graph; the patched
    methods and its switches restored after; bad arguments refused with status 2."""
    from pdflash.offload import host_graph
    from pdflash.offload.graphs import GraphedDecoder

    before = (host_graph.HostSteps.finish, GraphedDecoder._capture_host)
    switches = ("TRITON_INTERPRET", "PDFLASH_FUSED_EXPERTS")
    env = [os.environ.get(k) for k in switches]
    mod = _load("bench_host_bookkeeping")
    assert mod.main(["--mode", "all", "--steps", "3", "--repeats", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == "all" and res["host_steps"] == 3 * 2 + 1  # and the capture's step
    assert 0 < res["bookkeeping_ms"] <= res["outside_ms"]
    assert (host_graph.HostSteps.finish, GraphedDecoder._capture_host) == before
    assert [os.environ.get(k) for k in switches] == env
    assert mod.main(["--steps", "0"]) == 2
    assert capsys.readouterr().err.startswith("Error: --steps")
