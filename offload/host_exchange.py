"""HostExchange: what one layer's CPU experts send between a CUDA device and the host.

Down: the layer's routing (expert indices, routing weights) and its token rows, packed bit for
bit as int16 words into one device buffer by one kernel and copied into pinned host memory by
one synchronous copy (one device->host synchronisation per layer instead of three).
Up: the CPU experts' weighted outputs, written by the native kernel into a pinned float32
buffer and copied to a device buffer by one asynchronous copy.

Ownership and reuse: the exchange owns its four buffers (grown, never shrunk) and is shared by
every layer of one runtime, used by one thread. What :meth:`routing` and :meth:`result_buffer`
return are views of them, valid until the next layer's :meth:`routing`. Reuse is safe because
that call synchronises the stream: every copy and kernel queued before it, the previous
layer's upload and the kernels reading the uploaded rows included, has then completed.

Graphed decoding (offload/graphs.py) packs the routing inside each layer's captured segment
instead: a :class:`RoutingPack` owns fixed device and pinned host buffers for one captured
layer, its ``fill`` (the packing kernel and an asynchronous copy to the host) is part of the
graph, and the decoder hands it to the exchange (``prepacked``) before it calls the layer's
experts, whose :meth:`HostExchange.routing` then only waits for the stream and returns views of
the host buffer: no launch, no copy issued from the host.
"""

from __future__ import annotations

import torch


def _words(idx: torch.Tensor, w_flat: torch.Tensor, x: torch.Tensor) -> tuple[tuple, int, int, int, torch.dtype]:
    """The routing as int16 word views (idx, w_flat, x), the offsets (a, b, n) where w_flat's
    words start, x's words start and the pack ends, and the dtype w_flat is packed in."""
    w_flat = w_flat.reshape(-1)
    a = idx.numel() * idx.element_size() // 2
    x_words = x.element_size() // 2
    if (a + w_flat.numel() * w_flat.element_size() // 2) % max(1, x_words):
        w_flat = w_flat.float()  # x's words must start at a multiple of its element size
    parts = (idx.contiguous().view(-1).view(torch.int16), w_flat.contiguous().view(torch.int16),
             x.contiguous().view(-1).view(torch.int16))
    b = a + parts[1].numel()
    return parts, a, b, b + parts[2].numel(), w_flat.dtype


def _unpack(host: torch.Tensor, a: int, b: int, idx_dtype, idx_shape, w_dtype, x_dtype, x_shape):
    w_host = host[a:b].view(w_dtype)
    return (host[:a].view(idx_dtype).view(idx_shape), w_host if w_host.dtype == torch.float32 else w_host.float(),
            host[b:].view(x_dtype).view(x_shape))


class RoutingPack:
    """One captured layer's routing, packed by its graph segment (see the module docstring). The
    pack owns its two buffers, sized for the tensors it was made for; ``fill`` may be captured
    (it allocates nothing), ``views`` is valid once the stream has passed the fill."""

    def __init__(self, idx: torch.Tensor, w_flat: torch.Tensor, x: torch.Tensor, pin: bool = True):
        _, self.a, self.b, n, self.w_dtype = _words(idx, w_flat, x)
        self.dev = torch.empty(n, dtype=torch.int16, device=x.device)
        self.host = torch.empty(n, dtype=torch.int16, pin_memory=pin)
        self.idx_dtype, self.idx_shape = idx.dtype, tuple(idx.shape)
        self.x_dtype, self.x_shape = x.dtype, tuple(x.shape)

    def fill(self, idx: torch.Tensor, w_flat: torch.Tensor, x: torch.Tensor) -> None:
        """Pack on the device and copy to the host, both queued on the current stream."""
        torch.cat(_words(idx, w_flat, x)[0], out=self.dev)
        self.host.copy_(self.dev, non_blocking=True)

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _unpack(self.host, self.a, self.b, self.idx_dtype, self.idx_shape, self.w_dtype,
                       self.x_dtype, self.x_shape)


class HostExchange:
    def __init__(self, device: torch.device, pin: bool | None = None):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin  # host buffers pinned (a CUDA device)
        self._down_dev: torch.Tensor | None = None  # int16 words
        self._down_host: torch.Tensor | None = None  # int16 words, pinned
        self._up_host: torch.Tensor | None = None  # float32, pinned
        self._up_dev: torch.Tensor | None = None  # float32
        self.prepacked: RoutingPack | None = None  # the next routing() call's, filled by a graph segment

    def routing(self, idx: torch.Tensor, w_flat: torch.Tensor, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """idx [T, K] (any integer dtype), w_flat [T*K] and x [T, H] on the device -> the same
        on the host: idx in its dtype, w_flat as float32, x in its dtype. Returns after the
        device has finished everything queued before (the copy, or with a pack the wait,
        synchronises)."""
        pack, self.prepacked = self.prepacked, None
        if pack is not None and pack.idx_shape == tuple(idx.shape) and pack.x_shape == tuple(x.shape):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the segment's pack and copy included
            return pack.views()
        parts, a, b, n, w_dtype = _words(idx, w_flat, x)
        if self._down_dev is None or self._down_dev.numel() < n:
            cap = max(n, 2 * (0 if self._down_dev is None else self._down_dev.numel()))
            self._down_dev = torch.empty(cap, dtype=torch.int16, device=self.device)
            self._down_host = torch.empty(cap, dtype=torch.int16, pin_memory=self.pin)
        torch.cat(parts, out=self._down_dev[:n])
        host = self._down_host[:n]
        host.copy_(self._down_dev[:n])  # synchronous: waits for the layer's routing and rows
        return _unpack(host, a, b, idx.dtype, tuple(idx.shape), w_dtype, x.dtype, tuple(x.shape))

    def result_buffer(self, rows: int, hidden: int, zero: bool) -> torch.Tensor:
        """A pinned float32 [rows, hidden] buffer for the kernel's outputs; zeroed when the
        kernel writes only some of its rows (the device adds it to its own partial rows)."""
        n = rows * hidden
        if self._up_host is None or self._up_host.numel() < n:
            cap = max(n, 2 * (0 if self._up_host is None else self._up_host.numel()))
            self._up_host = torch.empty(cap, dtype=torch.float32, pin_memory=self.pin)
            self._up_dev = torch.empty(cap, dtype=torch.float32, device=self.device)
        buf = self._up_host[:n].view(rows, hidden)
        if zero:
            buf.zero_()
        return buf

    def upload(self, buf: torch.Tensor) -> torch.Tensor:
        """The buffer of :meth:`result_buffer` on the device (an asynchronous copy, queued)."""
        dev = self._up_dev[: buf.numel()].view(buf.shape)
        dev.copy_(buf, non_blocking=True)
        return dev
