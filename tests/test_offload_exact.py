"""Greedy output of the offloaded runtime is token-for-token transformers' own GptOssForCausalLM.

The reference is ``GptOssForCausalLM.from_pretrained`` on the same checkpoint directory in the same
dtype (for MXFP4, transformers dequantizes the experts with its own converter on CPU), generating
with ``model.generate``. The runtime runs every cache size from the minimum to all-resident, with
and without prefetch, with an instant and with a slow simulated link (prefetches then are still
in flight when the forward needs them and get promoted).
"""

import pytest
import torch

from pdflash import PdflashError
from pdflash.offload.config import ModelPreset
from pdflash.offload.generate import generate
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint
from references import gpt_oss_reference  # noqa: E402

TINY = ModelPreset.from_name("tiny")
E, K, L = TINY.num_local_experts, TINY.num_experts_per_tok, TINY.num_hidden_layers
NEW = 24
# 20 prompt tokens: longer than the sliding window (8), and a prefill that touches every expert
PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90, 123, 7, 66, 19, 300, 2, 11, 222]

CHECKPOINTS = {  # name -> (write_checkpoint kwargs, compute dtype)
    "dense-bf16": (dict(seed=11), torch.bfloat16),
    "dense-f32": (dict(seed=12, dtype="float32"), torch.float32),
    "mxfp4-bf16": (dict(seed=13, mxfp4=True), torch.bfloat16),
    "dense-bf16-as-f32": (dict(seed=11), torch.float32),
}



@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    return {name: write_checkpoint(root / name, TINY, **kw) for name, (kw, _) in CHECKPOINTS.items() if name != "dense-bf16-as-f32"}


@pytest.fixture(scope="module")
def reference(ckpts):
    """name -> greedy tokens of transformers' GptOssForCausalLM."""

    out = {}
    for name, (_, dtype) in CHECKPOINTS.items():
        path = ckpts[name.replace("-as-f32", "")]
        model = gpt_oss_reference(path, dtype=dtype)
        ids = torch.tensor([PROMPT])
        gen = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        out[name] = gen[0, len(PROMPT):].tolist()
    return out


# (cache slots, prefetch settings, simulated link GB/s)
RUNS = [
    (K, {}, None),  # the minimum: every layer evicts, prefill runs in waves
    (K, {"lookahead_depth": 1}, 0.05),
    (5, {"lookahead_depth": 2, "history_depth": 2}, None),
    (12, {"history_depth": 1}, 0.05),
    (20, {"lookahead_depth": 1, "history_depth": 1}, 0.05),
    (L * E, {}, None),  # all resident
    (L * E, {"lookahead_depth": 3}, None),
]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("slots,prefetch,link", RUNS)
def test_greedy_matches_transformers(ckpts, reference, name, slots, prefetch, link):
    path = ckpts[name.replace("-as-f32", "")]
    dtype = CHECKPOINTS[name][1]
    with OffloadedModel.load(path, dtype=dtype, expert_cache_experts=slots, link_gbps=link, **prefetch) as rt:
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == reference[name]
        st = rt.stats()
        assert st["cache"]["hits"] + st["cache"]["misses"] == sum(st["cache"][k] for k in ("hits", "misses"))
        assert st["forwards"] == NEW and st["tokens"] == len(PROMPT) + NEW - 1
        if slots < L * E:
            assert st["cache"]["evictions"] > 0


def test_other_eviction_policies_are_exact(ckpts, reference):
    for policy in ("lfu", "lookahead"):
        with OffloadedModel.load(ckpts["mxfp4-bf16"], expert_cache_experts=6, eviction=policy, lookahead_depth=1) as rt:
            assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == reference["mxfp4-bf16"]


def test_logits_bit_identical_prefill(ckpts):
    """Not only the argmax: the prefill logits are bit-identical to the library's."""

    ref = gpt_oss_reference(ckpts["dense-bf16"], dtype=torch.bfloat16)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = ref(ids).logits
    with OffloadedModel.load(ckpts["dense-bf16"], expert_cache_experts=3) as rt:
        got = rt.forward(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["mxfp4-bf16", "dense-f32", "dense-bf16"])
