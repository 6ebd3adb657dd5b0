"""ExpertCache on its own: bytes land where they belong, eviction policies, pins, prefetch accounting."""

import pytest
import torch

from pdflash import PdflashError
from pdflash.draft.planner import distinct_experts
from pdflash.native import Band, Scheduler
from pdflash.offload.cache import ExpertCache
from pdflash.offload.host_store import ExpertLayout, HostStore

LAYERS, EXPERTS = 3, 6


@pytest.fixture
def store():
    layout = ExpertLayout.build([("w", (5, 7), torch.bfloat16), ("s", (3,), torch.uint8), ("b", (7,), torch.float32)], quantized=False)
    host = HostStore(layout, LAYERS, EXPERTS, pin=False)
    g = torch.Generator().manual_seed(0)
    for layer in range(LAYERS):
        host.fill_layer(layer, {
            "w": torch.randn(EXPERTS, 5, 7, generator=g).to(torch.bfloat16),
            "s": torch.randint(0, 256, (EXPERTS, 3), dtype=torch.uint8, generator=g),
            "b": torch.randn(EXPERTS, 7, generator=g),
        })
    return host


@pytest.fixture
def sched():
    with Scheduler(backend="memcpy", workers=2) as s:
        yield s


def _fetch(cache, layer, e):
    """What a forward does for one expert: hit, or request + wait. Returns the slot."""
    s = cache.lookup(layer, e)
    if s is None:
        s = cache.wait(cache.request(layer, e))
    return s


def test_layout_alignment_and_views(store):
    lay = store.layout
    assert all(p.offset % 16 == 0 for p in lay.pieces) and lay.expert_bytes % 256 == 0
    assert lay.payload_bytes == 5 * 7 * 2 + 3 + 7 * 4
    row = store.row(2, 4)
    assert lay.view(row, "w").dtype == torch.bfloat16 and lay.view(row, "w").shape == (5, 7)
    assert lay.view(row, "w").data_ptr() == row.data_ptr() + lay.piece("w").offset  # a view, no copy


def test_fetched_slot_holds_the_host_bytes(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=4)
    for layer, e in [(0, 1), (2, 5), (1, 3)]:
        s = _fetch(cache, layer, e)
        cache.end_layer()
        assert torch.equal(cache.slots[s], store.row(layer, e))
        b = store.layout.view(cache.slots[s], "b")
        assert torch.equal(b, store.expert_tensor(layer, e, "b"))
    assert cache.resident() == {0: [1], 1: [3], 2: [5]}


def _fill_and_use(cache, keys):
    for k in keys:
        _fetch(cache, *k)
        cache.end_layer()


def test_lru_evicts_least_recently_used(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3, policy="lru")
    _fill_and_use(cache, [(0, 0), (0, 1), (0, 2), (0, 0)])  # (0, 1) is now least recently used
    _fill_and_use(cache, [(1, 0)])
    assert not cache.is_resident(0, 1) and all(cache.is_resident(*k) for k in [(0, 0), (0, 2), (1, 0)])
    assert cache.stats.evictions == 1


def test_lfu_keeps_the_frequently_used(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3, policy="lfu")
    for _ in range(5):
        cache.begin_forward(1)
        _fill_and_use(cache, [(0, 0)])
    cache.begin_forward(1)
    _fill_and_use(cache, [(0, 1), (0, 2)])  # (0, 0) is the least recent but the most used
    _fill_and_use(cache, [(1, 0)])
    assert cache.is_resident(0, 0) and not cache.is_resident(0, 1)


def test_lookahead_policy_spares_predicted_experts(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3, policy="lookahead")
    _fill_and_use(cache, [(2, 0), (0, 1), (0, 2)])
    cache.protected = {(2, 0)}  # the oldest, but predicted for an upcoming layer
    _fill_and_use(cache, [(1, 5)])
    assert cache.is_resident(2, 0) and not cache.is_resident(0, 1)


