"""Synthetic GGUF of a pdflash preset, for the llama.cpp ``--n-cpu-moe`` peer benchmark.

    python benchmarks/llamacpp_gguf.py --preset qwen3-30b-a3b --out /dev/shm/q.gguf --gguf-py SRC/gguf-py
    python benchmarks/llamacpp_gguf.py --preset gpt-oss-120b --plan        # sizes as JSON, writes nothing

    --preset NAME --out FILE [--expert-type bf16|q8_0|mxfp4] [--dense-type bf16|q8_0] [--seed N]
    [--gguf-py DIR] [--threads N] [--plan]

The shapes come from pdflash's own presets (``pdflash.offload.config.ModelPreset.from_name``), so
llama.cpp runs exactly the architecture pdflash runs:

- gpt_oss presets -> llama.cpp arch ``gpt-oss``: q/k/v/o projections with biases, attention sinks,
  post-attention norm, a router with bias, gate/up/down expert tensors with per-expert biases,
  sliding-window metadata (llama.cpp derives the alternating sliding/full layers itself, sliding
  first, as pdflash's ``layer_types``), YaRN rope scaling. Experts are MXFP4 by default.
- qwen3_moe presets -> llama.cpp arch ``qwen3moe``: q/k/v/o without biases, per-head q/k RMS norms,
  a router without bias, gate/up/down experts. Experts are bf16 by default; ``--expert-type q8_0``
  writes Q8_0 experts, llama.cpp's counterpart of pdflash's FP8 checkpoints (only the experts:
  the non-expert weights stay bf16).

Tensor names, shapes and types follow llama.cpp's loader (src/models/openai-moe.cpp,
src/models/qwen3moe.cpp) and the types its official converter (convert_hf_to_gguf.py,
conversion/base.py ``prepare_tensors``) produces from a bf16 checkpoint: 2-D weights bf16
(token embedding and output head included), 1-D tensors, norms, biases (expert biases too) and
the router weight (``ffn_gate_inp``) f32. ``general.file_type`` is the converter's: MOSTLY_MXFP4_MOE,
MOSTLY_BF16 or MOSTLY_Q8_0. ``--dense-type q8_0`` makes the 2-D non-expert weights (embedding,
output head, attention projections) Q8_0 instead, as ``llama-quantize ... MXFP4_MOE`` does: with
MXFP4 experts that is the layout of the gpt-oss GGUFs llama.cpp users download (11.27 GiB for
gpt-oss-20b and 59.02 GiB for gpt-oss-120b, against 12.83 and 60.87 GiB with bf16). The loaded
models report llama.cpp's parameter counts of the real ones (20.91 B, 116.83 B, 30.53 B).

Tokenizer: llama-bench feeds random token ids and never tokenizes text, so the file carries
llama.cpp's "no vocabulary" tokenizer (``tokenizer.ggml.model = "none"``) with
``<arch>.vocab_size`` = the preset's ``vocab_size``; llama.cpp then creates that many dummy tokens,
which sizes the embedding and the output head as in the real model.

Values. llama.cpp's speed does not depend on weight values, and its expert placement is static
(``--n-cpu-moe N`` keeps the experts of the first N layers on the CPU), so the values only have to
be finite and sensible: seeded (``--seed``) normal values with pdflash's synthetic scales
(std 1/sqrt(fan_in) for projections and experts, norms N(1, 0.1), biases N(0, 0.02), sinks N(0, 1)),
MXFP4 blocks of random nibbles with one E8M0 scale byte per 32 values chosen so the weight RMS is
about 1/sqrt(fan_in) (127 + round(log2(1 / (sqrt(fan_in) * rms(E2M1)))), e.g. 120 for 2880), Q8_0
blocks quantized from normal values. Tensors of 4 MiB or more (the experts, embedding, output head
and attention projections) are filled by cycling through a seeded random pool of about 64 MiB per
(type, scale), starting at a random block-aligned offset per tensor; everything smaller is fully
random. The router weights (``ffn_gate_inp``, std router_logit_std / sqrt(hidden) as in pdflash)
are always fully random, so routing spreads over the experts as with a trained router.

Speed. The header, metadata and tensor infos are written with gguf-py's ``GGUFWriter``; the tensor
data is then streamed straight to the file in large pieces (pool slices of up to 64 MiB, no
per-tensor buffers), so memory stays at a few hundred MB whatever the model size: with
``--threads 1`` (default) as sequential ``os.write`` calls, with ``--threads N`` by N threads
copying into a shared mapping of the pre-sized file (the same bytes; on tmpfs, where writes to one
file are serialised by the kernel, this scales with the threads). The file is written as
``FILE.partial`` and renamed when complete; the free space of the target file system is checked
first (a mapping that runs out of room would die of SIGBUS instead of failing cleanly).

gguf is not a pdflash dependency: ``--gguf-py DIR`` names the ``gguf-py`` folder of a llama.cpp
source tree (its ``gguf`` package is imported from there); without it an installed ``gguf`` package
is used. gguf-py imports PyYAML for model cards only; where PyYAML is missing a stand-in module is
used, since nothing here reads model cards.

Exit status 0 on success; 2 with one ``llamacpp_gguf: error: ...`` line on stderr for bad input
(unknown preset, unwritable or too small target, no usable gguf package). On success one JSON line
(path, bytes, seconds, GB/s) goes to stdout and progress to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import mmap
import os
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ARCH = {"gpt_oss": "gpt-oss", "qwen3_moe": "qwen3moe"}
DEFAULT_EXPERT_TYPE = {"gpt_oss": "mxfp4", "qwen3_moe": "bf16"}
EXPERT_TYPES = ("bf16", "q8_0", "mxfp4")
# (values per block, bytes per block) of the ggml types written here
BLOCK = {"f32": (1, 4), "bf16": (1, 2), "q8_0": (32, 34), "mxfp4": (32, 17)}
DENSE_TYPES = ("bf16", "q8_0")


def file_type(expert_type: str, dense_type: str) -> str:
    """general.file_type as llama.cpp's tools set it (MXFP4 experts: MOSTLY_MXFP4_MOE whatever the rest)."""
    if expert_type == "mxfp4":
        return "MOSTLY_MXFP4_MOE"
    return "MOSTLY_Q8_0" if "q8_0" in (expert_type, dense_type) else "MOSTLY_BF16"
