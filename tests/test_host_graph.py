"""Host steps (offload/host_graph.py, native/pf_layer.c): a step whose every routed expert runs on
the CPU, as one graph with the experts as host nodes. On the CPU the same step function runs
eagerly (a host node's call made directly) and must give the experts module's "all" path bit for
bit; on CUDA the captured graph must give the segmented graphs' tokens."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pdflash.native import NativeLibraryMissing
from pdflash.offload.config import ModelPreset
from pdflash.offload.graphs import GraphedDecoder
from pdflash.offload.host_graph import HostSteps, step_timeline
from pdflash.offload.runtime import OffloadedModel
from pdflash.offload.synthetic import write_checkpoint
from test_batch_invariant import _replaying_capture

try:
    from pdflash.native.cpu_experts import CpuExpertError, CpuExperts, ExpertWeights, RelayError
    CpuExperts(threads=1).close()
except NativeLibraryMissing:  # pragma: no cover - the build is part of the install
    pytest.skip("native library not built", allow_module_level=True)

PROMPT = [5, 77, 200, 31, 9, 100, 250, 17, 3, 44, 81, 90]
TOKENS = [7, 300, 12, 64, 8, 201, 33]


def _expert(H, I, seed):
    g = torch.Generator().manual_seed(seed)
    gb = torch.randint(0, 256, (2 * I, H // 32, 16), dtype=torch.uint8, generator=g)
    gs = torch.randint(119, 128, (2 * I, H // 32), dtype=torch.uint8, generator=g)
    db = torch.randint(0, 256, (H, I // 32, 16), dtype=torch.uint8, generator=g)
    ds = torch.randint(119, 128, (H, I // 32), dtype=torch.uint8, generator=g)
    b1 = torch.randn(2 * I, generator=g).to(torch.bfloat16)
    b2 = torch.randn(H, generator=g).to(torch.bfloat16)
    return ExpertWeights.mxfp4(gb, gs, b1, db, ds, b2)


def test_a_relay_runs_each_layer_when_its_down_flag_comes_and_answers_on_its_up_flag():
    """The relay (pf_relay) with a thread standing in for the device: it writes each layer's down
    flag, waits for the up flag, and by then that layer has run once more with the direct run's
    output. A second arm while one is armed is refused; a step whose flags never come ends by its
    timeout with every up flag set; a cancelled one ends at once; closing the pool closes it."""
    H, E, K, R, L = 64, 4, 2, 3, 3
    experts = [_expert(H, 32, seed=40 + e) for e in range(E)]
    g = torch.Generator().manual_seed(8)
    with CpuExperts(threads=2) as k:
        structs = [w.struct(k.ffi) for w in experts]
        layers, outs, wants = [], [], []
        for _ in range(L):
            idx = torch.randint(0, E, (R * K,), generator=g)
            out = torch.zeros(R * K, H)
            lay = k.layer(structs, K, R, idx, torch.rand(R * K, generator=g), torch.randn(R, H, generator=g), out)
            lay.run()
            layers.append(lay), outs.append(out), wants.append(out.clone())
        flags = torch.zeros(2 * L, dtype=torch.int32)
        relay = k.relay(flags, spin_us=50)
        for n in (L, 1, L):
            for out in outs:
                out.fill_(3.0)
            relay.arm(layers[:n], timeout_s=10.0)
            with pytest.raises(CpuExpertError, match="already armed"):
                relay.arm(layers[:n])
            seen = []

            def device():
                for i in range(n):
                    before = layers[i].result()[3]
                    time.sleep(0.002)
                    flags[i] = 1
                    deadline = time.monotonic() + 10
                    while int(flags[L + i]) == 0 and time.monotonic() < deadline:
                        time.sleep(0.0005)
                    seen.append(layers[i].result()[3] == before + 1 and torch.equal(outs[i], wants[i]))

            t = threading.Thread(target=device)
            t.start()
            t.join()
            assert relay.wait(10.0) == n and seen == [True] * n
            for lay in layers[:n]:
                lay.check()
            assert all(torch.equal(out, torch.full_like(out, 3.0)) for out in outs[n:])  # not named: not run
        relay.arm(layers, timeout_s=0.05)  # no flag ever comes
        with pytest.raises(RelayError, match="layer 0 of a relayed step never signalled"):
            relay.wait(10.0)
        assert flags[L:].tolist() == [1] * L
        relay.arm(layers, timeout_s=30.0)
        with pytest.raises(RelayError, match="still running"):
            relay.wait(0.01)
        relay.cancel()
        with pytest.raises(RelayError, match="cancelled after 0 of 3"):
            relay.wait(10.0)
        assert flags[L:].tolist() == [1] * L
        with pytest.raises(CpuExpertError, match="no relayed step"):
            relay.wait(0.0)
        with pytest.raises(CpuExpertError, match="2 \\* layers"):
            k.relay(torch.zeros(3, dtype=torch.int32))
        relay.arm(layers, timeout_s=30.0)  # closed with the pool while armed
    with pytest.raises(CpuExpertError, match="closed"):
        relay.arm(layers)


def test_host_steps_replay_arms_the_relay_and_never_leaves_it_armed(monkeypatch):
    """HostSteps.replay with a relay (a thread standing in for the device's graph): the relay is
    armed before the launch and collected after, each layer run once; a launch that fails cancels
    and collects the step (the next one arms again) and re-raises; a step whose flags stop coming
    fails with RelayError once the relay's timeout passes, every up flag set."""
    import pdflash.offload.host_graph as hg

    H, E, K, R, L = 64, 2, 1, 1, 3
    experts = [_expert(H, 32, seed=60 + e) for e in range(E)]
    with CpuExperts(threads=1) as k:
        structs = [w.struct(k.ffi) for w in experts]
        cpu = [k.layer(structs, K, R, torch.tensor([i % E]), torch.ones(1), torch.randn(R, H), torch.zeros(R, H))
               for i in range(L)]
        flags = torch.zeros(2 * L, dtype=torch.int32)
        steps = SimpleNamespace(relay=k.relay(flags, spin_us=0), device=torch.device("cpu"))
        layers = [SimpleNamespace(cpu=c) for c in cpu]

        class Graph:  # its replay runs the device's side: each down flag, then wait for the up flag
            def __init__(self, upto=L, fail=False):
                self.upto, self.fail = upto, fail

            def replay(self):
                if self.fail:
                    raise RuntimeError("launch failed")

                def device():
                    for i in range(self.upto):
                        flags[i] = 1
                        while int(flags[L + i]) == 0:
                            time.sleep(0.0005)

                t = threading.Thread(target=device)
                t.start()
                t.join(10)

        HostSteps.replay(steps, Graph(), layers)
        assert [c.result()[3] for c in cpu] == [1, 1, 1]
        with pytest.raises(RuntimeError, match="launch failed"):
            HostSteps.replay(steps, Graph(fail=True), layers)
        assert flags[L:].tolist() == [1] * L  # cancelled: every up flag answered
        monkeypatch.setattr(hg, "RELAY_TIMEOUT_S", 0.1)
        with pytest.raises(RelayError, match="layer 1 of a relayed step never signalled"):
            HostSteps.replay(steps, Graph(upto=1), layers)
        assert [c.result()[3] for c in cpu] == [2, 1, 1] and flags[L:].tolist() == [1] * L
        HostSteps.replay(steps, Graph(), layers)  # armed again after each failure
        assert [c.result()[3] for c in cpu] == [3, 2, 2]


@pytest.mark.parametrize("idx_dtype,x_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
def test_a_layer_run_is_the_runners_grouped_call_bit_for_bit(idx_dtype, x_dtype):
    """pf_layer_run groups positions by expert as the runner does (experts ascending, positions
    ascending, 16 per entry) and writes what one call_many of those entries writes; rows past the
    run's tokens are zeroed, and with a resident map the rows of experts marked resident; a bad
    index fails the run, zeroes out and is reported by check()."""
    H, E, K, R = 64, 6, 4, 24
    experts = [_expert(H, 32 * (1 + e % 2), seed=e) for e in range(E)]
    g = torch.Generator().manual_seed(3)
    with CpuExperts(threads=3) as k:
        structs = [w.struct(k.ffi) for w in experts]
        idx = torch.zeros(R * K, dtype=idx_dtype)
        scale = torch.zeros(R * K)
        x = torch.zeros(R, H, dtype=x_dtype)
        out = torch.full((R * K, H), 5.0)
        lay = k.layer(structs, K, R, idx, scale, x, out)
        for T in (R, 1, 7, R):  # R * K = 96 positions over 6 experts: some experts get more than 16
            idx.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(R)]).view(-1).to(idx_dtype))
            if T == R:
                idx[: 40] = 2  # one expert with 40 positions: three entries
            scale.copy_(torch.rand(R * K, generator=g))
            x.copy_(torch.randn(R, H, generator=g).to(x_dtype))
            lay.set_tokens(T)
            lay.run()
            positions = {}
            for p, e in enumerate(idx[: T * K].tolist()):
                positions.setdefault(e, []).append(p)
            structs_, counts, dest = [], [], []
            for e in sorted(positions):
                for i in range(0, len(positions[e]), 16):
                    chunk = positions[e][i: i + 16]
                    structs_.append(structs[e])
                    counts.append(len(chunk))
                    dest += chunk
            want = torch.zeros(R * K, H)
            k.call_many(structs_, counts, [p // K for p in dest], dest, [float(scale[p]) for p in dest], x, want)
            assert torch.equal(out, want), T
            assert lay.result()[1] == len(positions)
        resident = torch.zeros(E, dtype=torch.uint8)
        masked = k.layer(structs, K, R, idx, scale, x, torch.full((R * K, H), 5.0), resident)
        for res in ([], [2], [0, 3, 5]):  # read at every run
            resident.zero_()
            resident[res] = 1
            masked.set_tokens(R)
            masked.run()
            own = torch.tensor([int(e) not in res for e in idx.tolist()])
            assert torch.equal(masked._keep[5][own], out[own]) and torch.count_nonzero(masked._keep[5][~own]) == 0
            assert masked.result()[1] == len(set(idx.tolist()) - set(res))
        idx[3] = E  # out of range
        lay.run(check=False)
        with pytest.raises(CpuExpertError, match="out of range"):
            lay.check()
        assert torch.count_nonzero(out) == 0
        with pytest.raises(CpuExpertError, match="2 runs happened where 1"):
            lay.run(check=False)
            lay.run()
        with pytest.raises(CpuExpertError, match="tokens must be"):
            lay.set_tokens(R + 1)
        with pytest.raises(CpuExpertError, match="shape"):
            k.layer(structs, K, R, idx[:-1], scale, x, out)
        with pytest.raises(CpuExpertError, match="hidden size"):
            k.layer(structs + [_expert(32, 32, seed=9).struct(k.ffi)], K, R, idx, scale, x, out)
    with pytest.raises(CpuExpertError, match="closed"):  # closing the pool closed its layers
        lay.run()


def test_a_layer_report_reads_every_layers_figures_in_one_call_as_each_layer_does():
    """LayerReport: one pf_layer_report call gives each layer's last run as result(), clock(),
    fetch_result() and ahead_result() do, and checks the launched runs and the status as
    check() does (a layer that ran once more than launched, or whose run failed, raises)."""
    from pdflash.native.cpu_experts import LayerReport

    H, E, K, R = 64, 5, 2, 3
    experts = [_expert(H, 32, seed=e) for e in range(E)]
    with CpuExperts(threads=2) as k:
        structs = [w.struct(k.ffi) for w in experts]
        bufs = [(torch.tensor([e % E for e in range(i, i + R * K)], dtype=torch.int64), torch.rand(R * K),
                 torch.randn(R, H), torch.zeros(R * K, H)) for i in range(3)]
        layers = [k.layer(structs, K, R, *b) for b in bufs]
        report = LayerReport(layers)
        for lay, n in zip(layers, (1, 2, 0)):
            for _ in range(n):
                lay.run(check=False)
        got = report.check([1, 2, 0])
        for lay, row in zip(layers, got):
            st, ex, sec, runs = lay.result()
            assert row[:3] == (sec, *lay.clock()) and row[3] == lay.fetch_result()[2] and row[4:] == lay.ahead_result()
        assert got[2] == (0.0, 0, 0, 0.0, 0, 0, 0)  # never ran: zeros
        assert got[0][0] > 0 and got[0][2] > 0
        report.check([0, 0, 0])  # nothing launched since
        layers[1].run(check=False)
        with pytest.raises(CpuExpertError, match="1 runs happened where 0"):
            report.check([0, 0, 0])
        bufs[2][0][1] = E  # out of range
        layers[2].run(check=False)
        with pytest.raises(CpuExpertError, match="out of range"):
            report.check([0, 1, 1])  # layer 1's unexpected run is still unchecked
        with pytest.raises(CpuExpertError, match="at least one layer"):
            LayerReport([])
    with pytest.raises(CpuExpertError, match="closed"):  # closing the pool closed its layers
        report.check([0, 0, 0])


def test_a_fetching_layer_stages_the_planned_experts_and_computes_the_rest():
    """With a LayerFetch (memcpy scheduler, host stages) a run fetches plan[M] of its M
    non-resident experts, the most positions first, into the stages byte for byte, zeroes their
    rows and computes the others exactly as a plain layer does; stage_of says where each landed;
    a failing copy is computed instead (out still covers every position)."""
    from pdflash.native import Scheduler
    from pdflash.native.cpu_experts import LayerFetch

    H, E, K, R, NB = 64, 6, 2, 4, 5000
    experts = [_expert(H, 32, seed=e) for e in range(E)]
    g = torch.Generator().manual_seed(5)
    src = [torch.randint(0, 256, (NB,), dtype=torch.uint8, generator=g) for _ in range(E)]
    stages = [torch.zeros(NB, dtype=torch.uint8) for _ in range(2)]
    for fault in (0, 1):
        with CpuExperts(threads=2) as k, Scheduler("memcpy", workers=2, fault_every=fault) as sched:
            structs = [w.struct(k.ffi) for w in experts]
            idx = torch.tensor([0, 1, 0, 2, 0, 3, 1, 4], dtype=torch.int64)  # positions: 0:3, 1:2, 2..4:1
            scale = torch.rand(R * K, generator=g)
            x = torch.randn(R, H, generator=g)
            want = torch.zeros(R * K, H)
            plain = k.layer(structs, K, R, idx, scale, x, want)
            plain.run()
            resident = torch.zeros(E, dtype=torch.uint8)
            resident[3] = 1
            plan = torch.zeros(R * K + 1, dtype=torch.uint8)
            stage_of = torch.full((E,), 7, dtype=torch.int32)
            out = torch.full((R * K, H), 5.0)
            fetch = LayerFetch(sched, [t.data_ptr() for t in src], NB, [t.data_ptr() for t in stages], 1 << 40,
                               plan, stage_of)
            lay = k.layer(structs, K, R, idx, scale, x, out, resident, fetch)
            for planned in (0, 1, 2, 4):  # M = 4 non-resident experts (0, 1, 2, 4); two stages
                plan[4] = planned
                lay.run()
                fetched, fallback, _, off = lay.fetch_result()
                chosen = [0, 1][: min(planned, 2)]  # the most positions first
                assert fetched + fallback == len(chosen) and not off
                if not fault:
                    assert fallback == 0 and [int(stage_of[e]) for e in chosen] == list(range(len(chosen)))
                for e in range(E):
                    s = int(stage_of[e])
                    if s >= 0:
                        assert e in chosen and torch.equal(stages[s], src[e])
                skip = {3} | {e for e in range(E) if int(stage_of[e]) >= 0}
                rows = torch.tensor([int(e) not in skip for e in idx.tolist()])
                assert torch.equal(out[rows], want[rows]) and torch.count_nonzero(out[~rows]) == 0
            with pytest.raises(CpuExpertError, match="fetch plan"):
                k.layer(structs, K, R, idx, scale, x, out, None,
                        LayerFetch(sched, fetch.src, NB, fetch.stages, 0, plan[:-1], stage_of))
            with pytest.raises(CpuExpertError, match="one source per expert"):
                k.layer(structs, K, R, idx, scale, x, out, None,
                        LayerFetch(sched, fetch.src[:-1], NB, fetch.stages, 0, plan, stage_of))


def test_route_ahead_prefetches_the_next_layers_predicted_experts_into_its_stages():
    """pf_layer_set_ahead: a run of layer A submits, at band 1 into layer B's stages, B's predicted
    experts that B does not hold resident (the most positions first, at most ``most``); B's next
    run claims those it is routed to (promoted to band 0: their bytes land in the stage stage_of
    names, byte for byte, their rows zero) and cancels the others; the plan's fetches take the
    stages left free; B's CPU rows equal a plain layer's. A failing copy is computed instead."""
    from pdflash.native import Band, Scheduler
    from pdflash.native.cpu_experts import LayerFetch

    H, E, K, R, NB, S = 64, 8, 2, 3, 5000, 4
    experts = [_expert(H, 32, seed=e) for e in range(E)]
    g = torch.Generator().manual_seed(7)
    src = [torch.randint(0, 256, (NB,), dtype=torch.uint8, generator=g) for _ in range(E)]
    for fault in (0, 1):
        # a slow simulated link (0.1 s an expert): the prefetches are still live when B claims them
        with CpuExperts(threads=2) as k, Scheduler("memcpy", workers=2, fault_every=fault, link_gbps=NB / 0.1 / 1e9,
                                                   paced=True) as sched:
            structs = [w.struct(k.ffi) for w in experts]
            x = torch.randn(R, H, generator=g)
            scale = torch.rand(R * K, generator=g)

            def layer(idx, key, resident=None, plan=None):
                stages = [torch.zeros(NB, dtype=torch.uint8) for _ in range(S)]
                plan = torch.zeros(R * K + 1, dtype=torch.uint8) if plan is None else plan
                stage_of = torch.full((E,), 7, dtype=torch.int32)
                out = torch.full((R * K, H), 5.0)
                fetch = LayerFetch(sched, [t.data_ptr() for t in src], NB, [t.data_ptr() for t in stages], key,
                                   plan, stage_of)
                return k.layer(structs, K, R, idx, scale, x, out, resident, fetch), stages, stage_of, out, plan

            a, *_ = layer(torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.int64), 1 << 40)
            b_idx = torch.tensor([2, 6, 4, 6, 2, 7], dtype=torch.int64)  # positions: 2:2, 6:2, 4:1, 7:1
            resident = torch.zeros(E, dtype=torch.uint8)
            resident[3] = 1
            b, stages, stage_of, out, plan = layer(b_idx, 2 << 40, resident)
            want = torch.zeros(R * K, H)
            k.layer(structs, K, R, b_idx, scale, x, want).run()
            predicted = torch.tensor([5, 2, 3, 5, 2, 4], dtype=torch.int64)  # 5:2, 2:2, 4:1; 3 is resident in B
            with pytest.raises(CpuExpertError, match="route-ahead"):
                a.set_ahead(b, predicted, S + 1)
            with pytest.raises(CpuExpertError, match="route-ahead"):  # the next layer must fetch
                a.set_ahead(k.layer(structs, K, R, b_idx, scale, x, torch.zeros(R * K, H)), predicted, 1)
            with pytest.raises(CpuExpertError, match="int64"):
                a.set_ahead(b, predicted[:-1], 1)
            a.set_ahead(b, predicted, 3)
            a.run()
            assert a.ahead_result()[0] == 3  # 2, 5 (two positions each, lower index first), then 4
            assert sched.stats()["levels"][Band.ROUTE_AHEAD]["submitted"] == 3
            plan[2] = 1  # of B's M = 2 experts left after the claims (6 and 7; 2 and 4 claimed), fetch one
            b.run()
            sent, used, unused = b.ahead_result()
            fetched, fallback, _, off = b.fetch_result()
            assert (used, unused) == (2, 1) and fetched + fallback == 3 and not off
            if not fault:
                assert fallback == 0
                assert [int(stage_of[e]) for e in (2, 4)] == [0, 2]  # the prefetches' stages
                assert int(stage_of[6]) == 3 and int(stage_of[7]) == -1  # the plan: 6 (2 positions), a free stage
                assert sched.stats()["levels"][Band.ON_DEMAND]["promoted"] == 2  # the claimed ones, still live
            for e in range(E):
                st = int(stage_of[e])
                if st >= 0:
                    assert torch.equal(stages[st], src[e])
            skip = {e for e in range(E) if int(stage_of[e]) >= 0}
            rows = torch.tensor([e not in skip for e in b_idx.tolist()])
            assert torch.equal(out[rows], want[rows]) and torch.count_nonzero(out[~rows]) == 0
            a.run()  # prefetches left in B's stages when B is closed: cancelled, waited for
            b.close()
            levels = sched.stats()["levels"]
            assert all(lv["queue_depth"] == 0 and lv["in_flight"] == 0 for lv in levels)
            a.set_ahead(None)
            a.run()
            assert a.ahead_result()[0] == 0


def _replaying_capture_host(self, bucket: int, R: int, mode: str = "all") -> list:
    """``GraphedDecoder._capture_host`` for a CPU: the step function is warmed up once, as the
    capture does, and each "replay" runs it again and publishes its outputs in the first run's
    tensors, where the captured graph's outputs would be."""
    steps = HostSteps.for_runtime(self.rt)
    layers = steps.layers(R, self.dtype, mode)
    steps.before_step(mode, R, R)
    fn = self._host_step_fn(bucket, R, layers)
    logits, xs = fn()

    def replay():
        lg, new = fn()
        logits.copy_(lg)
        for a, b in zip(xs, new):
            a.copy_(b)

    return [SimpleNamespace(replay=replay), logits, xs, layers, steps]


@pytest.fixture(scope="module", params=[dict(seed=21, dtype="float32"), dict(seed=22, mxfp4=True)], ids=["f32", "mxfp4"])
def tiny(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("host") / "m", ModelPreset.from_name("tiny"), **request.param)


@pytest.mark.parametrize("rows", [None, 4], ids=["per-block", "fixed-rows"])
def test_a_host_step_is_the_experts_modules_all_path_bit_for_bit(tiny, monkeypatch, rows):
    """Decode steps and blocks of 1-3 tokens through host steps (their function run eagerly) give
    the segmented step's logits and tapped features (the experts module's all path between its
    segments) bit for bit, and the same bookkeeping: CPU experts per layer, the runner's counts,
    the routing the observers saw."""
    monkeypatch.setattr(GraphedDecoder, "_capture_host", _replaying_capture_host)
    monkeypatch.setattr(GraphedDecoder, "_capture", _replaying_capture)
    with OffloadedModel.load(tiny, device="cpu", cpu_experts="all", cpu_threads=2) as rt:
        seen = []
        rt.add_routing_observer(lambda layer, experts: seen.append((layer, tuple(experts))))

        def cpu_counts():
            fs = rt.cache.stats
            return [lc.cpu for lc in fs.layers], rt.cpu.experts, rt.cpu.tokens, fs.host_steps

        def run(host):
            seen.clear()
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 10, graphs=False, rows=rows)
            dec.tap_layers = [0, 1]
            dec.prefill(PROMPT)
            dec.graphs = True  # the graphed path, its graphs replayed as above
            dec.host_steps_enabled = host
            seen.clear()
            before = cpu_counts()
            logits, feats = [dec.decode(TOKENS[0])], []
            for block in (TOKENS[1:4], TOKENS[4:5], TOKENS[5:7]):
                lg, f = dec.forward(block)
                logits.append(lg)
                feats.append(f)
            after = cpu_counts()
            per_layer = [b - a for a, b in zip(before[0], after[0])]
            return (torch.cat(logits), torch.cat(feats, 1), list(seen), per_layer, after[1] - before[1],
                    after[2] - before[2], after[3] - before[3])

        want = run(False)
        assert rt.stats()["cpu_experts"]["host_handoff"] is None  # no host step yet
        got = run(True)
        assert rt.stats()["cpu_experts"]["host_handoff"] == "direct"  # the CPU device calls each layer
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[2:6] == want[2:6] and sum(want[3]) > 0
        assert want[6] == 0 and got[6] == 4
        assert got[0].shape[0] == 7 and got[1].shape[:2] == (1, 6)


