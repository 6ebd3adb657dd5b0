"""The embedded model pair that ships with pdflash: it loads, speculation is lossless, the draft helps."""

import json
import subprocess
import sys

import pytest

from pdflash.draft import load_draft
from pdflash.draft.speculative import greedy_generate, speculative_generate
from pdflash.offload.embedded import embedded_draft, embedded_target
from pdflash.offload.runtime import OffloadedModel

PROMPT = "class Node:\n    def __init__(self, value):\n"


@pytest.fixture(scope="module")
def runtime():
    with OffloadedModel.load(embedded_target(), device="cpu", expert_cache_experts=64) as rt:
        yield rt


def test_embedded_pair_is_lossless_and_accepts(runtime):
    draft = load_draft(embedded_draft(), runtime.model)
    ids = runtime.tokenizer.encode(PROMPT)
    spec = speculative_generate(runtime.model, draft, ids, 32)
    runtime.reset_cache()
    plain = greedy_generate(runtime.model, ids, 32)
    assert spec.token_ids == list(plain)[: len(spec.token_ids)]
    assert len(spec.token_ids) == 32
    assert spec.stats.acceptance_length > 1.0  # the draft's proposals are accepted, not just bonus tokens


@pytest.mark.parametrize("prompt", [PROMPT, "The river flows"])
def test_embedded_pair_auto_block_size_is_lossless(runtime, prompt):
    from pdflash.draft.offloaded import speculative_on_runtime

    draft = load_draft(embedded_draft(), runtime.model)
    ids = runtime.tokenizer.encode(prompt)
    runtime.reset_cache()
    plain = greedy_generate(runtime.model, ids, 40)
    runtime.reset_cache()
    spec = speculative_on_runtime(runtime, draft, ids, 40, block_size="auto", eos_token_ids=[])
    assert spec.token_ids == list(plain)
    rep = spec.planner
    assert sum(rep["block_histogram"].values()) == spec.stats.verify_steps
    assert spec.stats.block_histogram() == rep["block_histogram"] and spec.stats.bytes_per_committed_token is not None


def test_every_block_length_is_exact_in_float32_where_bf16_rounds_a_near_tie_apart():
    """In bf16 the 13th token after "Once upon a time" is a near-tie (top two logits one bf16 step
    apart) that verify blocks of 5-8 rows round the other way than a single-token step. In float32
    every block length gives plain greedy decoding's tokens (docs/benchmarks.md, session 20)."""
    with OffloadedModel.load(embedded_target(), device="cpu", expert_cache_experts=64, dtype="float32") as rt:
        draft = load_draft(embedded_draft(), rt.model)
        ids = rt.tokenizer.encode("Once upon a time")
        plain = list(greedy_generate(rt.model, ids, 20))
        for block in range(2, draft.config.block_size + 1):
            rt.reset_cache()
            assert speculative_generate(rt.model, draft, ids, 20, block_size=block).token_ids == plain, block


def test_embedded_target_is_a_gpt_oss_mxfp4_checkpoint():
    cfg = json.loads((embedded_target() / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert cfg["num_local_experts"] >= 16 and cfg["num_experts_per_tok"] >= 2
    size = sum(p.stat().st_size for p in embedded_target().rglob("*") if p.is_file())
    assert size < 25_000_000  # the repository stays light


def test_generate_without_model_uses_the_embedded_pair():
    out = subprocess.run(
        [sys.executable, "-m", "pdflash.cli.main", "generate", PROMPT, "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["model"].endswith("stdlib-moe") and report["draft"].endswith("draft")
    assert len(report["token_ids"]) == 8 and report["acceptance_length"] >= 1.0


def test_no_draft_and_draft_together_is_refused(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdflash.cli.main", "generate", PROMPT, "--draft", str(tmp_path), "--no-draft"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("Error:") and "Traceback" not in out.stderr