# RMS of an E2M1 code drawn uniformly from its 16 values (+-{0, .5, 1, 1.5, 2, 3, 4, 6})
FP4_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)

POOL_BYTES = 64 << 20  # seeded random pool per (type, scale) for large tensors
POOL_MIN_TENSOR = 4 << 20  # tensors at least this large are filled from a pool (routers never)


class BadInput(Exception):
    """Bad command-line input: one stderr line, exit status 2."""


# -- imports ----------------------------------------------------------------------------------------
def load_gguf(gguf_py: str | None):
    """The ``gguf`` module: from ``gguf_py`` (a llama.cpp gguf-py folder) or an installed package."""
    if gguf_py:
        d = Path(gguf_py).expanduser().resolve()
        if not (d / "gguf" / "__init__.py").is_file():
            raise BadInput(f"--gguf-py {gguf_py}: no gguf package there (expected {d / 'gguf' / '__init__.py'})")
        sys.path.insert(0, str(d))
        for mod in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
            del sys.modules[mod]
    try:
        importlib.import_module("yaml")
    except ImportError:  # gguf.metadata imports PyYAML for model cards, which are not read here
        stub = types.ModuleType("yaml")

        def _no_yaml(*_a, **_k):
            raise RuntimeError("PyYAML is not installed")

        stub.safe_load = stub.load = stub.dump = stub.safe_dump = _no_yaml
        sys.modules["yaml"] = stub
    try:
        gguf = importlib.import_module("gguf")
    except ImportError as e:
        where = f"--gguf-py {gguf_py}" if gguf_py else "no --gguf-py given and the installed gguf package"
        raise BadInput(f"cannot import gguf ({where}): {e}") from None
    missing = [t for t in ("BF16", "Q8_0", "MXFP4") if not hasattr(gguf.GGMLQuantizationType, t)]
    if missing or not hasattr(gguf, "GGUFWriter"):
        raise BadInput(f"gguf at {Path(gguf.__file__).parent} is too old (no {', '.join(missing) or 'GGUFWriter'}): "
                       "pass --gguf-py with the gguf-py folder of the llama.cpp source being benchmarked")
    return gguf


