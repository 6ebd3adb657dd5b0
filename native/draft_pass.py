"""The native draft pass (``pf_draft.c``): a small DFlash draft's forward and greedy head on the
CPU in float32, one C call per step instead of a few hundred PyTorch operators.

    kernel = DraftPass(shape, fc, hidden_norm, norm, layers)     # borrowed CPU tensors
    kernel.run(keys, values, length, features, x, cos, sin)      # x [b, H] becomes the hidden rows
    ids = kernel.argmax(hidden, head_weight)                     # greedy proposals [r]

Caller contract: the tensors given to the constructor stay alive and unchanged while the
``DraftPass`` is used (it keeps references, never copies); ``run`` writes x and the caches'
positions length .. length+n+b-1 and nothing else. The C call releases the GIL.
:class:`pdflash.draft.model.DFlashDraftModel` builds one from its own weights (``use_native``)
and checks before each pass that they are still the ones it was built from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdflash import PdflashError
from pdflash.native import NativeLibraryMissing
from pdflash.native import _load as load_library  # the library, or NativeLibraryMissing saying how to build it
from pdflash.native.cpu_experts import LEVELS, CpuLevelUnsupported


class DraftPassError(PdflashError):
    """A native draft call was refused (bad shapes or tensors)."""


def _load():
    ffi, lib = load_library()
    if not hasattr(lib, "pf_draft_pass"):
        raise NativeLibraryMissing("the native library predates the draft pass; run 'pdflash build-native'")
    return ffi, lib


@dataclass(frozen=True)
class DraftShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    features: int
    eps: float


# Per layer, in this order; a None bias means the layer has none.
LAYER_TENSORS = ("input_norm", "post_norm", "w_qkv", "b_qkv", "q_norm", "k_norm", "w_o", "b_o", "w_gate_up", "w_down")
MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down")  # float32, or all bf16 (fc with them)
MAX_HEAD_DIM = 1024  # pf_draft.c's limit


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise DraftPassError(f"{name} must be a contiguous {dtype} CPU tensor of shape {shape}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


class DraftPass:
    """The kernel over one draft's weights (see the module docstring); ``level`` forces a CPU
    level ("scalar", "avx2"; default: the best this CPU runs)."""

    def __init__(self, shape: DraftShape, fc: torch.Tensor, hidden_norm: torch.Tensor, norm: torch.Tensor,
                 layers: list[dict[str, torch.Tensor | None]], windows: list[int], level: str | None = None):
        self.ffi, self.lib = _load()
        if level is not None and level not in LEVELS:
            raise DraftPassError(f"unknown CPU level {level!r}; one of {', '.join(LEVELS)}")
        s = shape
        if min(s.hidden, s.heads, s.kv_heads, s.head_dim, s.inter, s.features) < 1 or s.heads % s.kv_heads \
                or s.head_dim % 2 or s.head_dim > MAX_HEAD_DIM or not s.eps >= 0:
            raise DraftPassError(f"the native draft pass does not take this shape: {s}")
        self.shape = s
        self.matrices_dtype = fc.dtype
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        shapes = {"input_norm": (s.hidden,), "post_norm": (s.hidden,), "w_qkv": (qkv, s.hidden), "b_qkv": (qkv,),
                  "q_norm": (s.head_dim,), "k_norm": (s.head_dim,), "w_o": (s.hidden, s.heads * s.head_dim),
                  "b_o": (s.hidden,), "w_gate_up": (2 * s.inter, s.hidden), "w_down": (s.hidden, s.inter)}
        mdtype = fc.dtype  # the matrices' dtype: float32, or bf16 (read as is, widened exactly)
        if mdtype not in (torch.float32, torch.bfloat16):
            raise DraftPassError(f"the draft's matrices must be float32 or bf16, got {mdtype}")
        _check("fc", fc, (s.hidden, s.features), mdtype)
        _check("hidden_norm", hidden_norm, (s.hidden,))
        _check("norm", norm, (s.hidden,))
        if len(windows) != len(layers) or not layers:
            raise DraftPassError(f"{len(layers)} layers but {len(windows)} window sizes")
        self._keep: list[torch.Tensor] = [fc, hidden_norm, norm]
        self._layers = self.ffi.new("pf_draft_layer[]", len(layers))
        for i, (tensors, window) in enumerate(zip(layers, windows)):
            c = self._layers[i]
            for name in LAYER_TENSORS:
                t = tensors.get(name)
                if t is None:
                    if not name.startswith("b_"):
                        raise DraftPassError(f"layer {i}: {name} is missing")
                    setattr(c, name, self.ffi.NULL)
                    continue
                _check(f"layer {i} {name}", t, shapes[name], mdtype if name in MATRICES else torch.float32)
                self._keep.append(t)
                setattr(c, name, self.ffi.cast("void *" if name in MATRICES else "float *", t.data_ptr()))
            c.window = int(window)
        m = self.ffi.new("pf_draft_model *")
        m.hidden, m.heads, m.kv_heads, m.head_dim = s.hidden, s.heads, s.kv_heads, s.head_dim
        m.inter, m.layers, m.features, m.eps = s.inter, len(layers), s.features, s.eps
        m.matrices_bf16 = int(mdtype == torch.bfloat16)
        m.fc = self.ffi.cast("void *", fc.data_ptr())
        m.hidden_norm = self.ffi.cast("float *", hidden_norm.data_ptr())
        m.norm = self.ffi.cast("float *", norm.data_ptr())
        m.layer = self._layers
        self._model = m
        self.level = -1 if level is None else LEVELS.index(level)

    def _raise(self, rc: int, what: str) -> None:
        msg = self.ffi.string(self.lib.pf_cpu_strerror(rc)).decode()
        if rc == self.lib.PF_CPU_EUNSUPPORTED:
            raise CpuLevelUnsupported(f"{what}: {msg}")
        raise DraftPassError(f"{what}: {msg}")

    def run(self, keys: torch.Tensor, values: torch.Tensor, length: int, features: torch.Tensor | None,
            x: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """One pass: keys / values [L, 1, Hkv, capacity, D] (the draft's caches), features [n, F] of
        the new context (or None), x [b, H] the embedded block (or None; overwritten with the final
        hidden rows), cos / sin [P, D] rotary tables by position."""
        s, ffi = self.shape, self.ffi
        layers = len(self._layers)
        if keys.shape != values.shape or keys.dim() != 5 or tuple(keys.shape[:3]) != (layers, 1, s.kv_heads) \
                or keys.shape[4] != s.head_dim:
            raise DraftPassError(f"caches of shape {tuple(keys.shape)} / {tuple(values.shape)} do not fit the draft")
        for name, t in (("keys", keys), ("values", values), ("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise DraftPassError(f"{name} must be a contiguous float32 CPU tensor")
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != s.head_dim:
            raise DraftPassError(f"rotary tables of shape {tuple(cos.shape)} / {tuple(sin.shape)} do not fit the draft")
        n = b = 0
        fptr = xptr = ffi.NULL
        if features is not None and features.shape[0]:
            _check("features", features, (features.shape[0], s.features))
            n, fptr = features.shape[0], ffi.cast("float *", features.data_ptr())
        if x is not None and x.shape[0]:
            _check("x", x, (x.shape[0], s.hidden))
            b, xptr = x.shape[0], ffi.cast("float *", x.data_ptr())
        rc = self.lib.pf_draft_pass(self._model, ffi.cast("float *", keys.data_ptr()),
                                    ffi.cast("float *", values.data_ptr()), keys.shape[3], length, fptr, n, xptr, b,
                                    ffi.cast("float *", cos.data_ptr()), ffi.cast("float *", sin.data_ptr()),
                                    cos.shape[0], self.level)
        if rc:
            self._raise(rc, f"draft pass (length {length}, {n} context rows, block of {b})")

    def argmax(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Greedy tokens [r] of hidden rows [r, H] (float32) through a head weight [V, H] (float32,
        or bf16: rounded as a bf16 head computes)."""
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu" \
                or not weight.is_contiguous() or weight.dim() != 2:
            raise DraftPassError(f"head weight must be a contiguous float32 or bf16 CPU matrix, got {weight.dtype} "
                                 f"{tuple(weight.shape)}")
        _check("hidden", hidden, (hidden.shape[0], weight.shape[1]))
        out = torch.empty(hidden.shape[0], dtype=torch.long)
        if not hidden.shape[0]:
            return out
        ffi = self.ffi
        rc = self.lib.pf_draft_argmax(ffi.cast("float *", hidden.data_ptr()), hidden.shape[0], hidden.shape[1],
                                      ffi.cast("void *", weight.data_ptr()), int(weight.dtype == torch.bfloat16),
                                      weight.shape[0], ffi.cast("int64_t *", out.data_ptr()), self.level)
        if rc:
            self._raise(rc, "draft head")
        return out
