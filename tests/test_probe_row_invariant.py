"""benchmarks/probe_row_invariant_linear.py on the CPU (Triton's interpreter, reduced shapes): its
16-row kernel computes the products and rounds every row alike whatever the row count."""

import json

import pytest
import torch

pytest.importorskip("triton")


def test_the_row_kernel_is_row_invariant_and_computes_the_product(load_script, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    mod = load_script("benchmarks/probe_row_invariant_linear.py")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(50, 45, generator=g), torch.randn(50, generator=g)
    x = torch.randn(5, 45, generator=g)
    y = mod.rows_linear(x, w, b)
    assert torch.allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(y[i], mod.rows_linear(x[i:i + 1], w, b)[0]) for i in range(5))
    assert torch.allclose(mod.rows_linear(x, w, None), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        mod.rows_linear(torch.randn(17, 45), w, b)

    out = tmp_path / "ril.json"
    assert mod.main(["--device", "cpu", "--dtype", "float32", "--scale", "64", "--rows", "1,3", "--iters", "1",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["products"]) == {"q", "k", "v", "o", "router", "head"}
    assert res["summary"]["rows_invariant_everywhere"] is True
    assert set(res["summary"]["step_dense_us"]) == {"1", "3"}
    for p in res["products"].values():
        assert all(v["rows_vs_torch"] < 1e-4 for v in p["rows"].values())
    for bad in (["--rows", "0"], ["--rows", "17"], ["--rows", "x"], ["--iters", "0"], ["--preset", "nope"]):
        with pytest.raises(SystemExit):
            mod.main(["--device", "cpu", "--out", str(out), *bad])