def load_preset(name: str):
    """pdflash's ModelPreset ``name`` (from this checkout when pdflash is not installed)."""
    sys.path.insert(0, str(HERE))
    from _checkout import import_pdflash

    import_pdflash()
    from pdflash import PdflashError

    try:
        from pdflash.offload.config import ModelPreset
    except ImportError:
        # pdflash.offload imports its runtime (torch, transformers, ...); the presets need none of it
        name_ = "_pdflash_offload_config"
        spec = importlib.util.spec_from_file_location(name_, ROOT / "offload" / "config.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name_] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        ModelPreset = mod.ModelPreset
    try:
        return ModelPreset.from_name(name)
    except PdflashError as e:
        raise BadInput(str(e)) from None


# -- the tensor plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]  # numpy order, outermost first (ggml's ne is the reverse)
    qtype: str  # f32 | bf16 | q8_0 | mxfp4
    mean: float = 0.0
    std: float = 0.0
    router: bool = False  # always fully random
    layer: int | None = None
    expert: bool = False  # an expert tensor (weight or bias): what --n-cpu-moe moves to the CPU

    @property
    def nbytes(self) -> int:
        per, size = BLOCK[self.qtype]
        n = math.prod(self.shape)
        return n // per * size


def tensor_plan(preset, expert_type: str, dense_type: str = "bf16") -> list[Spec]:
    """Every tensor of the GGUF in file order (llama.cpp's names). dense_type: the 2-D non-expert
    weights (embedding, output head, attention projections)."""
    family = preset.family
    if family not in ARCH:
        raise BadInput(f"preset {preset.name}: family {family!r} has no llama.cpp counterpart here")
    H, I, E = preset.hidden_size, preset.intermediate_size, preset.num_local_experts
    V, hd = preset.vocab_size, preset.head_dim
    nq, nkv = preset.num_attention_heads * hd, preset.num_key_value_heads * hd
    per = BLOCK[expert_type][0]
    if H % per or I % per:
        raise BadInput(f"preset {preset.name}: hidden {H} and expert intermediate {I} must be multiples of {per} "
                       f"for {expert_type} experts")
    gpt = family == "gpt_oss"
    norm = dict(qtype="f32", mean=1.0, std=0.1)
    bias = dict(qtype="f32", std=0.02)

    D = dense_type
    if H % BLOCK[D][0] or nq % BLOCK[D][0]:
        raise BadInput(f"preset {preset.name}: hidden {H} and attention width {nq} must be multiples of "
                       f"{BLOCK[D][0]} for {D} dense weights")
    specs = [Spec("token_embd.weight", (V, H), D, std=1.0)]
    for i in range(preset.num_hidden_layers):
        b = f"blk.{i}."
        L = dict(layer=i)
        specs.append(Spec(b + "attn_norm.weight", (H,), **norm, **L))
        for proj, rows in (("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)):
            specs.append(Spec(b + proj + ".weight", (rows, H), D, std=1 / math.sqrt(H), **L))
            if gpt:
                specs.append(Spec(b + proj + ".bias", (rows,), **bias, **L))
        specs.append(Spec(b + "attn_output.weight", (H, nq), D, std=1 / math.sqrt(nq), **L))
        if gpt:
            specs.append(Spec(b + "attn_output.bias", (H,), **bias, **L))
            specs.append(Spec(b + "attn_sinks.weight", (preset.num_attention_heads,), "f32", std=1.0, **L))
            specs.append(Spec(b + "post_attention_norm.weight", (H,), **norm, **L))
        else:
            specs.append(Spec(b + "attn_q_norm.weight", (hd,), **norm, **L))
            specs.append(Spec(b + "attn_k_norm.weight", (hd,), **norm, **L))
            specs.append(Spec(b + "ffn_norm.weight", (H,), **norm, **L))
        specs.append(Spec(b + "ffn_gate_inp.weight", (E, H), "f32", std=preset.router_logit_std / math.sqrt(H),
                          router=True, **L))
        if gpt:
            specs.append(Spec(b + "ffn_gate_inp.bias", (E,), "f32", std=0.1, router=True, **L))
        X = dict(layer=i, expert=True)
        for proj, shape, fan_in in (("ffn_gate_exps", (E, I, H), H), ("ffn_up_exps", (E, I, H), H),
                                    ("ffn_down_exps", (E, H, I), I)):
            specs.append(Spec(b + proj + ".weight", shape, expert_type, std=1 / math.sqrt(fan_in), **X))
            if gpt:
                specs.append(Spec(b + proj + ".bias", shape[:2], **bias, **X))
    specs.append(Spec("output_norm.weight", (H,), **norm))
    specs.append(Spec("output.weight", (V, H), D, std=1 / math.sqrt(H)))
    return specs


def plan_summary(preset, expert_type: str, dense_type: str, specs: list[Spec]) -> dict:
    """Sizes of the file and of what ``-ngl 99 --n-cpu-moe N`` places on the GPU, per N."""
    L = preset.num_hidden_layers
    expert_layer = [0] * L
    for s in specs:
        if s.expert:
            expert_layer[s.layer] += s.nbytes
    total = sum(s.nbytes for s in specs)
    embd = next(s.nbytes for s in specs if s.name == "token_embd.weight")
    experts = sum(expert_layer)
    # llama.cpp keeps the input embedding on the host; every other weight goes to the GPU with
    # -ngl >= n_layer + 1, except the expert tensors of the first N layers with --n-cpu-moe N
    gpu = {n: total - embd - sum(expert_layer[:n]) for n in range(L + 1)}
    return {
        "preset": preset.name, "family": preset.family, "arch": ARCH[preset.family], "expert_type": expert_type,
        "dense_type": dense_type, "file_type": file_type(expert_type, dense_type),
        "n_layer": L, "n_expert": preset.num_local_experts, "n_expert_used": preset.num_experts_per_tok,
        "hidden": preset.hidden_size, "expert_intermediate": preset.intermediate_size, "vocab": preset.vocab_size,
        "n_tensors": len(specs), "tensor_bytes": total, "expert_bytes": experts,
        "expert_bytes_per_layer": expert_layer[0] if L else 0, "token_embd_bytes": embd,
        "non_expert_bytes": total - experts,
        "gpu_weight_bytes_by_ncmoe": gpu,
    }


# -- metadata ---------------------------------------------------------------------------------------
def write_metadata(w, gguf, preset, expert_type: str, dense_type: str) -> None:
    gpt = preset.family == "gpt_oss"
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"pdflash synthetic {preset.name} ({expert_type} experts, {dense_type} dense weights)")
    w.add_description("synthetic weights for speed benchmarks (benchmarks/llamacpp_gguf.py); not a trained model")
    w.add_context_length(preset.max_position_embeddings)
    w.add_embedding_length(preset.hidden_size)
    w.add_block_count(preset.num_hidden_layers)
    # convert_hf_to_gguf writes config.json's intermediate_size here: the expert width for gpt-oss,
    # the dense MLP width for Qwen3-MoE (no dense layer uses it)
    w.add_feed_forward_length(preset.intermediate_size if gpt else
                              (preset.dense_intermediate_size or 2 * preset.intermediate_size))
    w.add_head_count(preset.num_attention_heads)
    w.add_head_count_kv(preset.num_key_value_heads)
    w.add_rope_freq_base(float(preset.rope_theta))
    w.add_layer_norm_rms_eps(float(preset.rms_norm_eps))
    w.add_expert_count(preset.num_local_experts)
    w.add_expert_used_count(preset.num_experts_per_tok)
    w.add_key_length(preset.head_dim)
    w.add_value_length(preset.head_dim)
    w.add_expert_feed_forward_length(preset.intermediate_size)
    rs = dict(preset.rope_scaling or {})
    if rs.get("rope_type") == "yarn" and rs.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
        if rs.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rs["beta_fast"]))
        if rs.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rs["beta_slow"]))
    elif rs:
        raise BadInput(f"preset {preset.name}: rope scaling {rs.get('rope_type')!r} is not handled here")
    if gpt:
        w.add_sliding_window(preset.sliding_window)
    w.add_file_type(int(getattr(gguf.LlamaFileType, file_type(expert_type, dense_type))))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # llama-bench feeds random ids and never tokenizes: the "no vocab" tokenizer with the preset's size
    w.add_tokenizer_model("none")
    w.add_vocab_size(preset.vocab_size)


