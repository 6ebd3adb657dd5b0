"""Forward hooks on a MoE target: context features for the draft, chosen experts per layer.

The target is a transformers MoE causal LM of a supported family (``target.model.layers[i]``
decoder layers; the family adapter, ``family_of(target)``, names each layer's router); the
offloaded runtime's model is the same module with its experts swapped, so the hooks work on both. Hooks only record while a ``capture()`` block is open.

Feature index convention: the draft's feature for target layer ``i`` is the *output* of decoder
layer ``i``, which is ``hidden_states[i + 1]`` of transformers' ``output_hidden_states=True``
(index 0 is the embedding output). For the last layer transformers substitutes the final-normed
state at that index; the hook always takes the raw layer output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from pdflash import PdflashError


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    try:
        return target.model.layers
    except AttributeError:
        raise PdflashError("the target has no .model.layers decoder stack; pass a transformers MoE causal LM (gpt-oss, Qwen3-MoE)") from None


def _first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class FeatureTap:
    """Records the outputs of decoder layers ``layer_ids`` ([1, T, H] each) during ``capture()``.

    ``take()`` returns them concatenated in ``layer_ids`` order: [1, T, K*H].
    """

    def __init__(self, target: nn.Module, layer_ids: Sequence[int]):
        layers = decoder_layers(target)
        if any(not 0 <= i < len(layers) for i in layer_ids):
            raise PdflashError(f"target layer ids {list(layer_ids)} out of range for a {len(layers)}-layer target")
        self._outputs: list[torch.Tensor | None] = [None] * len(layer_ids)
        self._active = False
        self._handles = [layers[i].register_forward_hook(self._hook(j)) for j, i in enumerate(layer_ids)]

    def _hook(self, slot: int):
        def hook(module, args, output):
            if self._active:
                self._outputs[slot] = _first_tensor(output)

        return hook

    @contextmanager
    def capture(self) -> Iterator[None]:
        self._outputs = [None] * len(self._outputs)
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def take(self) -> torch.Tensor:
        if any(o is None for o in self._outputs):
            raise RuntimeError("a target layer produced no output during capture")
        out = torch.cat(self._outputs, dim=-1)  # type: ignore[arg-type]
        self._outputs = [None] * len(self._outputs)
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "FeatureTap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RouterTap:
    """Records the expert indices [T, top_k] each layer's router chose during ``capture()``.

    Hooks the family's router module of each layer (gpt-oss ``mlp.router``, Qwen3-MoE
    ``mlp.gate``); in transformers 5.x a router returns (logits, scores, indices). A router that
    returns only logits is read through the family's selection (``select``).
    """

    def __init__(self, target: nn.Module):
        from pdflash.offload.family import family_of

        layers = decoder_layers(target)
        self.family = family_of(target)
        self.top_k = self.family.top_k
        self.num_experts = self.family.num_experts
        self._indices: dict[int, torch.Tensor] = {}
        self._active = False
        self._handles = []
        for i, layer in enumerate(layers):
            try:
                router = self.family.router(layer)
            except AttributeError:
                raise PdflashError(f"target layer {i} has no router where a {self.family.name} layer has one") from None
            self._handles.append(router.register_forward_hook(self._hook(i)))

    def _hook(self, layer: int):
        def hook(module, args, output):
            if not self._active:
                return
            ints = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                    if isinstance(t, torch.Tensor) and not t.is_floating_point()]
            if ints:
                idx = ints[-1]
            else:
                idx = self.family.select(_first_tensor(output))
            self._indices[layer] = idx.reshape(-1, idx.shape[-1])

        return hook

    @contextmanager
    def capture(self) -> Iterator[None]:
        self._indices = {}
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def take(self) -> dict[int, torch.Tensor]:
        """Layer -> chosen experts [T, top_k] of the last captured forward, on the host."""
        if not self._indices:
            return {}
        layers = sorted(self._indices)
        stacked = torch.stack([self._indices[l] for l in layers]).cpu()  # [L, T, k], one transfer
        self._indices = {}
        return {l: stacked[j] for j, l in enumerate(layers)}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