def test_host_steps_only_where_every_expert_is_on_the_cpu(tiny, monkeypatch):
    """Fetch-only runtimes, layer hooks (route-ahead) and PDFLASH_HOST_STEPS=0 keep the segments."""
    monkeypatch.setattr(GraphedDecoder, "_capture_host", _replaying_capture_host)
    with OffloadedModel.load(tiny, device="cpu", cpu_experts="off") as rt:
        assert not rt.all_on_cpu(1) and HostSteps.for_runtime(rt) is None
    with OffloadedModel.load(tiny, device="cpu", cpu_experts="all", cpu_threads=1) as rt:
        assert rt.all_on_cpu(1)
        dec = GraphedDecoder(rt, max_len=len(PROMPT) + 4, graphs=False)
        dec.graphs = True
        assert dec._host_mode(1) == "all"
        dec.layer_hooks.append(lambda i, x: None)
        assert dec._host_mode(1) is None
        monkeypatch.setenv("PDFLASH_HOST_STEPS", "0")
        assert not GraphedDecoder(rt, max_len=8, graphs=False).host_steps_enabled


def test_a_host_step_with_the_caches_hits_is_the_host_arm_bit_for_bit(tmp_path, monkeypatch):
    """The guard's host arm (hits from the cache on the device, every other expert on the CPU,
    nothing fetched) as host steps of mode "host": the segmented host arm's logits bit for bit,
    hits and CPU experts counted alike; the slot table follows the cache after it changes. On
    the CPU device the hits' fused kernel and the fused residual run in Triton's interpreter."""
    from pdflash.offload import mxfp4_triton

    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")
    monkeypatch.setenv("PDFLASH_FUSED_RESIDUAL", "1")
    if not mxfp4_triton.available(torch.device("cpu")):
        pytest.skip("the fused kernels need Triton (its interpreter on the CPU)")
    monkeypatch.setattr(GraphedDecoder, "_capture_host", _replaying_capture_host)
    monkeypatch.setattr(GraphedDecoder, "_capture", _replaying_capture)
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=23)
    with OffloadedModel.load(ckpt, device="cpu", cpu_experts="auto", link_gbps=1.0, expert_cache_experts=24,
                             cpu_threads=2) as rt:
        guard = rt.placer.guard

        def run(host):
            rt.reset_cache()
            rt.cache.fill([(layer, e) for layer in range(4) for e in range(8) if (layer + e) % 3 == 0][:12])
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 10, graphs=False)
            guard.pin("all", longer=True)  # the prompt on the CPU: the cache keeps what it was filled with
            dec.prefill(PROMPT[:5])
            dec.graphs, dec.host_steps_enabled = True, host
            guard.pin("off")
            logits = [dec.decode(TOKENS[0])]  # fetch-only: the cache changes
            guard.pin("host")
            for t in TOKENS[1:4]:
                logits.append(dec.decode(t))
            guard.pin("off")
            logits.append(dec.decode(TOKENS[4]))
            guard.pin("host")
            for t in TOKENS[5:]:
                logits.append(dec.decode(t))
            fs = rt.cache.stats
            return torch.cat(logits), fs.hits, fs.misses, fs.cpu, fs.host_steps

        want = run(False)
        got = run(True)
        assert torch.equal(got[0], want[0])
        assert got[1:4] == want[1:4] and want[1] > 0 and want[3] > 0
        assert want[4] == 0 and got[4] == 5
        assert HostSteps.for_runtime(rt).fused_residual  # the host steps added their experts in one kernel


