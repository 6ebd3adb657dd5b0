"""Synthetic checkpoints of any supported family: real file format, seeded random weights.

``write_checkpoint(out_dir, preset, mxfp4=... | quant=..., seed=..., dtype=...)`` writes

- config.json            the preset family's config (GptOssForCausalLM, Qwen3MoeForCausalLM),
                         with quantization_config when MXFP4 / FP8,
- generation_config.json bos / eos / pad ids,
- model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json,
  with the tensor names, shapes and dtypes of the real checkpoints (the family adapter's
  ``tensor_specs``; each tensor's random values follow its ``init_rule``),
- tokenizer.json         a byte-level BPE trained in-process on a fixed text,
- tokenizer_config.json  special tokens and a chat template.

Safetensors files are streamed tensor by tensor, chunk by chunk, so the
gpt-oss-20b preset (about 13 GB in MXFP4) never needs more than a few chunks in
memory. Every chunk has its own seeded generator, so the bytes do not depend
on how many threads produced them.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from pdflash import PdflashError
from pdflash.offload.config import SPECIAL_TOKENS, ModelPreset
from pdflash.offload.family import TensorSpec

CHUNK_ELEMS = 1 << 24  # elements generated per job

_ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant<|message|>{%- endif -%}"
)

# Training text of the synthetic tokenizer (any fixed text works; it only shapes the merges).
_TEXT = """\
A mixture of experts model sends every token through a few of its many feed forward experts.
The router scores all experts and keeps the best four; the others are never read for that token.
When the experts do not fit on the accelerator, they wait in host memory and cross the link on demand.
Each expert of each layer is one contiguous block of bytes, so one copy moves one expert.
The cache keeps recently used experts on the device and evicts the least recently used one first.
A prefetcher guesses which experts the next layers will need and starts their copies early.
If the guess was right, the forward pass finds the expert resident and does not wait at all.
If the guess was wrong, the copy was wasted and the link was busy for nothing.
The scheduler serves urgent copies first and splits large copies into chunks.
Tokens per second, time to first token and the time spent waiting are the numbers that matter.
def route(hidden, router, top_k=4):
    logits = router(hidden)
    values, experts = logits.topk(top_k, dim=-1)
    return values.softmax(dim=-1), experts
for layer in range(24):
    for expert in range(32):
        print(f"layer {layer} expert {expert}: {bytes_per_expert} bytes")
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2880 5760.
Questions and answers: what is the capital of France? Paris. How many legs has a spider? Eight.
The weather today is sunny with a light breeze from the west, and tomorrow may bring rain.
"""

# -- tokenizer -----------------------------------------------------------------------------
def build_tokenizer(vocab_size: int):
    """A byte-level BPE (tokenizers.Tokenizer) trained on _TEXT, with SPECIAL_TOKENS appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(keepends=True), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_tokenizer(out: Path, preset: ModelPreset) -> dict[str, int]:
    """tokenizer.json + tokenizer_config.json; returns {special token: id}."""
    tok = build_tokenizer(preset.tokenizer_vocab)
    if tok.get_vocab_size() > preset.vocab_size:
        raise PdflashError(f"preset {preset.name}: tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size")
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": preset.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return ids

# -- random values ---------------------------------------------------------------------------
def _seed(seed: int, name: str, chunk: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 65_537 + chunk) % (2**63)


def _make_chunk(name: str, rule: tuple[str, float, float], dtype: torch.dtype, seed: int, chunk: int, n: int) -> torch.Tensor:
    kind, mean, std = rule
    s = _seed(seed, name, chunk)
    if kind == "bytes":
        words = np.random.Generator(np.random.SFC64(s)).integers(0, 2**64 - 1, size=(n + 7) // 8, dtype=np.uint64, endpoint=True)
        return torch.from_numpy(words.view(np.uint8)[:n])
    if kind == "scales":
        vals = np.random.Generator(np.random.SFC64(s)).integers(int(mean) - 1, int(mean) + 1, size=n, dtype=np.uint8, endpoint=True)
        return torch.from_numpy(vals)
    g = torch.Generator().manual_seed(s)
    if kind == "uniform":  # mean +- std
        return ((torch.rand(n, generator=g) * 2 - 1) * std + mean).to(dtype)
    x = torch.randn(n, generator=g)
    if kind == "fp8":  # normal values in FP8's range, stored as float8_e4m3fn
        return x.mul_(std).clamp_(-448.0, 448.0).to(dtype)
    if std != 1.0:
        x.mul_(std)
    if mean:
        x.add_(mean)
    return x.to(dtype)

def _fill_chunk(dest: torch.Tensor, name: str, rule: tuple[str, float, float], dtype: torch.dtype, seed: int,
                chunk: int) -> None:
    """Chunk ``chunk`` of tensor ``name`` (:func:`_make_chunk`) written into ``dest``, its slice."""
    dest.copy_(_make_chunk(name, rule, dtype, seed, chunk, dest.numel()))


# -- safetensors streaming --------------------------------------------------------------------
def _ordered(jobs: list, fn: Callable, workers: int) -> Iterator:
    """fn(job) for each job, in order, computed ahead by a thread pool (bounded window)."""
    if workers <= 1:
        for j in jobs:
            yield fn(j)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        window: deque = deque()
        it = iter(jobs)
        try:
            for j in it:
                window.append(pool.submit(fn, j))
                if len(window) >= 2 * workers:
                    break
            while window:
                yield window.popleft().result()
                nxt = next(it, None)
                if nxt is not None:
                    window.append(pool.submit(fn, nxt))
        finally:  # an error or Ctrl-C in the consumer: do not compute chunks nobody will write
            for f in window:
                f.cancel()


def write_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    chunk_fn: Callable[[str, int, int], torch.Tensor],
    on_bytes: Callable[[int], None] = lambda n: None,
    workers: int = 1,
) -> None:
    """Stream a safetensors file: header first, then each tensor's bytes chunk by chunk.

    chunk_fn(name, chunk_index, numel) returns a contiguous CPU tensor of that many elements.
    The file is written to a temporary name and renamed when complete.
    """
    header, off, jobs = {}, 0, []
    for name, dtype, shape in entries:
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
        for c, start in enumerate(range(0, numel, CHUNK_ELEMS)):
            jobs.append((name, c, min(CHUNK_ELEMS, numel - start)))
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for t in _ordered(jobs, lambda j: chunk_fn(*j), workers):
                data = t.contiguous().view(torch.uint8).numpy()
                fh.write(memoryview(data))
                on_bytes(data.nbytes)
        os.replace(tmp, path)
    except BaseException:  # an error, a full disk or Ctrl-C: no partial file stays behind
        tmp.unlink(missing_ok=True)
        raise

