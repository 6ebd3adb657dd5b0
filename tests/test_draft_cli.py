"""Command-line use of the draft: `pdflash make-synthetic --draft-preset` writes a pair that loads
and decodes losslessly; bad draft input is one clear line and a non-zero exit."""

import json
import subprocess
import sys

import pytest
import torch

from pdflash.draft import greedy_generate, load_draft, make_oracle, speculative_generate


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pdflash(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pdflash.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_clean_error(proc, message):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], proc.stderr


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = pdflash("make-synthetic", out, "--preset", "tiny", "--dtype", "float32", "--draft-preset", "tiny", "--json")
    assert proc.returncode == 0, proc.stderr
    return out, json.loads(proc.stdout)


def test_make_synthetic_writes_a_fitted_draft_that_decodes_losslessly(written):
    from transformers import GptOssForCausalLM

    out, info = written
    assert info["draft"]["path"] == str(out / "draft") and info["draft"]["block_size"] == 4
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "draft").iterdir()}
    target = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    draft = load_draft(out / "draft", target)
    prompt = [3, 17, 41, 5, 99, 12, 7, 250, 31, 8, 64]
    want = greedy_generate(target, prompt, 20)
    assert speculative_generate(target, draft, prompt, 20).token_ids == want
    oracle = make_oracle(target, prompt, 20, 0.8, reference=want)
    assert speculative_generate(target, draft, prompt, 20, oracle=oracle).token_ids == want


def test_bad_draft_preset_is_one_line(tmp_path):
    assert_clean_error(pdflash("make-synthetic", tmp_path / "x", "--draft-preset", "bogus"), "unknown draft preset")
    proc = pdflash("make-synthetic", tmp_path / "y", "--preset", "tiny", "--draft-preset", "gpt-oss-20b-DFlash")
    assert_clean_error(proc, "hidden size 2880 does not match the target's 64")
    assert not (tmp_path / "y").exists()  # refused before writing anything
