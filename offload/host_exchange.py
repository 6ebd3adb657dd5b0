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
"""

from __future__ import annotations

import torch


class HostExchange:
    def __init__(self, device: torch.device, pin: bool | None = None):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin  # host buffers pinned (a CUDA device)
        self._down_dev: torch.Tensor | None = None  # int16 words
        self._down_host: torch.Tensor | None = None  # int16 words, pinned
        self._up_host: torch.Tensor | None = None  # float32, pinned
        self._up_dev: torch.Tensor | None = None  # float32

    def routing(self, idx: torch.Tensor, w_flat: torch.Tensor, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """idx [T, K] (any integer dtype), w_flat [T*K] and x [T, H] on the device -> the same
        on the host: idx in its dtype, w_flat as float32, x in its dtype. Returns after the
        device has finished everything queued before (the copy synchronises)."""
        T, K = idx.shape
        w_flat = w_flat.reshape(-1)
        a = idx.numel() * idx.element_size() // 2
        x_words = x.element_size() // 2
        if (a + w_flat.numel() * w_flat.element_size() // 2) % max(1, x_words):
            w_flat = w_flat.float()  # x's words must start at a multiple of its element size
        parts = (idx.contiguous().view(-1).view(torch.int16), w_flat.contiguous().view(torch.int16),
                 x.contiguous().view(-1).view(torch.int16))
        b = a + parts[1].numel()
        n = b + parts[2].numel()
        if self._down_dev is None or self._down_dev.numel() < n:
            cap = max(n, 2 * (0 if self._down_dev is None else self._down_dev.numel()))
            self._down_dev = torch.empty(cap, dtype=torch.int16, device=self.device)
            self._down_host = torch.empty(cap, dtype=torch.int16, pin_memory=self.pin)
        torch.cat(parts, out=self._down_dev[:n])
        host = self._down_host[:n]
        host.copy_(self._down_dev[:n])  # synchronous: waits for the layer's routing and rows
        w_host = host[a:b].view(w_flat.dtype)
        return (host[:a].view(idx.dtype).view(T, K), w_host if w_host.dtype == torch.float32 else w_host.float(),
                host[b:n].view(x.dtype).view(x.shape))

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