class _CheckedBalanced(ExpertCache):
    """Balanced eviction checked at every eviction against a scan of every resident slot in LRU
    order: the victim is the evictable slot of the highest (over its layer's share, distance of
    its layer behind the running one), the least recently used on a tie."""

    victims = 0

    def _balanced_victim(self):
        got = super()._balanced_victim()
        share, n = self.capacity / self.num_layers, self.num_layers
        best, rank = None, None
        for s in self._lru:
            if s in self._pinned or s in self._deferred:
                continue
            layer = self._slot[s].key[0]
            r = (self._held[layer] > share, (layer - self._at - 1) % n)
            if rank is None or r > rank:
                best, rank = s, r
        assert got == best
        if self.victims % 50 == 0:  # the per-layer lists: each layer's slots in the global LRU order
            for layer, d in enumerate(self._layer_lru):
                assert list(d) == [s for s in self._lru if self._slot[s].key[0] == layer]
        _CheckedBalanced.victims += 1
        return got


def _copies_per_layer(bench, policy: str, block: int, forwards: int = 30) -> float:
    """Copies per layer per forward when forwards of ``block`` tokens with random top-4 routes walk
    24 layers of 32 experts through 192 slots (a 25 % cache), looking up every expert of a layer
    before requesting its misses, as the forward pass does (the eviction benchmark's replay)."""
    def check(cache):
        assert sum(cache._held) == len(cache._table) <= 192

    r = bench.replay(policy, 24, 32, 4, 192, block, forwards - 10, 10, 0,
                     cache_cls=_CheckedBalanced if policy == "balanced" else ExpertCache,
                     after_forward=check)
    return r["copies_per_layer"]


@pytest.mark.parametrize("block", [4, 8])
def test_balanced_keeps_every_layers_share_where_lru_thrashes(block, load_script):
    # A block's union (13.2 experts per layer for 4 tokens, 20.9 for 8) exceeds the 8 slots per
    # layer: LRU evicts each layer before the next forward comes back and copies the whole union;
    # balanced keeps 8 of each layer's experts, so about a quarter of the union hits.
    union = distinct_experts(block, 32, 4)
    bench = load_script("benchmarks/bench_eviction.py")
    assert _copies_per_layer(bench, "lru", block) > 0.97 * union
    before = _CheckedBalanced.victims
    assert _copies_per_layer(bench, "balanced", block) < 0.85 * union
    assert _CheckedBalanced.victims - before > 1000  # each victim checked against a scan of every slot


def test_balanced_takes_from_layers_over_their_share_then_from_the_furthest_next_use(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3, policy="balanced")
    _fill_and_use(cache, [(0, 0), (1, 0), (1, 1)])  # layer 1 holds 2 > share 1; (0, 0) is the LRU
    _fill_and_use(cache, [(2, 0)])
    assert cache.resident() == {0: [0], 1: [1], 2: [0]}
    _fill_and_use(cache, [(2, 1)])  # nobody over share: the running layer's unused expert goes
    assert cache.resident() == {0: [0], 1: [1], 2: [1]}
    cache.lookup(0, 0)  # layer 0 runs, its one slot pinned; layer 2 (just passed) comes back after layer 1
    _fetch(cache, 0, 1)
    assert cache.resident() == {0: [0, 1], 1: [1]}


def test_pinned_slots_are_never_evicted(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=2)
    _fetch(cache, 0, 0)
    _fetch(cache, 0, 1)  # both pinned by the running layer
    assert cache.request(0, 2) is None  # nothing may be evicted
    assert not cache.prefetch(1, 0, Band.BACKGROUND) and cache.stats.prefetch_dropped == 1
    cache.end_layer()  # on CPU the pins end with the layer
    assert cache.request(0, 2) is not None


def test_deferred_pins_wait_for_a_sync_point(store, sched):
    """Asynchronous devices: a finished layer's slots stay unevictable until the next sync point."""
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=2)
    cache._async_device = True  # behave as on CUDA
    _fill_and_use(cache, [(0, 0), (0, 1)])
    assert cache.occupancy()["pinned"] == 2 and cache.request(1, 0) is None
    cache.sync_point()
    assert cache.request(1, 0) is not None


def test_prefetch_used_and_wasted_are_counted(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3)
    assert cache.prefetch(1, 1, Band.ROUTE_AHEAD) and cache.prefetch(1, 2, Band.BACKGROUND)
    assert not cache.prefetch(1, 1, Band.BACKGROUND) and cache.stats.prefetch_redundant == 1
    cache.drain()
    assert cache.lookup(1, 1) is not None  # a prefetched expert used by a forward
    cache.end_layer()
    _fill_and_use(cache, [(0, 0), (0, 3)])  # the third slot is free, then the LRU victim is the unused (1, 2)
    st = cache.stats
    assert st.prefetch_used == 1 and st.prefetch_wasted == 1 and st.prefetch_issued == {1: 1, 2: 1}
    assert st.layers[1].hits == 1 and st.layers[0].misses == 2