# -- values -----------------------------------------------------------------------------------------
def _bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def _q8_0(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(x).max(axis=1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty((x.shape[0], 34), np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def encode(qtype: str, n: int, mean: float, std: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` values of ``qtype`` (n a multiple of its block) as a uint8 array of the ggml layout."""
    if qtype == "mxfp4":
        blocks = rng.integers(0, 256, size=(n // 32, 17), dtype=np.uint8)
        blocks[:, 0] = min(254, max(1, 127 + round(math.log2(std / FP4_RMS))))  # E8M0 scale byte
        return blocks.reshape(-1)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.float32(std)
    x += np.float32(mean)
    if qtype == "f32":
        return x.astype("<f4").view(np.uint8)
    if qtype == "bf16":
        return _bf16(x).view(np.uint8)
    if qtype == "q8_0":
        return _q8_0(x).reshape(-1)
    raise ValueError(qtype)


class Pools:
    """Seeded random pools (about POOL_BYTES each) per (type, mean, std), made on first use."""

    def __init__(self, seed: int, pool_bytes: int):
        self.seed, self.pool_bytes, self.pools = seed, pool_bytes, {}

    def get(self, qtype: str, mean: float, std: float) -> np.ndarray:
        key = (qtype, mean, std)
        if key not in self.pools:
            per, size = BLOCK[qtype]
            n_blocks = max(1, self.pool_bytes // size)
            rng = np.random.default_rng([self.seed, 1, len(self.pools)])
            self.pools[key] = encode(qtype, n_blocks * per, mean, std, rng)
        return self.pools[key]


def _write_all(fd: int, buf) -> None:
    mv = memoryview(buf).cast("B")
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


# -- writing ---------------------------------------------------------------------------------------
def _tasks(specs: list[Spec], seed: int, pools: Pools, data_start: int, align: int):
    """(file offset, task) for every piece of tensor data, in file order, and the file size.

    A task is ("gen", spec, index): a fully random tensor, generated when written; or
    ("pool", pool, start, n): n bytes of a pool from ``start``. Pool tensors start at a seeded
    random block-aligned offset and wrap around, in pieces of at most the pool's size."""
    out, pos = [], data_start
    for idx, s in enumerate(specs):
        nb = s.nbytes
        if s.router or nb < POOL_MIN_TENSOR:
            out.append((pos, ("gen", s, idx)))
        else:
            pool = pools.get(s.qtype, s.mean, s.std)
            bsize = BLOCK[s.qtype][1]
            off = int(np.random.default_rng([seed, 0, idx]).integers(0, len(pool) // bsize)) * bsize
            left, at = nb, pos
            while left:
                n = min(left, len(pool) - off)
                out.append((at, ("pool", pool, off, n)))
                at, left, off = at + n, left - n, 0
        pos += nb + (-nb) % align
    return out, pos


def _task_bytes(task, seed: int):
    if task[0] == "gen":
        _, s, idx = task
        per, size = BLOCK[s.qtype]
        return encode(s.qtype, s.nbytes // size * per, s.mean, s.std, np.random.default_rng([seed, 0, idx]))
    _, pool, start, n = task
    return pool[start:start + n]


def write_gguf(gguf, preset, expert_type: str, dense_type: str, specs: list[Spec], out: Path, seed: int,
               pool_bytes: int = POOL_BYTES, threads: int = 1, progress: bool = True) -> dict:
    """Write the GGUF to ``out`` (via ``out.partial``). threads == 1: sequential os.write calls;
    threads > 1: the data section is filled through a shared mapping of the pre-sized file by that
    many threads (the same bytes; faster on tmpfs, where writes to one file are serialised)."""
    arch = ARCH[preset.family]
    part = out.with_name(out.name + ".partial")
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(part, arch)
    total = sum(s.nbytes for s in specs)
    try:
        write_metadata(w, gguf, preset, expert_type, dense_type)
        for s in specs:
            raw = getattr(gguf.GGMLQuantizationType, s.qtype.upper())
            # a non-uint8 placeholder dtype: the shape is taken as element counts (quant types included)
            w.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes, raw_dtype=raw)
        w.write_header_to_file(part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        fout.flush()
        align = int(w.data_alignment)
        data_start = fout.tell() + (-fout.tell()) % align
        tasks, size = _tasks(specs, seed, Pools(seed, pool_bytes), data_start, align)
        done, t_last = 0, time.perf_counter()

        def report(nbytes):
            nonlocal done, t_last
            done += nbytes
            now = time.perf_counter()
            if progress and now - t_last > 10:
                print(f"llamacpp_gguf: {done / 1e9:.1f} / {total / 1e9:.1f} GB, {done / 1e9 / (now - t0):.2f} GB/s",
                      file=sys.stderr, flush=True)
                t_last = now

        if threads <= 1:
            fd, pos = fout.fileno(), fout.tell()
            for at, task in tasks:
                if at > pos:
                    _write_all(fd, bytes(at - pos))  # alignment padding
                data = _task_bytes(task, seed)
                _write_all(fd, data)
                pos = at + data.nbytes
                report(data.nbytes)
            if size > pos:
                _write_all(fd, bytes(size - pos))
            w.close()
        else:
            w.close()
            fd = os.open(part, os.O_RDWR)
            try:
                os.ftruncate(fd, size)  # zeros: the padding
                mm = mmap.mmap(fd, size)
                try:
                    view = np.frombuffer(mm, dtype=np.uint8)

                    def fill(item):
                        at, task = item
                        data = _task_bytes(task, seed)
                        view[at:at + data.nbytes] = data
                        return data.nbytes

                    with ThreadPoolExecutor(threads) as ex:
                        for n in ex.map(fill, tasks):
                            report(n)
                    del view
                finally:
                    mm.close()
            finally:
                os.close(fd)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    got = part.stat().st_size
    if got != size:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"{part}: wrote {got} bytes, expected {size}")
    os.replace(part, out)
    sec = time.perf_counter() - t0
    return {"path": str(out), "preset": preset.name, "arch": arch, "expert_type": expert_type,
            "dense_type": dense_type, "seed": seed,
            "bytes": got, "tensor_bytes": total, "header_bytes": data_start, "threads": max(1, threads),
            "seconds": round(sec, 3), "gb_per_s": round(got / 1e9 / sec, 3) if sec > 0 else None}


def check_out(out: str | None, need: int) -> Path:
    if not out:
        raise BadInput("--out FILE is required (or --plan)")
    path = Path(out).expanduser()
    if path.is_dir():
        raise BadInput(f"--out {out} is a directory: give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise BadInput(f"--out {out} cannot be written: {parent} is not a writable directory")
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if path.is_file():
        free += path.stat().st_size  # an existing file of that name is deleted before writing
    if free < need:
        raise BadInput(f"--out {out}: needs {need / 1e9:.1f} GB, {parent} has {free / 1e9:.1f} GB free")
    return path.resolve()


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"llamacpp_gguf: error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, help="a pdflash preset (offload/config.py PRESETS)")
    p.add_argument("--out", help="the GGUF file to write")
    p.add_argument("--expert-type", choices=EXPERT_TYPES,
                   help="ggml type of the expert weights (default: mxfp4 for gpt-oss, bf16 for qwen3_moe)")
    p.add_argument("--dense-type", choices=DENSE_TYPES, default="bf16",
                   help="ggml type of the 2-D non-expert weights: bf16 (default, what convert_hf_to_gguf.py "
                        "writes from a bf16 checkpoint) or q8_0 (what llama-quantize MXFP4_MOE makes, as in "
                        "the gpt-oss GGUFs llama.cpp users download)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gguf-py", help="gguf-py folder of the llama.cpp source (default: an installed gguf package)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads filling the file through a shared mapping (default 1: sequential writes)")
    p.add_argument("--plan", action="store_true", help="print the tensor sizes as JSON and write nothing")
    p.add_argument("--pool-mib", type=int, default=POOL_BYTES >> 20, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        if args.seed < 0:
            raise BadInput(f"--seed {args.seed}: must be >= 0")
        if args.threads < 1:
            raise BadInput(f"--threads {args.threads}: must be >= 1")
        if args.pool_mib < 1:
            raise BadInput("--pool-mib must be >= 1")
        preset = load_preset(args.preset)
        expert_type = args.expert_type or DEFAULT_EXPERT_TYPE.get(preset.family, "bf16")
        specs = tensor_plan(preset, expert_type, args.dense_type)
        summary = plan_summary(preset, expert_type, args.dense_type, specs)
        if args.plan:
            print(json.dumps(summary))
            return 0
        out = check_out(args.out, summary["tensor_bytes"] + (64 << 20))
        gguf = load_gguf(args.gguf_py)
    except BadInput as e:
        print(f"llamacpp_gguf: error: {e}", file=sys.stderr)
        return 2
    print(f"llamacpp_gguf: writing {out} ({preset.name}, {summary['arch']}, {expert_type} experts, "
          f"{args.dense_type} dense weights, "
          f"{summary['tensor_bytes'] / 1e9:.2f} GB, {summary['n_tensors']} tensors)", file=sys.stderr, flush=True)
    if out.is_file():
        out.unlink()
    res = write_gguf(gguf, preset, expert_type, args.dense_type, specs, out, args.seed, pool_bytes=args.pool_mib << 20,
                     threads=args.threads)
    print(f"llamacpp_gguf: wrote {out}: {res['bytes'] / 1e9:.2f} GB in {res['seconds']:.1f} s "
          f"({res['gb_per_s']:.2f} GB/s)", file=sys.stderr, flush=True)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
