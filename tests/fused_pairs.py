"""What the fused-kernel tests share: every (token, expert) pair's weighted output from the generic
path, and from the fused kernels in given batches. Pair p = t * K + k of idx [T, K] reads token t
of x [T, H] and expert idx[t, k] (slot idx[t, k] of ``slots``), weighted by w [T * K]."""

import torch


def generic_contrib(kernel, slots, x, w, idx):
    """contrib [T*K, H] from the generic path (kernel.weights / apply), one pair at a time."""
    T, K = idx.shape
    weights = kernel.weights(slots, list(range(slots.shape[0])))
    out = torch.empty(T * K, x.shape[1], dtype=torch.promote_types(kernel.dtype, w.dtype))
    for p, e in enumerate(idx.view(-1).tolist()):
        out[p] = (kernel.apply(weights, e, x[p // K : p // K + 1]) * w[p])[0]
    return out


def fused_contrib(kernel, slots, x, w, idx, batches):
    """contrib [T*K, H] from the fused kernels on the CPU (Triton's interpreter), launched once per
    batch of pair ids; rows of pairs in no batch stay NaN."""
    T, K = idx.shape
    fused = kernel.fused(torch.device("cpu"))
    assert fused is not None
    out = torch.full((T * K, x.shape[1]), float("nan"), dtype=torch.promote_types(kernel.dtype, w.dtype))
    h = torch.empty(T * K, fused.inter, dtype=kernel.dtype)
    flat = idx.view(-1).tolist()
    for batch in batches:
        work = torch.tensor([batch, [flat[p] for p in batch]], dtype=torch.int32)
        fused.run(slots, x, w, work, h, out, K)
    return out


def runtime_tokens_fused_and_generic(path, monkeypatch, min_slots: int, **load) -> dict[str, list[int]]:
    """Greedy tokens of the runtime on the CPU: "1" with the fused kernels at the minimum cache
    (misses arrive one by one), "0" with the generic path and every expert resident; checks that
    each run used the path it asked for."""
    from pdflash.offload.generate import generate
    from pdflash.offload.runtime import OffloadedModel

    runs = {}
    for fused, slots in (("0", None), ("1", min_slots)):
        monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", fused)
        with OffloadedModel.load(path, expert_cache_experts=slots, **load) as rt:
            runs[fused] = generate(rt, [5, 77, 200], max_new_tokens=4, eos_token_ids=[]).token_ids
            used = rt.family.decoder_layers(rt.model)[0].mlp.experts.kernel.fused(rt.device)
            assert (used is not None) == (fused == "1")
    return runs


def assert_batch_invariant(kernel, slots, x, w, idx):
    """Every pair computed in one launch, one by one in reverse, and in uneven waves: the same bits.
    Returns the one-launch result."""
    n = idx.numel()
    together = fused_contrib(kernel, slots, x, w, idx, [list(range(n))])
    one_by_one = fused_contrib(kernel, slots, x, w, idx, [[p] for p in reversed(range(n))])
    waves = fused_contrib(kernel, slots, x, w, idx, [list(range(1, n, 2)), list(range(0, n, 2))])
    assert not together.isnan().any()
    assert torch.equal(together, one_by_one) and torch.equal(together, waves)
    return together