def _fused_on_cpu(monkeypatch):
    from pdflash.offload import mxfp4_triton

    monkeypatch.setenv("PDFLASH_FUSED_EXPERTS", "1")
    if not mxfp4_triton.available(torch.device("cpu")):
        pytest.skip("the fused kernels need Triton (its interpreter on the CPU)")


@pytest.mark.parametrize("ahead", [False, True], ids=["plan", "route-ahead"])
def test_split_host_steps_fetch_the_planned_misses_into_stages(tmp_path, monkeypatch, ahead):
    """The guard's model arm as host steps of mode "split": a plan that fetches every miss gives
    the host arm's logits with every expert resident, bit for bit (a staged expert is the fused
    kernel's, like a hit); without route-ahead a plan that fetches nothing gives the host arm's
    with the same cache, with it the next layer's predicted experts are fetched all the same
    (claimed ones counted as promoted misses, the others cancelled); the cost model's own plan
    keeps fetch-only's greedy tokens (float32) and counts hits, fetched misses (with the time the
    host nodes waited for them) and CPU experts, one per routed expert."""
    _fused_on_cpu(monkeypatch)
    monkeypatch.setenv("PDFLASH_ROUTE_AHEAD", "1" if ahead else "0")
    monkeypatch.setattr(GraphedDecoder, "_capture_host", _replaying_capture_host)
    monkeypatch.setattr(GraphedDecoder, "_capture", _replaying_capture)
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=24)
    L, E = 4, 8
    with OffloadedModel.load(ckpt, device="cpu", dtype="float32", cpu_experts="auto", link_gbps=1.0,
                             expert_cache_experts=L * E - 1, cpu_threads=2) as rt:
        guard, placer = rt.placer.guard, rt.placer
        placer.hot_uses = 10**6  # the cache stays as filled: runs compare bit for bit
        plan_of = placer.fetch_plan

        def run(arm, cached, plan=None, steps=2):
            rt.reset_cache(cached)
            keys = [(layer, e) for layer in range(L) for e in range(E)]
            rt.cache.fill(keys[:-1] if cached == L * E - 1 else [k for k in keys if sum(k) % 3 == 0][:cached])
            placer.fetch_plan = plan or plan_of
            if ahead:  # the plan as given, and half the stages for the next layer's predicted experts
                placer.split_plan = lambda t, k, stages, e, gap, on: (placer.fetch_plan(t, k, stages), stages // 2)
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 10, graphs=False)
            guard.pin("all", longer=True)  # the prompt's keys and values whatever the cache holds
            toks = [int(dec.prefill(PROMPT).argmax())]
            dec.graphs = True
            guard.pin(arm)
            fs = rt.cache.stats
            before = (fs.host_steps, fs.hits, fs.misses, fs.cpu, fs.demand_fetches,
                      sum(lc.waits for lc in fs.layers))
            sent0, used0, unused0 = fs.route_ahead_sent, fs.route_ahead_used, fs.route_ahead_cancelled
            promoted0 = sum(lc.promoted for lc in fs.layers)
            cpu_s, runner_s = fs.cpu_seconds, rt.cpu.seconds
            rows = []
            for _ in range(steps):
                rows.append(dec.decode(toks[-1]))
                toks.append(int(rows[-1].argmax()))
            after = (fs.host_steps, fs.hits, fs.misses, fs.cpu, fs.demand_fetches, sum(lc.waits for lc in fs.layers))
            host_steps, hits, misses, cpu, demand, waits = (b - a for a, b in zip(before, after))
            sent, used, unused = (fs.route_ahead_sent - sent0, fs.route_ahead_used - used0,
                                  fs.route_ahead_cancelled - unused0)
            assert sum(lc.promoted for lc in fs.layers) - promoted0 == used and used + unused == sent
            if not ahead or arm != "model":
                assert sent == 0
            elif placer.fetch_plan is nothing:  # every fetched miss is a claimed prefetch
                assert misses == used and sent > 0
            assert host_steps == (steps if arm != "off" else 0)
            timeline = fs.host_timeline_ms()
            if arm != "off":  # every step on the timeline: its parts add up to it
                mode = "split" if arm == "model" else arm
                t = timeline[mode]
                assert t["steps"] == steps
                assert t["head"] + t["node"] + t["gaps"] + t["tail"] == pytest.approx(t["step"], rel=1e-6, abs=1e-3)
                assert 0 <= t["kernel"] <= t["node"] and 0 <= t["fetch_wait"] <= t["node"] and t["head"] >= 0
                assert t["bookkeeping"] > 0  # HostSteps.finish's own time, after the step
                # the CPU's time is the kernel's own, not the node's (a split node also waits for the link)
                kernel_s = fs.host_timeline[mode]["kernel_s"]
                assert fs.cpu_seconds - cpu_s == pytest.approx(kernel_s)
                assert rt.cpu.seconds - runner_s <= kernel_s * (1 + 1e-9)  # the runner's rate: nodes with CPU experts
            else:
                assert timeline == {}
            if arm != "off":  # every routed expert once: a hit, a fetched miss or a CPU expert
                assert hits + misses + cpu == steps * L * 2 and demand == misses
            return torch.cat(rows), toks, (hits, misses, cpu, waits)

        every = lambda tokens, top_k, stages: list(range(tokens * top_k + 1))  # noqa: E731
        nothing = lambda tokens, top_k, stages: [0] * (tokens * top_k + 1)  # noqa: E731
        want, _, (hits, misses, cpu, _) = run("model", L * E - 1, every)
        assert hits > 0 and cpu == 0
        got, _, (hits, misses, cpu, waits) = run("model", 12, every)
        assert torch.equal(got, want) and misses > 0 and cpu == 0 and waits > 0
        if ahead:  # the predicted experts that were routed: fetched, the fused kernel's; every CPU
            # expert is hot, yet route-ahead leaves the link to its prefetches: no background fills
            placer.hot_uses, placer._uses = 1, {}
            _, _, (hits, misses, cpu, _) = run("model", 12, nothing)
            assert misses > 0 and cpu > 0 and placer.background == 0
            placer.hot_uses = 10**6
        else:
            got, _, (hits, misses, cpu, _) = run("model", 12, nothing)
            assert torch.equal(got, run("host", 12)[0]) and misses == 0 and cpu > 0
        _, toks_off, _ = run("off", 12, steps=4)
        _, toks, counts = run("model", 12, lambda tokens, top_k, stages: [0, 1, 1][: tokens * top_k + 1], steps=4)
        assert toks == toks_off and counts[1] > 0 and counts[2] > 0, counts
        if not ahead:
            placer.hot_uses, placer._uses = 1, {}  # every CPU expert is hot: queued into the (full) cache after its step, evicting hits
            _, toks, counts = run("model", 12, lambda tokens, top_k, stages: [0, 1, 1][: tokens * top_k + 1], steps=4)
            assert toks == toks_off and placer.background > 0
        plan = plan_of(1, 2, 4)
        assert len(plan) == 3 and plan[0] == 0 and all(0 <= n <= m for m, n in enumerate(plan))


