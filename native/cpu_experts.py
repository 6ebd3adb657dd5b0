"""The native CPU expert kernel (``pf_cpu.c``): MoE experts computed on the CPU straight from
their stored weights: gpt-oss (MXFP4 blocks + E8M0 scales, or bf16 / float32 dense weights) and
Qwen3-MoE (:meth:`ExpertWeights.rows`: output-major bf16 / float32 rows, or FP8 rows with block
scales; SiLU-gated).

    from pdflash.native.cpu_experts import CpuExperts, ExpertWeights
    with CpuExperts(threads=8) as k:
        w = ExpertWeights.mxfp4(gu_blocks, gu_scales, gu_bias, dn_blocks, dn_scales, dn_bias)
        y = k.forward(w, x)      # x [T, H] float32 or bfloat16, T <= MAX_TOKENS -> y [T, H] float32

``forward`` applies one expert (no routing weight) to up to ``MAX_TOKENS`` tokens; more
tokens are run in slices of ``MAX_TOKENS``. ``forward_many`` runs a whole layer's experts in one
call, gathering token rows, scaling by routing weights and scattering into an output buffer in C. The call releases the GIL while the C pool
works. Calls on one ``CpuExperts`` are serialized (one pool); ``close()`` is terminal.

Caller contract: the weight tensors stay alive and unchanged while a call runs (an
``ExpertWeights`` keeps references to them). The level is the best this CPU runs unless
``level`` or the environment variable ``PDFLASH_CPU_LEVEL`` (scalar, avx2, avx512,
avx512_bf16, amx_bf16) names a lower one.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from pdflash import PdflashError
from pdflash.native import NativeLibraryMissing

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16")
MAX_TOKENS = 16


class CpuExpertError(PdflashError):
    """A CPU expert kernel call was refused (bad weights or input, closed context)."""


class CpuLevelUnsupported(CpuExpertError):
    """The kernel level asked for is not supported by this CPU."""


def _load():
    try:
        from pdflash.native import _pf_sched  # type: ignore[attr-defined]
    except ImportError as exc:
        raise NativeLibraryMissing(
            f"the native library is not built ({exc}); run 'pdflash build-native' or 'pip install -e .'"
        ) from None
    if not hasattr(_pf_sched.lib, "pf_cpu_expert"):
        raise NativeLibraryMissing("the native library predates the CPU expert kernel; run 'pdflash build-native'")
    return _pf_sched.ffi, _pf_sched.lib


def detect_level() -> str:
    """The best kernel level this CPU runs."""
    ffi, lib = _load()
    return LEVELS[lib.pf_cpu_detect()]


def supported_levels() -> list[str]:
    """Every level this CPU runs, lowest first."""
    return list(LEVELS[: LEVELS.index(detect_level()) + 1])


def default_threads() -> int:
    """Cores this process may run on (the kernel is bandwidth-bound: more threads than cores only add hand-offs)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


_FORMAT = {torch.float32: 0, torch.bfloat16: 1}
_MXFP4 = 2
_ROWS = {torch.float32: 3, torch.bfloat16: 4, torch.float8_e4m3fn: 5}  # Qwen3-MoE's row formats


def _check_tensor(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtypes) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise CpuExpertError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise CpuExpertError(f"{name} must be in host memory, got {t.device}")
    if t.dtype not in dtypes:
        raise CpuExpertError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise CpuExpertError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise CpuExpertError(f"{name} must be contiguous")