def test_demand_takes_back_a_prefetch_in_flight(store):
    with Scheduler(backend="memcpy", workers=1, link_gbps=0.0001) as slow:  # 100 kB/s: copies stay queued
        cache = ExpertCache(store, slow, torch.device("cpu"), n_slots=2)
        assert cache.prefetch(2, 0, Band.BACKGROUND) and cache.prefetch(2, 1, Band.BACKGROUND)
        f = cache.request(0, 0)  # no free or resident slot: a prefetch on the way is cancelled for it
        assert f is not None
        assert cache.wait(f) == f.slot and cache.is_resident(0, 0)
        assert cache.stats.prefetch_cancelled + cache.stats.prefetch_wasted == 1


def test_reset_empties_and_stays_usable(store, sched):
    cache = ExpertCache(store, sched, torch.device("cpu"), n_slots=3)
    _fill_and_use(cache, [(0, 0), (1, 1)])
    cache.prefetch(2, 2, Band.BACKGROUND)
    cache.reset()
    assert cache.resident() == {} and cache.occupancy()["free"] == 3 and cache.stats.misses == 0
    s = _fetch(cache, 2, 2)
    assert torch.equal(cache.slots[s], store.row(2, 2))


def test_bad_sizes_and_policies(store, sched):
    with pytest.raises(PdflashError, match="at least one slot"):
        ExpertCache(store, sched, torch.device("cpu"), n_slots=0)
    with pytest.raises(PdflashError, match="unknown eviction policy"):
        ExpertCache(store, sched, torch.device("cpu"), n_slots=2, policy="mru")


def test_the_cli_default_eviction_is_the_runtimes():
    import inspect

    from pdflash.cli.generate import generate
    from pdflash.offload.cache import DEFAULT_EVICTION
    from pdflash.offload.runtime import OffloadedModel

    assert inspect.signature(generate).parameters["eviction"].default == DEFAULT_EVICTION
    assert inspect.signature(OffloadedModel.load).parameters["eviction"].default == DEFAULT_EVICTION


def test_eviction_benchmark_replays_and_rejects_bad_arguments(tmp_path, load_script):
    bench = load_script("benchmarks/bench_eviction.py")
    out = tmp_path / "e.json"
    assert bench.main(["--shapes", "gpt-oss-20b", "--blocks", "1,4", "--forwards", "3", "--warmup", "2",
                       "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(r["block"], r["policy"]) for r in rows] == [(1, "lru"), (1, "balanced"), (4, "lru"), (4, "balanced")]
    four = {r["policy"]: r["copies_per_layer"] for r in rows if r["block"] == 4}
    assert four["balanced"] < four["lru"]
    assert bench.main(["--shapes", "nope"]) == 2 and bench.main(["--blocks", "x"]) == 2


def _held_by_state(cache):
    """held()'s sets rebuilt the slow way, from state_of over every expert."""
    keys = [(layer, e) for layer in range(LAYERS) for e in range(EXPERTS)]
    return ({k for k in keys if cache.state_of(*k) == "resident"}, {k for k in keys if cache.state_of(*k) == "arriving"})


def test_held_sets_follow_every_state_change(store):
    """Fetches, landings, prefetches taken back, evictions and a reset: held() answers as state_of does."""
    import random

    rng = random.Random(0)
    with Scheduler(backend="memcpy", workers=1, link_gbps=0.001) as slow:  # 1 MB/s: prefetches stay on their way a while
        cache = ExpertCache(store, slow, torch.device("cpu"), n_slots=5)
        for i in range(120):
            layer, e = rng.randrange(LAYERS), rng.randrange(EXPERTS)
            if i % 3:
                cache.prefetch(layer, e, Band.BACKGROUND)
            else:
                _fetch(cache, layer, e)
                cache.end_layer()
            if i == 80:
                cache.reset()
            resident, arriving = cache.held()
            assert (resident, arriving) == _held_by_state(cache), i
        cache.drain()
        assert cache.held() == _held_by_state(cache) and not cache.held()[1]
