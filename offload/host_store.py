"""Host store: every (layer, expert) packed contiguously, in its stored format.

One uint8 tensor ``buf`` [L * E, expert_bytes] holds all experts (row = layer * E +
expert). A row is the concatenation of the expert's pieces (for gpt-oss MXFP4:
gate_up blocks, scales, bias, down blocks, scales, bias; for Qwen3-MoE: gate_up, down, and
their FP8 scale grids), each starting at a
16-byte aligned offset so ``row[off:off + nbytes].view(dtype).view(shape)``
reinterprets it without a copy. The same layout is used by the device cache slots,
so one expert crosses the link as one contiguous copy.

When the compute device is CUDA the buffer is page-locked so the scheduler's
cudaMemcpyAsync runs at full link speed. It is allocated at its exact size and
registered with cudaHostRegister: PyTorch's pinned allocator (``pin_memory=True``)
rounds every allocation up to a power of two, which would page-lock 16 GiB for the
10.2 GB of gpt-oss-20b's experts. If registration is unavailable it falls back to
the pinned allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdflash import PdflashError

PIECE_ALIGN = 16  # bytes: every piece offset, so views of any dtype up to 16 bytes are aligned
ROW_ALIGN = 256  # bytes: row stride, so every slot starts on a 256-byte boundary


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Piece:
    """One tensor of one expert inside a packed row."""

    name: str  # e.g. "gate_up_proj_blocks"
    shape: tuple[int, ...]  # per expert, e.g. (2I, H/32, 16)
    dtype: torch.dtype
    offset: int  # bytes from the start of the row, multiple of PIECE_ALIGN

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ExpertLayout:
    """Byte layout of one packed expert; shared by the host store and the device slots."""

    pieces: tuple[Piece, ...]
    expert_bytes: int  # row stride (>= sum of pieces, multiple of ROW_ALIGN)
    quantized: bool  # True: MXFP4 blocks / scales; False: dense weights

    @classmethod
    def build(cls, spec: list[tuple[str, tuple[int, ...], torch.dtype]], quantized: bool) -> "ExpertLayout":
        pieces, off = [], 0
        for name, shape, dtype in spec:
            p = Piece(name, tuple(int(d) for d in shape), dtype, off)
            pieces.append(p)
            off = _align(off + p.nbytes, PIECE_ALIGN)
        return cls(tuple(pieces), _align(off, ROW_ALIGN), quantized)

    @property
    def payload_bytes(self) -> int:
        """Bytes that carry data (what one expert costs on the link is expert_bytes)."""
        return sum(p.nbytes for p in self.pieces)

    def piece(self, name: str) -> Piece:
        for p in self.pieces:
            if p.name == name:
                return p
        raise KeyError(name)

    def view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """rows [..., expert_bytes] uint8 (last dim contiguous) -> piece [..., *shape] in its dtype, no copy."""
        p = self.piece(name)
        raw = rows[..., p.offset : p.offset + p.nbytes]
        return raw.view(p.dtype).view(*rows.shape[:-1], *p.shape)


class HostStore:
    """All experts of all layers in one (pinned) host tensor; see the module docstring."""

    def __init__(self, layout: ExpertLayout, num_layers: int, num_experts: int, pin: bool):
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.pinned = pin
        self._registered = False
        rows = num_layers * num_experts
        try:
            self.buf = torch.empty((rows, layout.expert_bytes), dtype=torch.uint8)
            if pin:
                self._registered = host_register(self.buf)
                if not self._registered:
                    self.buf = torch.empty((rows, layout.expert_bytes), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            gib = rows * layout.expert_bytes / 2**30
            raise PdflashError(f"could not allocate {gib:.2f} GiB of {'pinned ' if pin else ''}host memory for the experts: {exc}") from None
        if layout.expert_bytes > layout.payload_bytes:  # padding bytes are copied too: keep them defined
            self._zero_padding()

    def _zero_padding(self) -> None:
        end = 0
        for p in self.layout.pieces:
            if p.offset > end:
                self.buf[:, end : p.offset].zero_()
            end = p.offset + p.nbytes
        if end < self.layout.expert_bytes:
            self.buf[:, end:].zero_()

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def row(self, layer: int, expert: int) -> torch.Tensor:
        return self.buf[self.row_index(layer, expert)]

    def fill_layer(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy one layer's stacked tensors {piece name: [E, *shape]} into the layer's rows."""
        lo = layer * self.num_experts
        rows = self.buf[lo : lo + self.num_experts]
        for p in self.layout.pieces:
            if p.name not in tensors:
                continue  # filled expert by expert (fill_piece)
            t = tensors[p.name]
            if tuple(t.shape) != (self.num_experts, *p.shape) or t.dtype != p.dtype:
                raise PdflashError(
                    f"layer {layer} {p.name}: expected {p.dtype} {(self.num_experts, *p.shape)}, got {t.dtype} {tuple(t.shape)}"
                )
            rows[:, p.offset : p.offset + p.nbytes].copy_(t.contiguous().view(torch.uint8).view(self.num_experts, p.nbytes))

    def fill_piece(self, layer: int, expert: int, name: str, t: torch.Tensor) -> None:
        """Copy one piece of one expert (a checkpoint that stores experts separately)."""
        p = self.layout.piece(name)
        if tuple(t.shape) != p.shape or t.dtype != p.dtype:
            raise PdflashError(f"layer {layer} expert {expert} {p.name}: expected {p.dtype} {p.shape}, got {t.dtype} {tuple(t.shape)}")
        self.row(layer, expert)[p.offset : p.offset + p.nbytes].copy_(t.contiguous().view(torch.uint8).view(-1))

    def expert_tensor(self, layer: int, expert: int, name: str) -> torch.Tensor:
        """One piece of one expert as a view of the host row (for checks and references)."""
        return self.layout.view(self.row(layer, expert), name)

    def close(self) -> None:
        """Release the buffer. Only when no copy from it is in flight (close the scheduler first)."""
        if self._registered:
            host_unregister(self.buf)
            self._registered = False
        self.buf = torch.empty(0, dtype=torch.uint8)


def host_unregister(buf: torch.Tensor) -> None:
    """Undo :func:`host_register` (no copy may be in flight from or to ``buf``)."""
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def host_register(buf: torch.Tensor, mapped: bool = False) -> bool:
    """Page-lock ``buf`` in place (cudaHostRegister, portable; also mapped into the device's
    address space where ``mapped``); False if that is not possible."""
    try:
        cudart = torch.cuda.cudart()
        rc = int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 3 if mapped else 1))
    except (AttributeError, RuntimeError):
        return False
    return rc == 0