# -- checkpoint --------------------------------------------------------------------------------
def _shard_plan(specs: dict[str, TensorSpec], dtypes: dict[str, torch.dtype], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards in a stable order: embeddings, then layers, then head."""

    def size(n):
        return math.prod(specs[n].shape) * torch.empty((), dtype=dtypes[n]).element_size()

    shards, cur, cur_bytes = [], [], 0
    for name in specs:  # specs are ordered: embed, norm, lm_head, then layer by layer
        b = size(name)
        if cur and cur_bytes + b > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += b
    if cur:
        shards.append(cur)
    return shards


def _tensor_dtypes(specs: dict[str, TensorSpec], dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Stored dtype of each tensor: bytes and FP8 as the spec says, FP8 scales float32, the rest ``dtype``."""
    def pick(name: str, spec: TensorSpec) -> torch.dtype:
        if spec.dtypes == ("U8",):
            return torch.uint8
        if spec.dtypes == ("F8_E4M3",):
            return torch.float8_e4m3fn
        if name.endswith("weight_scale_inv"):
            return torch.float32
        return dtype

    return {n: pick(n, s) for n, s in specs.items()}


def checkpoint_bytes(preset: ModelPreset, *, mxfp4: bool = False, quant: str | None = None,
                     dtype: str = "bfloat16") -> int:
    """Bytes of tensor data a checkpoint of ``preset`` holds (what write_checkpoint streams)."""
    from pdflash.offload.family import find_family

    if dtype not in _DTYPES:
        raise PdflashError(f"unsupported dtype {dtype!r}: choose one of {', '.join(_DTYPES)}", exit_code=2)
    config = preset.hf_config({tok: i for i, tok in enumerate(SPECIAL_TOKENS)}, dtype=dtype, mxfp4=mxfp4, quant=quant)
    specs = find_family(config, f"preset {preset.name}").tensor_specs()
    dtypes = _tensor_dtypes(specs, _DTYPES[dtype])
    return sum(math.prod(s.shape) * torch.empty((), dtype=dtypes[n]).element_size() for n, s in specs.items())


def write_checkpoint(
    out_dir: str | os.PathLike,
    preset: ModelPreset,
    *,
    mxfp4: bool = False,
    quant: str | None = None,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 4 << 30,
    progress: bool = False,
    workers: int | None = None,
) -> Path:
    """Write a complete synthetic checkpoint into out_dir (created if needed); returns its path.

    The preset's family decides the config and the tensors; ``quant`` (or ``mxfp4=True``) picks
    its quantized expert format: "mxfp4" for gpt_oss, "fp8" for qwen3_moe. The free space is
    checked before anything is written. Weight files of an older checkpoint in out_dir are not
    removed: write into a new or empty directory (``pdflash make-synthetic`` stages its files and
    refuses a non-empty directory without --force).
    """
    from pdflash.offload.family import find_family

    total = checkpoint_bytes(preset, mxfp4=mxfp4, quant=quant, dtype=dtype)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise PdflashError(f"{out} exists and is not a directory")
    free = _free_bytes(out)
    if free is not None and free < total:
        raise PdflashError(f"{out}: the checkpoint needs {total / 1e6:.3g} MB but only {free / 1e6:.3g} MB are free")
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, preset)
    config = preset.hf_config(ids, dtype=dtype, mxfp4=mxfp4, quant=quant)
    fam = find_family(config, f"preset {preset.name}")
    specs = fam.tensor_specs()
    dtypes = _tensor_dtypes(specs, _DTYPES[dtype])
    shards = _shard_plan(specs, dtypes, max_shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    rules = {n: fam.init_rule(n, preset) for n in specs}
    workers = workers or max(1, min(8, (os.cpu_count() or 1)))

    def chunk(name: str, c: int, n: int) -> torch.Tensor:
        return _make_chunk(name, rules[name], dtypes[name], seed, c, n)

    with _progress(progress, total, f"writing {out.name}") as advance:
        for fname, shard in zip(names, shards):
            entries = [(n, dtypes[n], specs[n].shape) for n in shard]
            write_safetensors(out / fname, entries, chunk, advance, workers)
    if len(shards) > 1:
        weight_map = {n: f for f, shard in zip(names, shards) for n in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": ids["<|startoftext|>"], "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"]],
           "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` or of its nearest existing parent."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _progress:
    """Context manager yielding advance(nbytes); a Rich bar on stderr when enabled."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.enabled, self.total, self.label = enabled, total, label

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False,
        )
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()
        return False


def random_mxfp4_slots(layout, n: int, seed: int = 0, scales: tuple[int, int] = (118, 124), bias_std: float = 0.1) -> torch.Tensor:
    """[n, expert_bytes] uint8 slots of random MXFP4 experts in ``layout``: random code bytes,
    E8M0 scales drawn from ``scales`` (low inclusive, high exclusive), normal biases. For kernel
    checks that need expert bytes without a checkpoint."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, 256, (n, layout.expert_bytes), dtype=torch.uint8, generator=g)
    for p in layout.pieces:
        v = layout.view(slots, p.name)
        if p.name.endswith("_scales"):
            v.copy_(torch.randint(scales[0], scales[1], v.shape, generator=g))
        elif p.name.endswith("_bias"):
            v.copy_(torch.randn(v.shape, generator=g) * bias_std)
    return slots


class SyntheticCheckpoint:
    """A synthetic checkpoint held in memory: the values ``write_checkpoint`` would write (same
    seeds, same chunks, same bytes), generated when a tensor is read, never stored on disk.

    For shapes whose weights do not fit a disk (Qwen3-30B-A3B in bf16 is 61 GB): pass it to
    ``OffloadedModel.load`` (or bench/peers.load_transformers_reference) in place of a directory;
    everything after loading is the same code path. It has the interface of
    offload/checkpoint.Checkpoint; ``path`` is a temporary directory with config.json,
    generation_config.json and the tokenizer (no weights), removed by ``close()``. ``get_many``
    generates several tensors at once on a thread pool (``workers`` threads).
    """

    synthetic = True

    def __init__(self, preset: ModelPreset, *, mxfp4: bool = False, quant: str | None = None, seed: int = 0,
                 dtype: str = "bfloat16", workers: int | None = None):
        import shutil
        import tempfile

        from pdflash.offload.family import find_family

        if dtype not in _DTYPES:
            raise PdflashError(f"unsupported dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
        self.preset = preset
        self.seed = seed
        self.path = Path(tempfile.mkdtemp(prefix=f"pdflash-synthetic-{preset.name}-"))
        self._rmtree = shutil.rmtree
        try:
            ids = write_tokenizer(self.path, preset)
            self.config = preset.hf_config(ids, dtype=dtype, mxfp4=mxfp4, quant=quant)
            (self.path / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
            gen = {"bos_token_id": ids["<|startoftext|>"], "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"]],
                   "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
            (self.path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            self.family = find_family(self.config, f"preset {preset.name}")
        except BaseException:
            self._rmtree(self.path, ignore_errors=True)
            raise
        self.specs = self.family.tensor_specs()
        self.dtypes = _tensor_dtypes(self.specs, _DTYPES[dtype])
        self.rules = {n: self.family.init_rule(n, preset) for n in self.specs}
        self.workers = workers or max(1, min(16, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="pdflash-synthetic")

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.dtypes["model.embed_tokens.weight"]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor, as write_checkpoint would store them."""
        return sum(math.prod(s.shape) * torch.empty((), dtype=self.dtypes[n]).element_size() for n, s in self.specs.items())

    def dtype(self, name: str) -> torch.dtype:
        if name not in self.dtypes:
            raise PdflashError(f"synthetic {self.preset.name}: tensor {name} is missing")
        return self.dtypes[name]

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[0]

    def get_many(self, names: list[str]) -> list[torch.Tensor]:
        """The tensors, their chunks generated in parallel, each written by its worker into its
        slice of the tensor (no concatenation on the calling thread)."""
        jobs, out = [], []
        for name in names:
            self.dtype(name)  # a missing name is a PdflashError
            numel = math.prod(self.specs[name].shape)
            flat = torch.empty(numel, dtype=self.dtypes[name])
            for c, start in enumerate(range(0, numel, CHUNK_ELEMS)):
                jobs.append(self._pool.submit(_fill_chunk, flat[start: start + CHUNK_ELEMS], name, self.rules[name],
                                              self.dtypes[name], self.seed, c))
            out.append(flat.view(self.specs[name].shape))
        for job in jobs:
            job.result()  # raises what a worker raised
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "SyntheticCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