def test_the_split_plan_is_made_again_once_its_assumed_inputs_are_measured():
    """HostSteps.refresh_plan: the plan of a token count is made once per PLAN_EVERY steps, and
    again as soon as the split steps' own gaps exist (after the first split step) and once
    route-ahead has sent AHEAD_SAMPLES prefetches (its precision replaces the prior)."""
    from pdflash.offload import host_graph as hg
    from pdflash.offload.cpu_compute import AHEAD_SAMPLES
    from pdflash.offload.stats import FetchStats

    stats = FetchStats(num_layers=2)
    calls = []

    def split_plan(tokens, top_k, stages, experts, gap, ahead):
        calls.append(gap)
        return [0, 1, 1], 0

    steps = object.__new__(HostSteps)
    steps.rt = SimpleNamespace(cache=SimpleNamespace(stats=stats), placer=SimpleNamespace(split_plan=split_plan))
    steps.top_k, steps.num_experts, steps.num_layers, steps.route_ahead = 1, 4, 2, True
    steps._layers, steps.steps_run = {}, 0
    bufs = SimpleNamespace(plan=torch.zeros(3, dtype=torch.uint8), plan_key=None, ahead_most=0)
    steps._bufs = {1: bufs}
    split = {"step": 0.01, "head": 0.0, "node": 0.006, "kernel": 0.005, "fetch_wait": 0.0, "gaps": 0.002, "tail": 0.002}
    steps.refresh_plan(1, 1)
    steps.refresh_plan(1, 1)
    assert len(calls) == 1 and calls[0] is None and bufs.plan.tolist() == [0, 1, 1]
    stats.add_host_step("host", {**split, "gaps": 0.004})  # another mode's gaps: no new plan
    steps.refresh_plan(1, 1)
    assert len(calls) == 1
    stats.add_host_step("split", split)  # the first split step measured its gaps
    steps.refresh_plan(1, 1)
    steps.refresh_plan(1, 1)
    assert calls[1:] == [pytest.approx(0.002)]
    stats.route_ahead_sent = AHEAD_SAMPLES  # route-ahead's own precision from now on
    steps.refresh_plan(1, 1)
    steps.refresh_plan(1, 1)
    assert len(calls) == 3
    steps.steps_run = hg.PLAN_EVERY  # the next period
    steps.refresh_plan(1, 1)
    steps.refresh_plan(1, 2)  # another token count
    assert len(calls) == 5


