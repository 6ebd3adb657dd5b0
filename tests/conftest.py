"""Suite-wide settings and fixtures."""

import io
import os
import sys

# Triton (when installed) runs kernels through its CPU interpreter in this suite. It decides
# that when triton.language is first imported, so this comes before anything imports it.
# pdflash itself uses Triton on the CPU only with PDFLASH_FUSED_EXPERTS=1 (tests/test_fused_experts.py).
os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0 on a GPU runs the compiled kernels

import pytest
import torch

from pdflash.cli.main import main


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it. ``pytest -m gpu`` selects them all."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread: the suite shares two cores, and no result depends on the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def run(monkeypatch, capsys):
    """Run `pdflash ARGS` in this process through cli.main.main(); returns (exit code, stdout, stderr)."""

    def _run(*args, stdin=None):
        monkeypatch.setattr(sys, "argv", ["pdflash", *map(str, args)])
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture(scope="session")
def load_script():
    """Import a script of the repository (benchmarks/, tools/) by its path: load_script("tools/x.py")."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def _load(rel: str):
        path = root / rel
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return _load


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """DIR with a tiny MXFP4 gpt-oss target in bf16 (DIR/target) and a synthetic DFlash draft
    fitted to it (DIR/draft). Shared: tests read it and write nothing into it."""
    from pdflash.draft import write_synthetic_draft
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    out = tmp_path_factory.mktemp("tiny_pair")
    write_checkpoint(out / "target", ModelPreset.from_name("tiny"), mxfp4=True, dtype="bfloat16")
    write_synthetic_draft(out / "draft", "tiny", target_dir=out / "target", seed=2)
    return out
