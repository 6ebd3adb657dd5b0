"""--link-gbps on CUDA: the cuda backend paces real copies to the link rate (an emulated link).

Without a GPU the cuda backend runs over native/stress/fake_cudart.c (a CUDA runtime stand-in in
host memory, compiled here), and the runtime and CLI are checked through their own seams. The
tests marked ``gpu`` copy real bytes host -> device.
"""

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import pdflash.native as native
from pdflash import PdflashError
from pdflash.native import Band, Scheduler, SchedulerError, WaitStatus, make_key
from pdflash.offload import runtime
from pdflash.offload.config import ModelPreset
from pdflash.offload.synthetic import write_checkpoint

MiB = 1 << 20
TINY = ModelPreset.from_name("tiny")
PROMPT = "The router keeps the best experts for every token"
FAKE_SRC = Path(__file__).resolve().parent.parent / "native" / "stress" / "fake_cudart.c"


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("link") / "mx", TINY, seed=41, mxfp4=True)


@pytest.fixture(scope="module")
def fake_cudart(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake CUDA runtime")
    out = tmp_path_factory.mktemp("fake_cudart") / "libfake_cudart.so"
    subprocess.run([cc, "-std=c11", "-O1", "-shared", "-fPIC", "-o", str(out), str(FAKE_SRC)], check=True,
                   capture_output=True, timeout=120)
    return str(out)


@pytest.fixture
def fake_cuda(fake_cudart, monkeypatch):
    """Scheduler(backend="cuda") opens the fake runtime; dst is then host memory given by address."""
    monkeypatch.setattr(native, "_find_cudart", lambda: fake_cudart)
    return fake_cudart


def _copy_tasks(s: Scheduler, src: torch.Tensor, dst_addr: int, tasks: int) -> float:
    """Copy src to dst in `tasks` on-demand tasks; returns the seconds from first submit to last end."""
    n = src.numel() // tasks
    t0 = time.perf_counter()
    tickets = [s.submit(make_key(9, i), src[i * n:(i + 1) * n], dst_addr + i * n, priority=Band.ON_DEMAND)
               for i in range(tasks)]
    assert all(s.wait(t, timeout=120) is WaitStatus.DONE for t in tickets)
    return time.perf_counter() - t0


# -- without a GPU: the cuda backend over the fake runtime ---------------------------------------


def test_cuda_backend_accepts_link_gbps_and_paces_to_it(fake_cuda):
    """8 MiB at 0.5 GB/s with two workers: never faster than the link, bytes exact, and the link
    statistic is the slots' sum (what the cost model reads as the link rate)."""
    gbps, total = 0.5, 8 * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    with Scheduler(backend="cuda", workers=2, link_gbps=gbps, chunk_bytes=256 << 10) as s:
        assert s.backend == "cuda" and s.link_gbps == gbps
        took = _copy_tasks(s, src, dst.data_ptr(), 8)
        st = s.stats()
        moved, busy = s.link_totals()
    link_s = total / (gbps * 1e9)
    assert torch.equal(src, dst)
    assert took >= 0.99 * link_s, f"{total} bytes in {took * 1e3:.2f} ms, the link needs {link_s * 1e3:.2f} ms"
    assert took < 4 * link_s
    assert moved == total and busy == pytest.approx(link_s, rel=1e-3)
    assert st["chunks"] == total // (256 << 10)


def test_cuda_backend_without_link_gbps_is_not_paced(fake_cuda):
    total = 8 * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    with Scheduler(backend="cuda", workers=2, chunk_bytes=256 << 10) as s:
        took = _copy_tasks(s, src, dst.data_ptr(), 8)
    assert torch.equal(src, dst)
    assert took < total / 0.5e9  # far faster than the 0.5 GB/s the paced test takes


def test_close_does_not_wait_out_a_paced_slot(fake_cuda):
    """A 1 MiB chunk on a 0.001 GB/s link holds its slot for about a second: the bytes are in dst
    at once, the task is pending until the slot ends, and close() returns well before that."""
    src = torch.randint(0, 256, (MiB,), dtype=torch.uint8)
    dst = torch.zeros(MiB, dtype=torch.uint8)
    s = Scheduler(backend="cuda", workers=1, link_gbps=0.001, chunk_bytes=MiB)
    try:
        t = s.submit(make_key(1, 1), src, dst.data_ptr(), priority=Band.ON_DEMAND)
        deadline = time.monotonic() + 10
        while s.stats()["chunks"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)
        assert s.query(t) is WaitStatus.PENDING
        assert torch.equal(src, dst)
    finally:
        t0 = time.perf_counter()
        s.close()
        assert time.perf_counter() - t0 < 0.5


def test_link_gbps_is_still_range_checked_on_the_cuda_backend(fake_cuda):
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(SchedulerError, match="link_gbps"):
            Scheduler(backend="cuda", link_gbps=bad)


# -- without a GPU: the runtime and the CLI ----------------------------------------------------


def test_runtime_passes_link_gbps_to_the_cuda_scheduler(ck, monkeypatch):
    """OffloadedModel.load on CUDA no longer refuses link_gbps: it reaches the cuda Scheduler."""
    seen = {}

    class Recorder:
        def __init__(self, **kw):
            seen.update(kw)
            raise SchedulerError("recorded")

    host_store = runtime.HostStore
    monkeypatch.setattr(runtime, "resolve_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(runtime, "HostStore", lambda layout, L, E, pin: host_store(layout, L, E, pin=False))
    monkeypatch.setattr(runtime, "Scheduler", Recorder)
    with pytest.raises(PdflashError, match="fetch scheduler: recorded"):
        runtime.OffloadedModel.load(ck, device="cuda", link_gbps=25.0, expert_cache_experts=4)
    assert seen["backend"] == "cuda" and seen["link_gbps"] == 25.0


def test_runtime_range_check_on_cuda_is_bad_usage(ck, monkeypatch):
    monkeypatch.setattr(runtime, "resolve_device", lambda d: torch.device("cuda", 0))
    for bad in (0.0, 2e4, float("nan")):
        with pytest.raises(PdflashError, match="--link-gbps must be between") as exc:
            runtime.OffloadedModel.load(ck, device="cuda", link_gbps=bad)
        assert exc.value.exit_code == 2


def test_generate_cuda_link_gbps_out_of_range_exits_2(ck, run):
    code, out, err = run("generate", PROMPT, "--model", ck, "--device", "cuda", "--link-gbps", "20000")
    assert code == 2 and "--link-gbps must be between" in err and out == ""


def test_link_gbps_help_names_both_devices(run, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # each option's help on one line of the box
    code, out, _ = run("generate", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "On CUDA: pace the real copies" in text and "On the CPU: simulate" in text


def test_cpu_report_has_the_link_fields_and_no_emulation(ck, run):
    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 2, "--expert-cache-experts", 4,
                         "--link-gbps", 2, "--json", "--device", "cpu", "--no-draft")
    assert code == 0, err
    report = json.loads(out)
    assert report["link_gbps"] == 2.0 and report["link_emulated"] is False


def test_summary_prints_the_emulated_link(ck, run, capsys, monkeypatch):
    from pdflash.cli.generate import _print_summary

    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 2, "--json", "--device", "cpu",
                         "--no-draft")
    assert code == 0, err
    report = json.loads(out)
    assert report["link_gbps"] is None and report["link_emulated"] is False
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    _print_summary(report)
    assert "emulated link" not in capsys.readouterr().out
    _print_summary(dict(report, link_gbps=25.0, link_emulated=True))  # what a CUDA run with --link-gbps 25 reports
    row = [line for line in capsys.readouterr().out.splitlines() if "emulated link" in line]
    assert len(row) == 1 and "25 GB/s" in row[0]


# -- with a GPU: real copies -------------------------------------------------------------------


def _gpu_copy_rate(link_gbps, total=256 * MiB, tasks=8):
    src = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    with Scheduler(backend="cuda", workers=2, link_gbps=link_gbps) as s:
        warm = s.submit(make_key(0, 0), src[:MiB], dst[:MiB], priority=Band.ON_DEMAND)  # streams warmed up
        assert s.wait(warm, timeout=60) is WaitStatus.DONE
        s.reset()
        n = total // tasks
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tickets = [s.submit(make_key(1, i), src[i * n:(i + 1) * n], dst[i * n:(i + 1) * n], priority=Band.ON_DEMAND)
                   for i in range(tasks)]
        assert all(s.wait(t, timeout=120) is WaitStatus.DONE for t in tickets)
        took = time.perf_counter() - t0
        moved, busy = s.link_totals()
    plain = src.to("cuda")
    assert torch.equal(dst, plain)  # the same bytes as a plain copy
    return total / took, moved, busy, took


@pytest.mark.gpu
def test_cuda_copies_paced_to_link_gbps():
    """256 MiB pinned host -> device in 8 tasks, 2 workers, link_gbps=5: about 5 GB/s, not the
    real link's rate; the link statistic counts the paced time."""
    rate, moved, busy, took = _gpu_copy_rate(5.0)
    assert 0.7 * 5e9 <= rate <= 1.05 * 5e9, f"measured {rate / 1e9:.2f} GB/s against link_gbps=5"
    assert moved == 256 * MiB and busy == pytest.approx(moved / 5e9, rel=1e-3)
    assert busy <= took * 1.01


@pytest.mark.gpu
def test_cuda_copies_without_link_gbps_are_unpaced():
    rate, moved, busy, took = _gpu_copy_rate(None)
    assert rate > 1.3 * 5e9, f"unpaced copies ran at {rate / 1e9:.2f} GB/s"
    assert moved == 256 * MiB and 0 < busy <= took * 1.01


@pytest.mark.gpu
def test_offloaded_model_reports_the_emulated_link(ck):
    from pdflash.offload.generate import generate

    with runtime.OffloadedModel.load(ck, device="cuda", link_gbps=5.0, expert_cache_experts=4) as rt:
        generate(rt, [5, 77, 200, 31], max_new_tokens=3, eos_token_ids=[])
        st = rt.stats()
        assert st["link_emulated"] is True and st["link_gbps"] == 5.0
        assert rt.scheduler.backend == "cuda" and rt.scheduler.link_gbps == 5.0
        if st["bytes_moved"]:
            assert st["bytes_moved"] / st["link_busy_seconds"] == pytest.approx(5e9, rel=0.05)