def test_a_step_timeline_places_each_host_node_between_launch_and_end():
    """head (launch to the first node) + time inside the nodes + the gaps between them + tail
    (last node to the end) is the step; the kernel calls and the fetch waits are parts of the nodes."""
    ms = 1_000_000
    runs = [(10 * ms, 0.002, 1 * ms, 0.0005), (13 * ms, 0.003, 2 * ms, 0.0), (20 * ms, 0.001, ms // 2, 0.0)]
    t = step_timeline(7 * ms, 25 * ms, runs)
    assert t["step"] == pytest.approx(0.018) and t["head"] == pytest.approx(0.003)
    assert t["node"] == pytest.approx(0.006) and t["kernel"] == pytest.approx(0.0035)
    assert t["fetch_wait"] == pytest.approx(0.0005)
    assert t["gaps"] == pytest.approx(0.001 + 0.004) and t["tail"] == pytest.approx(0.004)
    assert t["head"] + t["node"] + t["gaps"] + t["tail"] == pytest.approx(t["step"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_host_steps_match_the_segmented_graphs(tmp_path, dtype):
    """On CUDA the captured host step (host nodes inside the graph) gives the segmented graphs'
    logits bit for bit under --cpu-experts all, and in float32 fetch-only's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=5)

    def run(mode, host):
        with OffloadedModel.load(ckpt, device="cuda", dtype=dtype, cpu_experts=mode, cpu_threads=4,
                                 expert_cache_experts=16 if mode == "off" else None) as rt:
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 40, graphs=True)
            dec.host_steps_enabled = host
            logits = dec.prefill(PROMPT)
            toks, rows = [int(logits.argmax())], []
            for _ in range(24):
                lg = dec.decode(toks[-1])
                rows.append(lg)
                toks.append(int(lg.argmax()))
            return toks, torch.cat(rows).cpu(), rt.stats()["cpu_experts"]["host_steps"], rt.stats()

    toks_h, logits_h, n_h, st = run("all", True)
    toks_s, logits_s, n_s, _ = run("all", False)
    assert n_h == 24 and n_s == 0
    assert torch.equal(logits_h, logits_s) and toks_h == toks_s
    if dtype == "float32":
        assert run("off", False)[0] == toks_h


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_host_steps_of_the_host_arm_match_its_segments(tmp_path, dtype):
    """On CUDA, the guard's host arm as captured host steps of mode "host" (the hits by the fused
    kernel inside the graph) gives the segmented host arm's logits bit for bit, through cache
    changes between its steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=6)

    def run(host):
        with OffloadedModel.load(ckpt, device="cuda", dtype=dtype, cpu_experts="auto", cpu_threads=4,
                                 expert_cache_experts=24) as rt:
            guard = rt.placer.guard
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 40, graphs=True)
            dec.host_steps_enabled = host
            guard.pin("off", longer=True)
            toks = [int(dec.prefill(PROMPT).argmax())]
            rows = []
            for i in range(24):
                guard.pin("off" if i % 8 == 0 else "host")  # the cache changes every eighth step
                lg = dec.decode(toks[-1])
                rows.append(lg)
                toks.append(int(lg.argmax()))
            fs = rt.cache.stats
            return torch.cat(rows).cpu(), fs.hits, fs.cpu, fs.host_steps

    got, want = run(True), run(False)
    assert torch.equal(got[0], want[0]) and got[1:3] == want[1:3]
    assert got[3] == 21 and want[3] == 0


@pytest.mark.gpu
def test_cuda_split_host_steps_fetch_beside_the_cpu(tmp_path):
    """On CUDA, the model arm as captured host steps of mode "split": host nodes that hand part of
    a layer's misses to the scheduler (real copies on its streams, waited for on a condition
    variable inside the graph) and compute the rest. A plan that fetches every miss gives, bit
    for bit, the logits of a cache holding every expert but one (staged experts are the fused
    kernel's, like hits); the cost model's plan keeps fetch-only's greedy tokens in float32, and so
    does a plan that fetches nothing, whose fetches are then the route-ahead prefetches each host
    node made for the next layer (from the next router on the device) and the next one claimed."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=7)
    L, E = 4, 8

    def run(arm, cached, plan=None, steps=16, ahead=0):
        with OffloadedModel.load(ckpt, device="cuda", dtype="float32", cpu_experts="auto", cpu_threads=4,
                                 expert_cache_experts=L * E - 1) as rt:
            guard, placer = rt.placer.guard, rt.placer
            placer.hot_uses = 10**6
            if plan is not None:  # that plan, and ``ahead`` of the next layer's predicted experts
                placer.fetch_plan = plan
                placer.split_plan = lambda t, k, stages, e, gap, on: (plan(t, k, stages), ahead)
            keys = [(layer, e) for layer in range(L) for e in range(E)]
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 40, graphs=True)
            guard.pin("all", longer=True)
            toks = [int(dec.prefill(PROMPT).argmax())]
            rt.cache.fill(keys[:cached])
            guard.pin(arm)
            fs = rt.cache.stats
            before = (fs.host_steps, fs.misses, sum(lc.waits for lc in fs.layers), fs.cpu,  # the prompt's
                      fs.route_ahead_sent, fs.route_ahead_used)
            rows = []
            for _ in range(steps):
                rows.append(dec.decode(toks[-1]))
                toks.append(int(rows[-1].argmax()))
            after = (fs.host_steps, fs.misses, sum(lc.waits for lc in fs.layers), fs.cpu,
                     fs.route_ahead_sent, fs.route_ahead_used)
            if arm == "model":  # the graph's host nodes on the step's timeline, in order
                t = rt.stats()["cpu_experts"]["host_timeline_ms"]["split"]
                assert t["steps"] >= steps and min(t["head"], t["node"], t["gaps"], t["tail"]) >= 0
                assert t["head"] + t["node"] + t["gaps"] + t["tail"] == pytest.approx(t["step"], rel=1e-6, abs=1e-3)
            return (torch.cat(rows).cpu(), toks, *(b - a for a, b in zip(before, after)))

    every = lambda tokens, top_k, stages: list(range(tokens * top_k + 1))  # noqa: E731
    want = run("model", L * E - 1, every)
    got = run("model", 12, every)
    assert torch.equal(got[0], want[0]) and got[2] == 16 and got[3] > 0 and got[4] > 0 and got[5] == 0
    off = run("off", 12)
    mixed = run("model", 12, lambda tokens, top_k, stages: [0, 1, 1][: tokens * top_k + 1])
    assert mixed[1] == off[1] and mixed[2] == 16 and mixed[3] > 0 and mixed[5] > 0
    assert run("model", 12)[1] == off[1]  # the cost model's own plan
    ahead = run("model", 12, lambda tokens, top_k, stages: [0] * (tokens * top_k + 1), ahead=2)
    assert ahead[1] == off[1] and ahead[6] > 0 and 0 < ahead[7] <= ahead[6] and ahead[3] == ahead[7]


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["all", "model"])
def test_cuda_host_steps_relayed_by_flags_match_host_nodes(tmp_path, monkeypatch, arm):
    """On CUDA a host step hands its layers to the CPU through flags and the relay thread by default
    (stream memory operations in the graph); its logits equal, bit for bit, those of the same
    steps with host nodes (PDFLASH_HOST_HANDOFF=node), in modes "all" and "split"."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = write_checkpoint(tmp_path / "m", ModelPreset.from_name("tiny"), mxfp4=True, seed=9)

    def run(handoff):
        monkeypatch.setenv("PDFLASH_HOST_HANDOFF", handoff)
        with OffloadedModel.load(ckpt, device="cuda", dtype="float32", cpu_experts="auto", cpu_threads=4,
                                 expert_cache_experts=12) as rt:
            dec = GraphedDecoder(rt, max_len=len(PROMPT) + 40, graphs=True)
            rt.placer.guard.pin("all", longer=True)
            toks = [int(dec.prefill(PROMPT).argmax())]
            rt.placer.guard.pin(arm)
            rows = []
            for _ in range(12):
                rows.append(dec.decode(toks[-1]))
                toks.append(int(rows[-1].argmax()))
            steps = HostSteps.for_runtime(rt)
            assert rt.stats()["cpu_experts"]["host_handoff"] == ("flags" if steps.relay is not None else "node")
            return torch.cat(rows).cpu(), rt.cache.stats.host_steps, steps.relay is not None

    flags, node = run("flags"), run("node")
    assert flags[2] and not node[2]
    assert flags[1] == node[1] >= 12
    if arm == "all":
        assert torch.equal(flags[0], node[0])
    else:  # the split's fetches land by the link's timing: the same tokens
        assert torch.equal(flags[0].argmax(-1), node[0].argmax(-1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_fused_residual_is_the_torch_ops_bit_for_bit(device):
    """moe_residual (one Triton kernel; on the CPU through the interpreter) gives the bits of the
    torch ops a host step ran before it: the device's rows plus the CPU's, summed over each row's
    K positions, cast, added to the residual; for bfloat16 and float32 rows, residuals and
    routing-weight dtypes, with and without device rows, one and several feature tiles."""
    pytest.importorskip("triton")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pdflash.offload.host_graph import moe_residual

    g = torch.Generator().manual_seed(11)
    for R, K, H in ((1, 4, 2880), (3, 2, 80)):
        for x_dtype in (torch.bfloat16, torch.float32):
            for c_dtype in (torch.bfloat16, torch.float32):
                for has_c in (True, False):
                    x = torch.randn(1, R, H, generator=g).to(x_dtype).to(device)
                    up = (torch.randn(R * K, H, generator=g) * 3).to(device)
                    up[: K][:, :7] = 0.0  # rows the CPU left zero
                    c = (torch.randn(R * K, H, generator=g) * 3).to(c_dtype).to(device) if has_c else None
                    rows = c.clone().add_(up) if has_c else up.to(c_dtype)
                    want = x + rows.view(R, K, H).sum(dim=1).to(x_dtype).view_as(x)
                    got = moe_residual(x, c, up, c_dtype, K)
                    assert got.dtype == x_dtype and got.shape == x.shape
                    assert torch.equal(got, want), (R, K, H, x_dtype, c_dtype, has_c)