@dataclass
class ExpertWeights:
    """One expert's weights as stored (views, no copies). Build with :meth:`mxfp4` or :meth:`dense`.

    MXFP4: blocks [out, in/32, 16] uint8 and scales [out, in/32] uint8 for gate_up (out = 2I,
    in = H) and down (out = H, in = I). Dense: gate_up [H, 2I] and down [I, H] in bfloat16 or
    float32 (transformers' layout). Biases [2I] and [H] (float32 or bfloat16, same dtype) or None.
    ``round_bf16``: round the intermediate results as a bfloat16 model does (see pf_cpu.h).
    """

    format: int
    hidden: int
    inter: int
    tensors: dict = field(repr=False)
    alpha: float = 1.702
    limit: float = 7.0
    round_bf16: bool = False
    block: int = 0  # FP8 rows: the scales' tile edge
    scale_format: int = 0  # FP8 rows: float32 (0) or bfloat16 (1) scales
    _struct: object = field(default=None, repr=False, compare=False)

    @classmethod
    def mxfp4(cls, gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales, down_bias,
              alpha: float = 1.702, limit: float = 7.0, round_bf16: bool = False) -> "ExpertWeights":
        if gate_up_blocks.dim() != 3 or down_blocks.dim() != 3:
            raise CpuExpertError("MXFP4 blocks must be [out, in/32, 16]")
        two_i, g_h, _ = gate_up_blocks.shape
        hidden, g_i = down_blocks.shape[0], down_blocks.shape[1]
        inter = two_i // 2
        if two_i % 2 or g_h * 32 != hidden or g_i * 32 != inter:
            raise CpuExpertError(
                f"MXFP4 shapes do not fit one gpt-oss expert: gate_up {tuple(gate_up_blocks.shape)}, down {tuple(down_blocks.shape)}"
            )
        u8 = (torch.uint8,)
        _check_tensor(gate_up_blocks, "gate_up_blocks", (2 * inter, hidden // 32, 16), u8)
        _check_tensor(gate_up_scales, "gate_up_scales", (2 * inter, hidden // 32), u8)
        _check_tensor(down_blocks, "down_blocks", (hidden, inter // 32, 16), u8)
        _check_tensor(down_scales, "down_scales", (hidden, inter // 32), u8)
        t = dict(gate_up=gate_up_blocks, gate_up_scales=gate_up_scales, gate_up_bias=gate_up_bias,
                 down=down_blocks, down_scales=down_scales, down_bias=down_bias)
        w = cls(_MXFP4, int(hidden), int(inter), t, float(alpha), float(limit), bool(round_bf16))
        w._check_bias()
        return w

    @classmethod
    def dense(cls, gate_up, gate_up_bias, down, down_bias, alpha: float = 1.702, limit: float = 7.0,
              round_bf16: bool = False) -> "ExpertWeights":
        if gate_up.dim() != 2 or down.dim() != 2:
            raise CpuExpertError("dense weights must be gate_up [H, 2I] and down [I, H]")
        hidden, two_i = gate_up.shape
        inter = two_i // 2
        if two_i % 2 or tuple(down.shape) != (inter, hidden):
            raise CpuExpertError(f"dense shapes do not fit one gpt-oss expert: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
        if gate_up.dtype not in _FORMAT or down.dtype != gate_up.dtype:
            raise CpuExpertError(f"dense weights must both be float32 or bfloat16, got {gate_up.dtype} and {down.dtype}")
        _check_tensor(gate_up, "gate_up", (hidden, 2 * inter), (gate_up.dtype,))
        _check_tensor(down, "down", (inter, hidden), (gate_up.dtype,))
        t = dict(gate_up=gate_up, gate_up_scales=None, gate_up_bias=gate_up_bias, down=down, down_scales=None,
                 down_bias=down_bias)
        w = cls(_FORMAT[gate_up.dtype], int(hidden), int(inter), t, float(alpha), float(limit), bool(round_bf16))
        w._check_bias()
        return w

    @classmethod
    def rows(cls, gate_up, down, gate_up_scales=None, down_scales=None, round_bf16: bool = False) -> "ExpertWeights":
        """Qwen3-MoE's expert as stored: gate_up [2I, H] (gate rows, then up rows) and down [H, I],
        float32, bfloat16 or float8_e4m3fn; FP8 with scales [2I/b, H/b] and [H/b, I/b] (float32 or
        bfloat16, one per b x b tile). h = silu(gate) * up; no biases."""
        if gate_up.dim() != 2 or down.dim() != 2:
            raise CpuExpertError("row weights must be gate_up [2I, H] and down [H, I]")
        two_i, hidden = gate_up.shape
        inter = two_i // 2
        if two_i % 2 or tuple(down.shape) != (hidden, inter):
            raise CpuExpertError(f"row shapes do not fit one Qwen3-MoE expert: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
        if gate_up.dtype not in _ROWS or down.dtype != gate_up.dtype:
            raise CpuExpertError(f"row weights must both be float32, bfloat16 or float8_e4m3fn, got {gate_up.dtype} and {down.dtype}")
        _check_tensor(gate_up, "gate_up", (2 * inter, hidden), (gate_up.dtype,))
        _check_tensor(down, "down", (hidden, inter), (gate_up.dtype,))
        fp8 = gate_up.dtype == torch.float8_e4m3fn
        block, scale_format = 0, 0
        if fp8:
            if gate_up_scales is None or down_scales is None or gate_up_scales.dim() != 2:
                raise CpuExpertError("FP8 row weights need their block scales")
            block = two_i // gate_up_scales.shape[0] if gate_up_scales.shape[0] else 0
            if block < 1 or hidden % block or inter % block:
                raise CpuExpertError(f"FP8 scales {tuple(gate_up_scales.shape)} do not tile gate_up {tuple(gate_up.shape)} in square blocks dividing H and I")
            if gate_up_scales.dtype not in _FORMAT or down_scales.dtype != gate_up_scales.dtype:
                raise CpuExpertError(f"FP8 scales must both be float32 or bfloat16, got {gate_up_scales.dtype} and {down_scales.dtype}")
            _check_tensor(gate_up_scales, "gate_up_scales", (two_i // block, hidden // block), (gate_up_scales.dtype,))
            _check_tensor(down_scales, "down_scales", (hidden // block, inter // block), (gate_up_scales.dtype,))
            scale_format = _FORMAT[gate_up_scales.dtype]
        elif gate_up_scales is not None or down_scales is not None:
            raise CpuExpertError("only FP8 row weights take scales")
        t = dict(gate_up=gate_up, gate_up_scales=gate_up_scales, gate_up_bias=None, down=down, down_scales=down_scales,
                 down_bias=None)
        return cls(_ROWS[gate_up.dtype], int(hidden), int(inter), t, round_bf16=bool(round_bf16), block=block,
                   scale_format=scale_format)

    def _check_bias(self) -> None:
        b1, b2 = self.tensors["gate_up_bias"], self.tensors["down_bias"]
        dts = {b.dtype for b in (b1, b2) if b is not None}
        if len(dts) > 1 or not dts <= set(_FORMAT):
            raise CpuExpertError(f"biases must both be float32 or bfloat16, got {sorted(str(d) for d in dts)}")
        _check_tensor(b1, "gate_up_bias", (2 * self.inter,), tuple(_FORMAT))
        _check_tensor(b2, "down_bias", (self.hidden,), tuple(_FORMAT))

    @property
    def bias_format(self) -> int:
        for name in ("gate_up_bias", "down_bias"):
            b = self.tensors[name]
            if b is not None:
                return _FORMAT[b.dtype]
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes one call reads from the weights (blocks, scales, biases)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values() if t is not None)

    def struct(self, ffi):
        """The pf_cpu_weights struct pointing at the tensors (built once, kept with them)."""
        if self._struct is None:
            s = ffi.new("pf_cpu_weights *")
            s.format = self.format
            s.bias_format = self.bias_format
            s.hidden = self.hidden
            s.inter = self.inter
            t = self.tensors
            ptr = lambda name, ctype="void *": ffi.NULL if t[name] is None else ffi.cast(ctype, t[name].data_ptr())  # noqa: E731
            s.gate_up = ptr("gate_up")
            s.gate_up_scales = ptr("gate_up_scales", "uint8_t *")
            s.gate_up_bias = ptr("gate_up_bias")
            s.down = ptr("down")
            s.down_scales = ptr("down_scales", "uint8_t *")
            s.down_bias = ptr("down_bias")
            s.alpha = self.alpha
            s.limit = self.limit
            s.round_bf16 = int(self.round_bf16)
            s.block = self.block
            s.scale_format = self.scale_format
            self._struct = s
        return self._struct


class CpuExperts:
    """A pool of ``threads`` threads (the caller included) running the native expert kernel."""

    def __init__(self, threads: int | None = None, level: str | None = None):
        ffi, lib = _load()
        self._ffi, self._lib = ffi, lib
        threads = default_threads() if threads is None else int(threads)
        if not 1 <= threads <= lib.PF_CPU_MAX_THREADS:
            raise CpuExpertError(f"threads must be in [1, {lib.PF_CPU_MAX_THREADS}], got {threads}")
        level = level or os.environ.get("PDFLASH_CPU_LEVEL") or "auto"
        if level == "auto":
            code = lib.PF_CPU_LEVEL_AUTO
        elif level in LEVELS:
            code = LEVELS.index(level)
        else:
            raise CpuExpertError(f"unknown CPU kernel level {level!r}: use auto or one of {', '.join(LEVELS)}")
        out = ffi.new("pf_cpu **")
        rc = lib.pf_cpu_create(threads, code, out)
        if rc == lib.PF_CPU_EUNSUPPORTED:
            raise CpuLevelUnsupported(f"this CPU cannot run the {level} kernels (best: {detect_level()})")
        if rc != 0:
            raise CpuExpertError(f"could not start the CPU expert kernel: {self._strerror(rc)}")
        self._c = out[0]
        self.threads = threads
        self.level = LEVELS[lib.pf_cpu_level(self._c)]
        self._lock = threading.Lock()  # guards _closed / _active against close() during a call
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closed = False
        self._layers: list[CpuLayer] = []  # contexts borrowing the pool: destroyed before it
        self._relays: list[Relay] = []  # relays running those contexts: destroyed before them

    def _strerror(self, rc: int) -> str:
        return self._ffi.string(self._lib.pf_cpu_strerror(rc)).decode()

    def forward(self, weights: ExpertWeights, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] (float32 or bfloat16, host, rows contiguous) -> out [T, H] float32 (given or new)."""
        if not isinstance(weights, ExpertWeights):
            raise CpuExpertError(f"weights must be an ExpertWeights, got {type(weights).__name__}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != weights.hidden:
            raise CpuExpertError(f"x must be a [T, {weights.hidden}] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        if x.device.type != "cpu" or x.dtype not in _FORMAT:
            raise CpuExpertError(f"x must be a float32 or bfloat16 host tensor, got {x.dtype} on {x.device}")
        if x.stride(1) != 1:
            x = x.contiguous()
        T = x.shape[0]
        if T < 1:
            raise CpuExpertError("x has no tokens")
        if out is None:
            out = torch.empty((T, weights.hidden), dtype=torch.float32)
        elif out.dtype != torch.float32 or tuple(out.shape) != (T, weights.hidden) or not out.is_contiguous() or out.device.type != "cpu":
            raise CpuExpertError(f"out must be a contiguous float32 host tensor of shape {(T, weights.hidden)}")
        ffi, lib = self._ffi, self._lib
        s = weights.struct(ffi)
        c = self._enter()
        try:
            for t0 in range(0, T, MAX_TOKENS):
                n = min(MAX_TOKENS, T - t0)
                xs, os_ = x[t0 : t0 + n], out[t0 : t0 + n]
                rc = lib.pf_cpu_expert(c, s, ffi.cast("void *", xs.data_ptr()), _FORMAT[x.dtype], n, x.stride(0),
                                       ffi.cast("float *", os_.data_ptr()))
                if rc != 0:
                    raise CpuExpertError(f"CPU expert kernel: {self._strerror(rc)}")
        finally:
            self._leave()
        return out

    def forward_many(self, weights: list[ExpertWeights], counts: list[int], rows: torch.Tensor, dest: torch.Tensor,
                     x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Many experts in one call (see ``pf_cpu_experts`` in pf_cpu.h): expert k applies to
        ``counts[k]`` (1..MAX_TOKENS) token entries, the entries of all experts laid end to end;
        entry i reads row ``rows[i]`` of x [X, H] and writes row ``dest[i]`` of out [R, H]
        (float32, rows must be distinct; other rows untouched), times ``scale[i]`` when given.
        ``rows`` / ``dest`` are int32 and ``scale`` float32 host tensors of sum(counts) entries."""
        n = len(weights)
        if n != len(counts):
            raise CpuExpertError(f"{n} experts but {len(counts)} token counts")
        if n == 0:
            return
        H = weights[0].hidden
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != H or x.device.type != "cpu" or x.dtype not in _FORMAT:
            raise CpuExpertError(f"x must be a float32 or bfloat16 [X, {H}] host tensor")
        if x.stride(1) != 1:
            x = x.contiguous()
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2 or out.shape[1] != H
                or out.stride(1) != 1 or out.device.type != "cpu"):
            raise CpuExpertError(f"out must be a float32 [R, {H}] host tensor with contiguous rows")
        total = sum(counts)
        for name, t, dt in (("rows", rows, torch.int32), ("dest", dest, torch.int32), ("scale", scale, torch.float32)):
            if t is None and name == "scale":
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dt or t.shape != (total,) or not t.is_contiguous() or t.device.type != "cpu":
                raise CpuExpertError(f"{name} must be a contiguous {dt} host tensor of {total} entries")
        ffi = self._ffi
        self._experts([w.struct(ffi) for w in weights], counts, ffi.cast("int *", rows.data_ptr()),
                      ffi.NULL if scale is None else ffi.cast("float *", scale.data_ptr()), x,
                      out, ffi.cast("int *", dest.data_ptr()))

    def call_many(self, structs: list, counts: list[int], rows: list[int], dest: list[int], scale: list[float],
                  x: torch.Tensor, out: torch.Tensor) -> None:
        """:meth:`forward_many` for a caller that holds the weights' structs
        (``ExpertWeights.struct``) and plain lists: nothing but the lists' lengths and the two
        tensors is checked here (the kernel checks every index and the weights' shapes). The
        per-layer path of hybrid execution, where each microsecond beside the kernel counts."""
        n, total = len(structs), sum(counts)
        if n != len(counts) or not len(rows) == len(dest) == len(scale) == total:
            raise CpuExpertError(f"{n} experts, {len(counts)} token counts, {total} entries: "
                                 f"{len(rows)} rows, {len(dest)} dest, {len(scale)} scales")
        if n == 0:
            return
        H = structs[0].hidden  # the kernel checks that every expert has it
        if x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != H or x.stride(1) != 1 or x.dtype not in _FORMAT:
            raise CpuExpertError(f"x must be a float32 or bfloat16 [X, {H}] host tensor with contiguous rows")
        if out.device.type != "cpu" or out.dim() != 2 or out.shape[1] != H or out.stride(1) != 1 or out.dtype != torch.float32:
            raise CpuExpertError(f"out must be a float32 [R, {H}] host tensor with contiguous rows")
        ffi = self._ffi
        self._experts(structs, counts, ffi.new("int[]", rows), ffi.new("float[]", scale), x, out, ffi.new("int[]", dest))

    def _experts(self, structs: list, counts: list[int], rows, scale, x: torch.Tensor, out: torch.Tensor, dest) -> None:
        """pf_cpu_experts over checked arguments (rows / scale / dest: cffi pointers)."""
        ffi, lib = self._ffi, self._lib
        ws = ffi.new("pf_cpu_weights *[]", structs)
        cnt = ffi.new("int[]", counts)
        c = self._enter()
        try:
            rc = lib.pf_cpu_experts(c, len(structs), ws, cnt, rows, scale, ffi.cast("void *", x.data_ptr()),
                                    _FORMAT[x.dtype], x.shape[0], x.stride(0), ffi.cast("float *", out.data_ptr()),
                                    dest, out.shape[0], out.stride(0))
        finally:
            self._leave()
        if rc != 0:
            raise CpuExpertError(f"CPU expert kernel: {self._strerror(rc)}")

    def layer(self, structs: list, top_k: int, rows: int, idx: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
              out: torch.Tensor, resident: torch.Tensor | None = None, fetch: "LayerFetch | None" = None) -> "CpuLayer":
        """A :class:`CpuLayer` on this pool (closed with it)."""
        lay = CpuLayer(self, structs, top_k, rows, idx, scale, x, out, resident, fetch)
        with self._lock:
            if self._closed:
                lay.close()
                raise CpuExpertError("the CPU expert kernel is closed; create a new CpuExperts")
            self._layers.append(lay)
        return lay

    def relay(self, flags: torch.Tensor, spin_us: int = 2000) -> "Relay":
        """A :class:`Relay` over ``flags`` on this pool's layers (closed with it, before them)."""
        relay = Relay(self, flags, spin_us)
        with self._lock:
            if self._closed:
                relay.close()
                raise CpuExpertError("the CPU expert kernel is closed; create a new CpuExperts")
            self._relays.append(relay)
        return relay

    @property
    def ffi(self):
        """The cffi module's FFI (for ``ExpertWeights.struct``)."""
        return self._ffi

    def stream_read(self, buf: torch.Tensor) -> int:
        """Read a host tensor once with this pool's threads; returns the sum of its 64-bit words
        (little-endian, modulo 2**64; a trailing partial word zero-padded). For bandwidth measurements."""
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            raise CpuExpertError("stream_read needs a contiguous host tensor")
        ffi = self._ffi
        out = ffi.new("uint64_t *")
        self._checked("stream_read", ffi.cast("void *", buf.data_ptr()), buf.numel() * buf.element_size(), out)
        return int(out[0])

    @property
    def active(self) -> int:
        """How many of the pool's threads take part in its calls (:meth:`set_active`)."""
        return int(self._native("active"))

    def set_active(self, n: int) -> None:
        """Let only ``n`` of the pool's threads (1 .. threads: the caller and n - 1 workers) take
        part in its calls from the next phase on; the others sleep, and prewakes leave them asleep
        (``pf_cpu_set_active``). For a caller whose other threads need cores for a while."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.threads:
            raise CpuExpertError(f"set_active: n must be an integer in 1 .. {self.threads}, got {n!r}")
        self._checked("set_active", n)

    @property
    def invariant(self) -> bool:
        """Whether the calls are batch invariant (:meth:`set_invariant`)."""
        return bool(self._native("invariant"))

    def set_invariant(self, on: bool) -> None:
        """Batch invariance (``pf_cpu_set_invariant``): on, every (token, expert) pair of a call is
        computed by the same kernel whatever the number of tokens routed to its expert, so a
        token's result does not depend on the other tokens of its call; off (the default), an
        expert with several tokens takes the AMX tiles where they run, which round their sums
        apart from the one-token kernels. For the calls of speculative decoding's batch-invariant
        verify."""
        self._checked("set_invariant", 1 if on else 0)

    def prewake(self, us: int) -> None:
        """Wake the pool's sleeping threads now; they poll for the next call for up to ``us``
        microseconds (0 .. 100000) before they sleep again (``pf_cpu_prewake``). For a caller that
        knows a call is coming shortly: a sleeping thread takes 30-300 us to wake."""
        if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= 100_000:
            raise CpuExpertError(f"prewake: us must be an integer in 0 .. 100000, got {us!r}")
        self._checked("prewake", us)

    def last_timing(self) -> dict:
        """Where the last call's time went (``pf_cpu_last_timing``), microseconds from its start:
        per phase that ran ("rows", "gate_up", "down", "read"): when it was published, the first
        and the last thread's first claim, how many threads took part, when its last grab
        finished; and "end", when the pool returned."""
        t = self._ffi.new("pf_cpu_timing *")
        if self._native("last_timing", t) != 0:
            raise CpuExpertError("no call has run on this CPU expert kernel yet")
        us = lambda ns: ns / 1e3  # noqa: E731
        phases = {name: {"published_us": us(t.published[p]), "first_join_us": us(t.first_join[p]),
                         "last_join_us": us(t.last_join[p]), "threads": t.joined[p], "completed_us": us(t.completed[p])}
                  for p, name in enumerate(("rows", "gate_up", "down", "read")) if t.joined[p]}
        return {"phases": phases, "end_us": us(t.end)}

    def _native(self, name: str, *args) -> int:
        """``pf_cpu_<name>(context, *args)`` as a call in progress (close() waits for it)."""
        c = self._enter()
        try:
            return getattr(self._lib, "pf_cpu_" + name)(c, *args)
        finally:
            self._leave()

    def _checked(self, name: str, *args) -> None:
        """:meth:`_native`; a non-zero status raises CpuExpertError naming the call."""
        rc = self._native(name, *args)
        if rc != 0:
            raise CpuExpertError(f"{name}: {self._strerror(rc)}")

    def _enter(self):
        with self._lock:
            if self._closed:
                raise CpuExpertError("the CPU expert kernel is closed; create a new CpuExperts")
            self._active += 1
        return self._c

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._idle.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Terminal and idempotent: waits for calls in progress, then joins the pool and frees it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._idle.wait()
            for relay in self._relays:  # an armed step names layers: ended before they close
                relay.close()
            self._relays.clear()
            for lay in self._layers:
                lay.close()
            self._layers.clear()
            self._lib.pf_cpu_destroy(self._c)
            self._c = self._ffi.NULL

    def __enter__(self) -> "CpuExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # safety net only; close() explicitly
        try:
            self.close()
        except Exception:
            pass


@dataclass
class LayerFetch:
    """How a :class:`CpuLayer` also fetches (``pf_layer_fetch`` in pf_layer.h): with M distinct
    non-resident experts routed in a run, ``plan[M]`` of them (at most ``len(stages)``; those with
    the most positions) are copied by ``scheduler`` at band 0 from ``src[e]`` (the expert's
    ``nbytes`` bytes in page-locked host memory) to a stage (``stages``: addresses of ``nbytes``
    each, device memory on the cuda backend) while the CPU computes the others; the run waits for
    them after its kernel call and writes ``stage_of`` (int32 [num_experts]: the stage holding each
    expert, -1 where it is not). Task keys are ``key_base + expert``: no other task of the
    scheduler may use them. ``plan`` (uint8 [rows * K + 1]) and ``stage_of`` are host tensors kept
    referenced by the layer; ``plan`` is read at every run. The scheduler must outlive the layer."""

    scheduler: object  # pdflash.native.Scheduler
    src: list[int]
    nbytes: int
    stages: list[int]
    key_base: int
    plan: torch.Tensor
    stage_of: torch.Tensor
    timeout_s: float = 30.0


class CpuLayer:
    """One MoE layer's routed experts, run from its routing (``pf_layer.h``): described once over
    fixed host buffers, then run on every call, from this thread (:meth:`run`) or as a CUDA host
    function (:attr:`host_fn` with :attr:`handle` as its argument, e.g. a host node of a
    captured graph), without Python.

    Buffers (host tensors, contiguous, kept referenced here): ``idx`` [rows * K] int64 / int32
    expert indices and ``scale`` [rows * K] float32 routing weights of positions p = t*K + k,
    ``x`` [rows, H] float32 / bfloat16 token rows, ``out`` float32 [rows * K, H]. A run of T
    tokens (:meth:`set_tokens`) writes out[p] = scale[p] * expert(x[p // K]) for p < T * K and
    zeroes the other rows; the grouping is the runner's (experts ascending, positions ascending,
    MAX_TOKENS per entry), so the outputs are those of :meth:`CpuExperts.call_many` bit for bit.
    ``structs``: the layer's experts' ``pf_cpu_weights`` structs, one per expert, in expert order
    (kept referenced). Closing the pool closes its layers first; a host function launched on a
    CUDA stream must have run before either is closed (synchronise first). ``resident`` (uint8
    [num_experts], read at every run): experts marked nonzero are computed elsewhere (the
    device), their positions' rows zeroed here. ``fetch`` (:class:`LayerFetch`): some of the
    other experts are fetched to the device instead of computed, their rows zeroed too."""

    def __init__(self, kernel: CpuExperts, structs: list, top_k: int, rows: int, idx: torch.Tensor,
                 scale: torch.Tensor, x: torch.Tensor, out: torch.Tensor, resident: torch.Tensor | None = None,
                 fetch: LayerFetch | None = None):
        ffi, lib = kernel._ffi, kernel._lib
        self._ffi, self._lib = ffi, lib
        E, K, R = len(structs), int(top_k), int(rows)
        if E < 1 or K < 1 or R < 1:
            raise CpuExpertError(f"a layer needs experts, top_k >= 1 and rows >= 1 (got {E}, {K}, {R})")
        H = structs[0].hidden

        def host(t, name, dtypes, shape):
            if (not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous()
                    or t.dtype not in dtypes or tuple(t.shape) != shape):
                want = " / ".join(str(d).replace("torch.", "") for d in dtypes)
                raise CpuExpertError(f"{name} must be a contiguous {want} host tensor of shape {shape}")

        host(idx, "idx", (torch.int64, torch.int32), (R * K,))
        host(scale, "scale", (torch.float32,), (R * K,))
        host(x, "x", tuple(_FORMAT), (R, H))
        host(out, "out", (torch.float32,), (R * K, H))
        if resident is not None:
            host(resident, "resident", (torch.uint8,), (E,))
        self.rows, self.top_k, self.hidden, self.num_experts = R, K, H, E
        self._keep = (kernel, list(structs), idx, scale, x, out, resident)
        self._weights = ffi.new("pf_cpu_weights *[]", list(structs))
        d = ffi.new("pf_layer_desc *")
        d.cpu = kernel._c
        d.experts = self._weights
        d.num_experts, d.top_k, d.rows, d.hidden = E, K, R, H
        d.idx_bytes = idx.element_size()
        d.idx = ffi.cast("void *", idx.data_ptr())
        d.scale = ffi.cast("float *", scale.data_ptr())
        d.x = ffi.cast("void *", x.data_ptr())
        d.x_format = _FORMAT[x.dtype]
        d.out = ffi.cast("float *", out.data_ptr())
        d.resident = ffi.NULL if resident is None else ffi.cast("uint8_t *", resident.data_ptr())
        if fetch is not None:
            host(fetch.plan, "fetch plan", (torch.uint8,), (R * K + 1,))
            host(fetch.stage_of, "fetch stage_of", (torch.int32,), (E,))
            if len(fetch.src) != E or not fetch.stages or fetch.nbytes < 1 or not fetch.timeout_s > 0:
                raise CpuExpertError(f"fetch: one source per expert ({E}), one stage or more, nbytes >= 1 and "
                                     "timeout_s > 0 are needed")
            srcs = ffi.new("void *[]", [ffi.cast("void *", a) for a in fetch.src])
            stages = ffi.new("void *[]", [ffi.cast("void *", a) for a in fetch.stages])
            f = ffi.new("pf_layer_fetch *")
            f.sched = fetch.scheduler._enter()  # only to read the handle: the scheduler must outlive the layer
            fetch.scheduler._leave()
            f.src, f.nbytes, f.stage, f.stages = srcs, int(fetch.nbytes), stages, len(fetch.stages)
            f.key_base = int(fetch.key_base)
            f.plan = ffi.cast("uint8_t *", fetch.plan.data_ptr())
            f.stage_of = ffi.cast("int32_t *", fetch.stage_of.data_ptr())
            f.timeout_s = float(fetch.timeout_s)
            d.fetch = f
            self._keep = self._keep + (fetch, srcs, stages, f)
        p = ffi.new("pf_layer **")
        rc = lib.pf_layer_create(d, p)
        if rc != 0:
            raise CpuExpertError(f"CPU layer: {kernel._strerror(rc)} (every expert must have hidden size {H})")
        self._L = p[0]
        self._runs = 0  # runs seen by check()
        self._result = (ffi.new("int *"), ffi.new("int *"), ffi.new("uint64_t *"), ffi.new("uint64_t *"))
        self._fetch_result = (ffi.new("int *"), ffi.new("int *"), ffi.new("uint64_t *"), ffi.new("int *"))
        self._clock = (ffi.new("uint64_t *"), ffi.new("uint64_t *"))
        self._ahead_result = (ffi.new("int *"), ffi.new("int *"), ffi.new("int *"))
        self._ahead = None

    @property
    def handle(self) -> int:
        """The context's address (the host function's argument)."""
        self._live()
        return int(self._ffi.cast("uintptr_t", self._L))

    @property
    def host_fn(self) -> int:
        """Address of ``pf_layer_host_fn`` (a CUDA host function: ``void fn(void *)``)."""
        return int(self._ffi.cast("uintptr_t", self._ffi.addressof(self._lib, "pf_layer_host_fn")))

    def set_tokens(self, tokens: int) -> None:
        self._live()
        if self._lib.pf_layer_set_tokens(self._L, int(tokens)) != 0:
            raise CpuExpertError(f"tokens must be in 1 .. {self.rows}, got {tokens}")

    def set_prewake(self, us: int) -> None:
        """After each run, wake the pool for the next call for ``us`` microseconds (0: not)."""
        self._live()
        if self._lib.pf_layer_set_prewake(self._L, int(us)) != 0:
            raise CpuExpertError(f"prewake: us must be in 0 .. 100000, got {us}")

    def run(self, check: bool = True) -> None:
        """Run now on this thread (the GIL released); raises if the run failed (with ``check``;
        otherwise a later :meth:`check` counts it)."""
        self._live()
        self._lib.pf_layer_run(self._L)
        if check:
            self.check()

    def result(self) -> tuple[int, int, float, int]:
        """(status, distinct experts, seconds, runs) of the last run."""
        self._live()
        st, ex, ns, runs = self._result  # made once: a host step reads every layer's after each step
        self._lib.pf_layer_result(self._L, st, ex, ns, runs)
        return int(st[0]), int(ex[0]), ns[0] / 1e9, int(runs[0])

    def fetch_result(self) -> tuple[int, int, float, bool]:
        """(experts fetched, failed fetches computed instead, seconds waited for fetches after the
        kernel call, fetching off for good) of the last run; zeros without fetching."""
        self._live()
        fe, fb, ns, off = self._fetch_result
        self._lib.pf_layer_fetch_result(self._L, fe, fb, ns, off)
        return int(fe[0]), int(fb[0]), ns[0] / 1e9, bool(off[0])

    def set_ahead(self, next_layer: "CpuLayer | None", predicted: torch.Tensor | None = None, most: int = 0) -> None:
        """Route-ahead (``pf_layer_set_ahead``): each run also prefetches, at band 1 into
        ``next_layer``'s stages, up to ``most`` of the experts ``predicted`` for it (int64 host
        tensor [rows * K], read at every run); ``next_layer`` (which fetches) claims those it needs
        at its next run and cancels the rest. ``None``: nothing prefetched. Only while neither runs."""
        self._live()
        if next_layer is None:
            self._lib.pf_layer_set_ahead(self._L, self._ffi.NULL, self._ffi.NULL, 0)
            self._ahead = None
            return
        next_layer._live()
        if (not isinstance(predicted, torch.Tensor) or predicted.device.type != "cpu" or predicted.dtype != torch.int64
                or not predicted.is_contiguous() or predicted.numel() != self.rows * self.top_k):
            raise CpuExpertError(f"predicted must be a contiguous int64 host tensor of {self.rows * self.top_k} experts")
        rc = self._lib.pf_layer_set_ahead(self._L, next_layer._L, self._ffi.cast("int64_t *", predicted.data_ptr()),
                                          int(most))
        if rc != 0:
            raise CpuExpertError("route-ahead: the next layer must fetch, have this layer's experts, top_k and rows, "
                                 f"and most must be in 0 .. its stages (got {most})")
        self._ahead = (next_layer, predicted)  # kept referenced while this layer may read them

    def ahead_result(self) -> tuple[int, int, int]:
        """(prefetches submitted for the next layer, prefetches into this layer claimed, cancelled)
        of the last run."""
        self._live()
        sent, used, unused = self._ahead_result
        self._lib.pf_layer_ahead_result(self._L, sent, used, unused)
        return int(sent[0]), int(used[0]), int(unused[0])

    def clock(self) -> tuple[int, int]:
        """(start, kernel) of the last run in nanoseconds: when it started, on the clock of
        ``time.monotonic_ns``, and how long its kernel calls took; zeros before any run."""
        self._live()
        begin, kernel = self._clock
        self._lib.pf_layer_clock(self._L, begin, kernel)
        return int(begin[0]), int(kernel[0])

    def check(self, runs: int = 1) -> tuple[int, float]:
        """After ``runs`` runs were launched since the last check (and have finished): raise if
        one did not happen or the last failed; returns (distinct experts, seconds) of the last."""
        st, ex, sec, total = self.result()
        self._checked(st, total, runs)
        return ex, sec

    def _checked(self, status: int, total: int, runs: int) -> None:
        """Raise unless ``runs`` runs happened since the last check and the last succeeded."""
        if total != self._runs + runs:
            raise CpuExpertError(f"CPU layer: {total - self._runs} runs happened where {runs} were launched")
        self._runs = total
        if status != 0:
            raise CpuExpertError(f"CPU layer run: {self._ffi.string(self._lib.pf_cpu_strerror(status)).decode()}"
                                 + (" (an expert index out of range)" if status == self._lib.PF_CPU_EINVAL else ""))

    def _live(self) -> None:
        if self._L is None:
            raise CpuExpertError("the CPU layer is closed")

    def close(self) -> None:
        """Idempotent; no run may be in progress or pending."""
        if getattr(self, "_L", None) is not None:
            self._lib.pf_layer_destroy(self._L)  # resolves prefetches still made into its stages
            self._L = None
            self._keep = None


class RelayError(CpuExpertError):
    """A relayed step did not end as it should (a flag that never came, a cancelled step)."""


class LayerReport:
    """Every figure of a fixed list of :class:`CpuLayer` after their runs, in one native call
    (``pf_layer_report``): a host step reads each of its layers' after the step.

    :meth:`check` is :meth:`CpuLayer.check` for every layer at once (``runs[i]`` runs launched
    on layer i since the last check; raises as it does), and returns, per layer, its last run's
    (seconds, begin ns, kernel ns, fetch wait seconds, route-ahead sent, used, unused): the
    figures of :meth:`CpuLayer.result`, ``clock``, ``fetch_result`` and ``ahead_result``. The
    layers stay referenced; close them only after their report's last use."""

    def __init__(self, layers: list[CpuLayer]):
        if not layers:
            raise CpuExpertError("a layer report names at least one layer")
        first = layers[0]
        self._ffi, self._lib = first._ffi, first._lib
        for lay in layers:
            lay._live()
        self._layers = list(layers)
        self._ctx = self._ffi.new("pf_layer *[]", [lay._L for lay in layers])
        self._n = len(layers)
        # a row: status, experts, ns, runs, begin, kernel, wait ns, sent, used, unused (pf_layer.h)
        self._fields = int(self._lib.PF_LAYER_REPORT)
        self._out = self._ffi.new("int64_t[]", self._n * self._fields)

    def check(self, runs: list[int]) -> list[tuple[float, int, int, float, int, int, int]]:
        """Raise if a layer's launched runs did not all happen or its last one failed (as
        :meth:`CpuLayer.check`); else every layer's figures (see the class docstring)."""
        for lay in self._layers:
            lay._live()
        if self._lib.pf_layer_report(self._ctx, self._n, self._out) != 0:
            raise CpuExpertError("layer report: a layer is closed")
        F = self._fields
        vals = self._ffi.unpack(self._out, self._n * F)
        out = []
        for i, lay in enumerate(self._layers):
            st, _, ns, total, begin, kernel, wait, sent, used, unused = vals[i * F: (i + 1) * F]
            lay._checked(st, total, runs[i])
            out.append((ns / 1e9, begin, kernel, wait / 1e9, sent, used, unused))
        return out


class Relay:
    """A graph's layers handed to the CPU through flags (``pf_relay.h``): instead of a host node,
    a layer's graph writes its down flag (``flags[i]``, a stream memory operation) and waits for
    its up flag (``flags[layers + i]``); the relay's thread, armed with the step's layers, runs
    each one when its down flag comes and sets its up flag.

    ``flags``: an int32 host tensor of 2 * layers elements, page-locked and mapped for the
    device (kept referenced). One step at a time: :meth:`arm` before launching the work,
    :meth:`wait` after it has finished. :meth:`close` cancels an armed step first."""

    def __init__(self, kernel: "CpuExperts", flags: torch.Tensor, spin_us: int = 2000):
        ffi, lib = kernel._ffi, kernel._lib
        self._ffi, self._lib = ffi, lib
        if (not isinstance(flags, torch.Tensor) or flags.device.type != "cpu" or flags.dtype != torch.int32
                or not flags.is_contiguous() or flags.numel() < 2 or flags.numel() % 2):
            raise CpuExpertError("relay flags must be a contiguous int32 host tensor of 2 * layers elements")
        self.layers = flags.numel() // 2
        p = ffi.new("pf_relay **")
        rc = lib.pf_relay_create(ffi.cast("uint32_t *", flags.data_ptr()), self.layers, int(spin_us), p)
        if rc != 0:
            raise CpuExpertError(f"relay: {kernel._strerror(rc)} (spin_us must be in 0 .. 1000000)")
        self._r = p[0]
        self._keep = (kernel, flags)
        self._armed: list | None = None  # the armed step's layers, referenced until it is collected
        self._out = (ffi.new("int *"), ffi.new("int *"))

    def arm(self, layers: list, timeout_s: float = 10.0) -> None:
        """Hand the thread one step of ``layers`` (:class:`CpuLayer`, layer i's flags are i's),
        zeroing every flag; then launch the work that writes the down flags."""
        self._live()
        if not 1 <= len(layers) <= self.layers:
            raise CpuExpertError(f"a relayed step names 1 .. {self.layers} layers, got {len(layers)}")
        ctx = self._ffi.new("pf_layer *[]", [lay._L for lay in layers])
        rc = self._lib.pf_relay_arm(self._r, ctx, len(layers), float(timeout_s))
        if rc == self._lib.PF_RELAY_EBUSY:
            raise CpuExpertError("a relayed step is already armed: wait for it first")
        if rc != 0:
            raise CpuExpertError("relay arm: every layer must be open and timeout_s > 0")
        self._armed = list(layers)

    def cancel(self) -> None:
        """End the armed step early (its remaining up flags are set); a no-op without one."""
        if self._r is not None:
            self._lib.pf_relay_cancel(self._r)

    def wait(self, timeout_s: float = 10.0) -> int:
        """Collect the armed step once it has ended; returns the layers it ran. Raises
        :class:`RelayError` if a down flag never came or the step was cancelled, and if it is
        still running after ``timeout_s`` (then still armed)."""
        self._live()
        st, answered = self._out
        rc = self._lib.pf_relay_wait(self._r, float(timeout_s), st, answered)
        if rc == self._lib.PF_RELAY_ETIMEDOUT:
            raise RelayError(f"the relayed step was still running after {timeout_s} s")
        if rc != 0:
            raise CpuExpertError("no relayed step is armed")
        n, self._armed = len(self._armed or ()), None
        if st[0] == self._lib.PF_RELAY_ETIMEDOUT:
            raise RelayError(f"layer {answered[0]} of a relayed step never signalled (ran {answered[0]} of {n})")
        if st[0] == self._lib.PF_RELAY_ECANCELED:
            raise RelayError(f"the relayed step was cancelled after {answered[0]} of {n} layers")
        return int(answered[0])

    def _live(self) -> None:
        if self._r is None:
            raise CpuExpertError("the relay is closed")

    def close(self) -> None:
        """Cancel an armed step, stop the thread. Idempotent."""
        if getattr(self, "_r", None) is not None:
            self._lib.pf_relay_destroy(self._r)
            self._r = None
            self._armed = None
            self._keep = None


__all__ = ["CpuExperts", "CpuExpertError", "CpuLayer", "LayerFetch", "LayerReport", "CpuLevelUnsupported", "ExpertWeights", "LEVELS", "MAX_TOKENS",
           "Relay", "RelayError",
           "default_threads", "detect_level", "supported_levels"]