def test_cache_slots_computed_natively_on_the_cpu_device(ckpts, reference, name, monkeypatch):
    """The CPU device, experts through the cache: the native kernel reads the slot rows in place
    (stats say so); its logits equal the generic torch path's (PDFLASH_FUSED_EXPERTS=0), bit for
    bit in bf16 and up to summation order in float32, and its greedy tokens are transformers',
    at the minimum cache (every layer evicts)."""
    path = ckpts[name]
    dtype = CHECKPOINTS[name][1]
    ids = torch.tensor([PROMPT])
    logits = {}
    for flag in ("1", "0"):  # "1": the default (unset; "1" itself would ask for Triton's interpreter here)
        if flag == "1":
            monkeypatch.delenv("PDFLASH_FUSED_EXPERTS", raising=False)
        else:
            monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "0")
        with OffloadedModel.load(path, dtype=dtype, expert_cache_experts=K) as rt:
            assert rt.stats()["cpu_experts"]["cache_experts_native"] == (flag == "1")
            logits[flag] = rt.forward(ids).logits
            assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == reference[name]
            assert rt.stats()["cpu_experts"]["computed"] == 0  # cache experts, not host-path ones
    if dtype == torch.bfloat16:
        assert torch.equal(logits["1"], logits["0"])
    else:
        torch.testing.assert_close(logits["1"], logits["0"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("level", ["auto", "scalar"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_cpu_experts_all_matches_transformers(ckpts, reference, name, level, monkeypatch):
    """Every expert computed by the native CPU kernel from host memory (nothing fetched): the
    greedy tokens are transformers' own, at the best dispatch level and the portable one."""
    if level != "auto":
        monkeypatch.setenv("PDFLASH_CPU_LEVEL", level)
    path = ckpts[name.replace("-as-f32", "")]
    dtype = CHECKPOINTS[name][1]
    with OffloadedModel.load(path, dtype=dtype, cpu_experts="all", cpu_threads=2) as rt:
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == reference[name]
        st = rt.stats()
        assert st["cpu_experts"]["mode"] == "all" and st["cpu_experts"]["level"] != "unknown"
        assert st["cache"]["hits"] == st["cache"]["misses"] == 0 and st["bytes_moved"] == 0
        routed = st["cpu_experts"]["computed"]
        assert NEW * L <= routed <= st["tokens"] * L * K  # at least one expert per layer and forward
        assert st["experts_per_token"]["cpu"] == routed / st["tokens"]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_hybrid_placement_matches_transformers(ckpts, reference, name):
    """cpu_experts="auto" behind a slow simulated link: each layer's misses split between the
    link and the native CPU kernel by the cost model, hot CPU experts cached in the background
    band; the greedy tokens stay transformers' own."""
    path = ckpts[name.replace("-as-f32", "")]
    dtype = CHECKPOINTS[name][1]
    with OffloadedModel.load(path, dtype=dtype, cpu_experts="auto", expert_cache_experts=6, link_gbps=0.01,
                             cpu_threads=2) as rt:
        rt.placer.guard.pin("model")  # the split itself (a short run would keep the guard's first arm)
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == reference[name]
        st = rt.stats()
        assert st["cpu_experts"]["mode"] == "auto" and st["cpu_experts"]["computed"] > 0
        assert rt.placer.decisions > 0 and rt.cost.to_dict()["host_path"]
        assert rt.placer.background > 0 and st["prefetch"]["issued"].get("background", 0) >= rt.placer.background
        assert st["cpu_experts"]["gbps"] is not None  # the kernel's rate, kept current
        per_layer_cpu = sum(lc["cpu"] for lc in st["per_layer"])
        assert per_layer_cpu == st["cpu_experts"]["computed"]


def test_auto_falls_back_to_fetching_when_the_cpu_kernel_cannot_run(ckpts, reference, monkeypatch):
    """auto is the default: a CPU kernel that cannot start (here: made to refuse) leaves every
    miss to the link, says why, and the tokens stay transformers' own; asked for by name, "all"
    is an error."""
    from pdflash.native.cpu_experts import CpuExpertError
    from pdflash.offload.gpt_oss import GptOssFamily

    def refuse(self, *a, **k):
        raise CpuExpertError("no kernel for this test")

    monkeypatch.setattr(GptOssFamily, "cpu_runner", refuse)
    path = ckpts["mxfp4-bf16"]
    with OffloadedModel.load(path, cpu_experts="auto", expert_cache_experts=6, link_gbps=0.01) as rt:
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == reference["mxfp4-bf16"]
        st = rt.stats()["cpu_experts"]
        assert st["mode"] == "off" and "no kernel for this test" in st["reason_off"] and st["computed"] == 0
        assert rt.placer is None
    with pytest.raises(PdflashError, match="--cpu-experts all: no kernel for this test"):
        OffloadedModel.load(path, cpu_experts="all")


@pytest.mark.parametrize("mode", ["all", "auto"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_cpu_experts_through_host_exchange_match_transformers(ckpts, reference, name, mode):
    """The CUDA host path's exchange (offload/host_exchange.py: the routing and rows down in one
    packed copy, the CPU's rows up in one zero-filled buffer added to the device's rows), run
    here on the CPU device: the greedy tokens stay transformers' own, for every expert on the
    CPU and for the cost model's split."""
    from pdflash.offload.experts import OffloadedExperts
    from pdflash.offload.host_exchange import HostExchange

    path = ckpts[name.replace("-as-f32", "")]
    dtype = CHECKPOINTS[name][1]
    kw = dict(expert_cache_experts=6, link_gbps=0.01) if mode == "auto" else {}
    with OffloadedModel.load(path, dtype=dtype, cpu_experts=mode, cpu_threads=2, **kw) as rt:
        ex = HostExchange(torch.device("cpu"))
        layers = [m for m in rt.model.modules() if isinstance(m, OffloadedExperts)]
        for m in layers:
            m.exchange = ex
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == reference[name]
        assert len(layers) == L and rt.stats()["cpu_experts"]["computed"] > 0


def test_cpu_experts_prefill_logits_bit_identical_bf16(ckpts):
    """A bf16 model's rounding is reproduced step by step: prefill logits equal transformers'."""

    for name in ("dense-bf16", "mxfp4-bf16"):
        ref = gpt_oss_reference(ckpts[name], dtype=torch.bfloat16)
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            want = ref(ids).logits
        with OffloadedModel.load(ckpts[name], cpu_experts="all") as rt:
            got = rt.forward(ids).logits
        assert torch.equal(got, want), name


@pytest.mark.gpu
def test_cuda_matches_transformers_on_cuda(ckpts):
    """On CUDA the kernels differ from the library's (cuBLAS shapes, the fused MXFP4 decode
    kernels), so bits may differ: prefill logits close to transformers', and greedy tokens the
    same at every cache size (the expert maths does not depend on hits and misses)."""

    path = ckpts["mxfp4-bf16"]
    ref = gpt_oss_reference(path, dtype=torch.bfloat16, device_map="cuda", experts_implementation="batched_mm")
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        want_logits = ref(ids).logits.float()
    tokens = {}
    for slots, kw in ((K, {"lookahead_depth": 1}), (K + 3, {}), (None, {})):
        with OffloadedModel.load(path, device="cuda", expert_cache_experts=slots, **kw) as rt:
            got_logits = rt.forward(ids).logits.float()
            assert torch.allclose(got_logits, want_logits, atol=0.1, rtol=0.05)
            tokens[slots] = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
    assert tokens[K] == tokens[K + 3] == tokens[None]


@pytest.mark.gpu
def test_cuda_hybrid_matches_fetch_only_in_float32(ckpts):
    """On CUDA the CPU experts run on the decoding thread while the device computes the hits and
    the link carries the fetches: float32 greedy tokens equal the fetch-only run's, with the cost
    model's split (no guard), with the guard held on its "host" arm (every miss on the CPU) and on
    its "all" arm (every routed expert on the CPU)."""
    path = ckpts["mxfp4-bf16"]
    with OffloadedModel.load(path, device="cuda", dtype=torch.float32, expert_cache_experts=K) as rt:
        want = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
    with OffloadedModel.load(path, device="cuda", dtype=torch.float32, expert_cache_experts=K, cpu_experts="auto",
                             link_gbps=0.01, cpu_threads=2, hybrid_guard=False) as rt:
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == want
        assert rt.stats()["cpu_experts"]["computed"] > 0
        assert rt.cost.to_dict()["host_layer_overhead_ms"] is not None  # measured around the inline call
    with OffloadedModel.load(path, device="cuda", dtype=torch.float32, expert_cache_experts=K, cpu_experts="auto",
                             cpu_threads=2) as rt:
        rt.placer.guard.pin("host")
        rt.placer.guard.max_tokens = 1 << 20  # the prefill under the arm too (else: the cost model's split)
        prewakes = []
        wake = rt.cpu.prewake
        rt.cpu.prewake = lambda: (prewakes.append(1), wake())[1]  # each layer wakes the pool before its routing copy
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == want
        st = rt.stats()
        assert st["cpu_experts"]["computed"] > 0 and st["experts_per_token"]["fetched"] == 0
        from pdflash.offload.experts import OffloadedExperts

        calls = sum(m.calls for m in rt.model.modules() if isinstance(m, OffloadedExperts))
        assert len(prewakes) == calls > 0  # every layer forward, prefill and decode steps
        rt.placer.guard.pin("off")
        prewakes.clear()
        generate(rt, PROMPT, max_new_tokens=2, eos_token_ids=[])
        assert not prewakes  # an arm that computes nothing on the CPU never wakes the pool
        rt.placer.guard.pin("host")
        rt.reset_cache()
        rt.placer.guard.pin("all")  # every routed expert on the CPU, the device's hits too
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == want
        st = rt.stats()
        assert st["experts_per_token"]["fetched"] == 0 and st["experts_per_token"]["cache"] == 0


# -- Qwen3-MoE ---------------------------------------------------------------------------------
# The reference is transformers' Qwen3MoeForCausalLM with eager attention (pdflash's choice for
# this family: see offload/qwen3_moe.py) and its default experts implementation; FP8 checkpoints
# are dequantized by transformers' own FP8 loader on the CPU.
QWEN = ModelPreset.from_name("qwen3-tiny")
QE, QK, QL = QWEN.num_local_experts, QWEN.num_experts_per_tok, QWEN.num_hidden_layers
QWEN_CHECKPOINTS = {  # name -> (write_checkpoint kwargs, compute dtype)
    "qwen3-bf16": (dict(seed=21), torch.bfloat16),
    "qwen3-f32": (dict(seed=22, dtype="float32"), torch.float32),
    "qwen3-fp8": (dict(seed=23, quant="fp8"), torch.bfloat16),
}
QWEN_RUNS = [
    (QK, {}, None),  # the minimum
    (QK, {"lookahead_depth": 1}, 0.05),
    (12, {"history_depth": 1, "lookahead_depth": 2}, None),
    (QL * QE, {}, None),  # all resident
]


@pytest.fixture(scope="module")
def qwen_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact-qwen3")
    return {name: write_checkpoint(root / name, QWEN, **kw) for name, (kw, _) in QWEN_CHECKPOINTS.items()}


def _qwen_reference(path, dtype):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")


@pytest.fixture(scope="module")
def qwen_reference(qwen_ckpts):
    out = {}
    for name, (_, dtype) in QWEN_CHECKPOINTS.items():
        model = _qwen_reference(qwen_ckpts[name], dtype)
        gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        out[name] = gen[0, len(PROMPT):].tolist()
    return out


@pytest.mark.parametrize("name", list(QWEN_CHECKPOINTS))
@pytest.mark.parametrize("slots,prefetch,link", QWEN_RUNS)
def test_qwen3_greedy_matches_transformers(qwen_ckpts, qwen_reference, name, slots, prefetch, link):
    dtype = QWEN_CHECKPOINTS[name][1]
    with OffloadedModel.load(qwen_ckpts[name], dtype=dtype, expert_cache_experts=slots, link_gbps=link, **prefetch) as rt:
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == qwen_reference[name]
        st = rt.stats()
        assert st["family"] == "qwen3_moe" and st["expert_format"] == ("fp8" if "fp8" in name else "dense")
        assert st["forwards"] == NEW and st["tokens"] == len(PROMPT) + NEW - 1
        if slots < QL * QE:
            assert st["cache"]["evictions"] > 0


@pytest.mark.parametrize("name", ["qwen3-bf16", "qwen3-fp8"])
def test_qwen3_prefill_logits_bit_identical(qwen_ckpts, name):
    ref = _qwen_reference(qwen_ckpts[name], torch.bfloat16)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = ref(ids).logits
    with OffloadedModel.load(qwen_ckpts[name], expert_cache_experts=QK) as rt:
        got = rt.forward(ids).logits
    assert torch.equal(got, want)


def test_qwen3_fp8_expert_is_half_a_bf16_one(qwen_ckpts):
    """An FP8 expert row carries half the weight bytes of a bf16 one (plus its scale grid)."""
    with OffloadedModel.load(qwen_ckpts["qwen3-fp8"]) as fp8, OffloadedModel.load(qwen_ckpts["qwen3-bf16"]) as bf16:
        weights = lambda rt: sum(p.nbytes for p in rt.host.layout.pieces if not p.name.endswith("scale_inv"))  # noqa: E731
        assert 2 * weights(fp8) == weights(bf16) == 3 * QWEN.hidden_size * QWEN.intermediate_size * 2
        assert fp8.host.layout.payload_bytes < 0.6 * bf16.host.layout.payload_bytes


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("name", list(QWEN_CHECKPOINTS))
def test_qwen3_cpu_experts_all_matches_transformers(qwen_ckpts, qwen_reference, name, native, monkeypatch):
    """Every routed expert computed on the CPU from the host rows, by the native kernel (its row
    formats: bf16 / float32 / FP8 rows, SiLU) or, with PDFLASH_QWEN3_NATIVE=0, by the family's own
    kernel through PyTorch (offload/torch_cpu.py): nothing fetched, the greedy tokens are
    transformers' own."""
    from pdflash.native.cpu_experts import detect_level

    monkeypatch.setenv("PDFLASH_QWEN3_NATIVE", "1" if native else "0")
    dtype = QWEN_CHECKPOINTS[name][1]
    with OffloadedModel.load(qwen_ckpts[name], dtype=dtype, cpu_experts="all") as rt:
        res = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[])
        assert res.token_ids == qwen_reference[name]
        st = rt.stats()
        assert st["cpu_experts"]["mode"] == "all" and st["cpu_experts"]["level"] == (detect_level() if native else "torch")
        assert st["cache"]["hits"] == st["cache"]["misses"] == 0 and st["bytes_moved"] == 0
        assert NEW * QL <= st["cpu_experts"]["computed"] <= st["tokens"] * QL * QK


@pytest.mark.parametrize("name", list(QWEN_CHECKPOINTS))
def test_qwen3_cache_slots_computed_natively_on_the_cpu_device(qwen_ckpts, qwen_reference, name, monkeypatch):
    """The CPU device, Qwen3-MoE experts through the cache: the native kernel's row formats read the
    slot rows in place (stats say so) and the greedy tokens are transformers'; with
    PDFLASH_QWEN3_NATIVE=0 the family's PyTorch kernel computes them (not native) and the tokens
    are the same. Host steps stay gpt-oss's: none for this runner."""
    from pdflash.offload.host_graph import HostSteps

    dtype = QWEN_CHECKPOINTS[name][1]
    for native in (True, False):
        monkeypatch.setenv("PDFLASH_QWEN3_NATIVE", "1" if native else "0")
        with OffloadedModel.load(qwen_ckpts[name], dtype=dtype, expert_cache_experts=QK) as rt:
            assert rt.stats()["cpu_experts"]["cache_experts_native"] == native
            assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == qwen_reference[name]
            assert rt.stats()["cpu_experts"]["computed"] == 0  # cache experts, not host-path ones
            assert HostSteps.for_runtime(rt) is None and not rt._host_steps_likely()


def test_qwen3_cpu_placement_with_a_link_is_exact(qwen_ckpts, qwen_reference):
    """cpu_experts="auto" with a slow simulated link (1 MB/s): the cost model puts misses on the
    CPU; the tokens do not depend on where each expert was computed."""
    with OffloadedModel.load(qwen_ckpts["qwen3-bf16"], cpu_experts="auto", expert_cache_experts=QK, link_gbps=0.001) as rt:
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == qwen_reference["qwen3-bf16"]
        st = rt.stats()
        assert st["cpu_experts"]["mode"] == "auto" and st["cpu_experts"]["reason_off"] is None
        assert st["cpu_experts"]["computed"] > 0


@pytest.mark.parametrize("arm", ["all", "host", "model"])
def test_qwen3_guard_arms_through_host_exchange_are_exact(qwen_ckpts, qwen_reference, arm):
    """auto is the default on CUDA, for this family too (its CPU experts in PyTorch): each of
    the guard's host arms, through the CUDA host path's exchange run on the CPU device, keeps
    transformers' greedy tokens."""
    from pdflash.offload.experts import OffloadedExperts
    from pdflash.offload.host_exchange import HostExchange

    with OffloadedModel.load(qwen_ckpts["qwen3-bf16"], cpu_experts="auto", expert_cache_experts=QK + 2,
                             link_gbps=0.001) as rt:
        ex = HostExchange(torch.device("cpu"))
        for m in rt.model.modules():
            if isinstance(m, OffloadedExperts):
                m.exchange = ex
        rt.placer.guard.pin(arm)
        assert generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids == qwen_reference["qwen3-bf16"]
        st = rt.stats()
        assert st["cpu_experts"]["computed"] > 0
        if arm == "all":
            assert st["experts_per_token"]["cache"] == 0 and st["experts_per_token"]["fetched"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-bf16", "qwen3-fp8"])
def test_qwen3_cuda_matches_transformers_on_cuda(qwen_ckpts, name):
    """On CUDA (cuBLAS shapes differ from the library's grouped matmuls): prefill logits close to
    transformers' (FP8 dequantized by transformers' loader), and the same greedy tokens at every
    cache size (CUDA graphs of this family: tests/test_graphs.py's qwen3 checkpoint)."""
    ref = _qwen3_on_cuda(qwen_ckpts[name])
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        want_logits = ref(ids).logits.float()
    tokens = {}
    for slots, kw in ((QK, {"lookahead_depth": 1}), (QK + 3, {}), (None, {})):
        with OffloadedModel.load(qwen_ckpts[name], device="cuda", expert_cache_experts=slots, **kw) as rt:
            got_logits = rt.forward(ids).logits.float()
            assert torch.allclose(got_logits, want_logits, atol=0.1, rtol=0.05)
            tokens[slots] = generate(rt, PROMPT, max_new_tokens=NEW, eos_token_ids=[]).token_ids
    assert tokens[QK] == tokens[QK + 3] == tokens[None]


def _qwen3_on_cuda(path):
    from transformers import Qwen3MoeForCausalLM

    from pdflash.offload.checkpoint import Checkpoint

    with Checkpoint(path) as ck:
        kw = ck.family.reference_load_kwargs()
    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", attn_implementation="eager", **kw)
