"""Command-line use of the draft: `pdflash make-synthetic --draft-preset` writes a pair that loads
and decodes losslessly; bad draft input is one clear line and a non-zero exit."""

import json
import subprocess
import sys

import pytest
import torch

from pdflash.draft import greedy_generate, load_draft, make_oracle, speculative_generate
from references import gpt_oss_reference  # noqa: E402



def pdflash(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pdflash.cli.main", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def assert_clean_error(proc, message, code=1):
    assert proc.returncode == code, proc.stderr
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

    out, info = written
    assert info["draft"]["path"] == str(out / "draft") and info["draft"]["block_size"] == 4
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "draft").iterdir()}
    target = gpt_oss_reference(out, dtype=torch.float32).eval()
    draft = load_draft(out / "draft", target)
    prompt = [3, 17, 41, 5, 99, 12, 7, 250, 31, 8, 64]
    want = greedy_generate(target, prompt, 20)
    assert speculative_generate(target, draft, prompt, 20).token_ids == want
    oracle = make_oracle(target, prompt, 20, 0.8, reference=want)
    assert speculative_generate(target, draft, prompt, 20, oracle=oracle).token_ids == want


def test_make_synthetic_shape_overrides(tmp_path):
    """--layers / --experts / --vocab: a short gpt-oss-20b-wide model that loads and decodes."""
    out = tmp_path / "short"
    proc = pdflash("make-synthetic", out, "--preset", "tiny", "--layers", "3", "--experts", "5", "--vocab", "300",
                   "--draft-preset", "tiny", "--draft-block-size", "6", "--draft-layers", "1", "--draft-intermediate", "24",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert (info["layers"], info["experts_per_layer"], info["vocab"]) == (3, 5, 300)
    dcfg = json.loads((out / "draft" / "config.json").read_text())
    assert (info["draft"]["block_size"], info["draft"]["layers"], info["draft"]["intermediate_size"]) == (6, 1, 24)
    assert (dcfg["block_size"], dcfg["num_hidden_layers"], dcfg["intermediate_size"], len(dcfg["layer_types"])) == (6, 1, 24, 1)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["vocab_size"], len(cfg["layer_types"])) == (3, 5, 300, 3)
    proc = pdflash("generate", "hi", "--model", out, "--max-new-tokens", "3", "--json", "--draft", out / "draft",
                   "--block-size", "6")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 3


def test_bad_draft_preset_is_one_line(tmp_path):
    assert_clean_error(pdflash("make-synthetic", tmp_path / "x", "--draft-preset", "bogus"), "unknown draft preset", 2)
    proc = pdflash("make-synthetic", tmp_path / "y", "--preset", "tiny", "--draft-preset", "gpt-oss-20b-DFlash")
    assert_clean_error(proc, "hidden size 2880 does not match the target's 64")
    assert not (tmp_path / "y").exists()  # refused before writing anything


# -- pdflash generate --draft -------------------------------------------------------------------

PROMPT = "The router keeps the best experts for every token"


@pytest.fixture(scope="module")
def mx_pair(tmp_path_factory):
    from pdflash.draft import write_synthetic_draft
    from pdflash.offload.config import ModelPreset
    from pdflash.offload.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("gen")
    write_checkpoint(root / "target", ModelPreset.from_name("tiny"), mxfp4=True, seed=5)
    write_synthetic_draft(root / "draft", "tiny", target_dir=root / "target", seed=6)
    return root


def _gen(run, root, *extra):
    return run("generate", PROMPT, "--model", root / "target", "--device", "cpu", "--max-new-tokens", 14,
               "--no-live", *extra)


def test_generate_with_draft_is_lossless_and_reports_speculation(run, mx_pair):
    code, out, err = _gen(run, mx_pair, "--json")
    assert code == 0, err
    plain = json.loads(out)
    code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--block-size", 3,
                          "--expert-cache-experts", 6)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["block_size"] == 3 and spec["verify_steps"] >= 1 and spec["acceptance_length"] >= 1.0
    assert len(spec["acceptance_per_position"]) == 2 and spec["draft_ms"] >= 0 and spec["verify_ms"] > 0
    assert spec["cache"]["slots"] == 6 and "oracle_acceptance" not in spec
    assert spec["route_ahead"] is None  # the default predictor is none (draft.offloaded.DEFAULT_PREDICTOR)
    assert spec["draft_pass"] == "native"  # a small float32 draft on the CPU runs through pf_draft.c
    code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--block-size", 3,
                          "--expert-cache-experts", 6, "--route-ahead-predictor", "previous")
    assert code == 0, err
    prev = json.loads(out)
    assert prev["token_ids"] == plain["token_ids"]
    ra = prev["route_ahead"]
    assert ra["predictor"] == "previous" and {"predicted", "used", "recall", "precision", "wasted_bytes"} <= set(ra)
    assert spec["copied_steps"] >= 0
    code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--block-size", 3,
                          "--expert-cache-experts", 6, "--no-prompt-lookup")
    assert code == 0, err
    off = json.loads(out)
    assert off["token_ids"] == plain["token_ids"] and off["copied_steps"] == 0
    for spelled in ("auto", "AUTO"):  # the default, spelled out: the planner
        code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--block-size", spelled,
                              "--expert-cache-experts", 8)
        assert code == 0, err
        auto = json.loads(out)
        assert auto["block_size"] == "auto" and auto["token_ids"] == plain["token_ids"] and "planner" in auto
        assert auto["planner"]["shadow_probes"] <= auto["planner"]["probes"]
        fp = auto["planner"]["fetch_prediction"]  # which fetch prediction priced the blocks, and both errors
        assert fp["mode"] == "best" and fp["in_use"] in ("route", "mean")
    code, out, err = _gen(run, mx_pair, "--draft", mx_pair / "draft", "--expert-cache-experts", 8)
    assert code == 0, err
    assert "planner probes" in out and "shadow" in out  # the table names the probes of each kind
    assert "fetch priced by" in out


def test_oracle_acceptance_mode_is_labelled_everywhere(run, mx_pair):
    code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--draft-acceptance", 0.7,
                          "--route-ahead-predictor", "none")
    assert code == 0, err
    report = json.loads(out)
    assert report["oracle_acceptance"] == 0.7 and report["route_ahead"] is None
    assert "oracle-acceptance mode" in err
    code, out, err = _gen(run, mx_pair, "--draft", mx_pair / "draft", "--draft-acceptance", 1.0)
    assert code == 0, err
    assert "ORACLE ACCEPTANCE" in out and "acceptance length" in out


@pytest.mark.parametrize("args, code, message", [
    (("--block-size", 0), 2, "--block-size must be at least 1"),
    (("--block-size", 5), 1, "between 1 and the draft's trained block size 4"),
    (("--route-ahead-predictor", "psychic"), 2, "unknown route-ahead predictor"),
    (("--draft-acceptance", 1.5), 2, "between 0 and 1"),
    (("--draft-acceptance", 0.5, "--temperature", 0.7), 2, "needs greedy decoding"),
])
def test_bad_draft_options(run, mx_pair, args, code, message):
    got, out, err = _gen(run, mx_pair, "--draft", mx_pair / "draft", *args)
    assert got == code and out == ""
    assert err.strip().startswith("Error: ") and message in err and "Traceback" not in err


def test_draft_options_without_a_draft_and_bad_drafts(run, mx_pair, tmp_path):
    got, _, err = _gen(run, mx_pair, "--block-size", 2)
    assert got == 2 and "--block-size only applies to speculative decoding" in err
    got, _, err = _gen(run, mx_pair, "--draft", tmp_path / "missing")
    assert got == 1 and "does not exist" in err and "Traceback" not in err
    wrong = tmp_path / "wide"
    wrong.mkdir()
    raw = json.loads((mx_pair / "draft" / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**raw, "hidden_size": 128}))
    got, _, err = _gen(run, mx_pair, "--draft", wrong)
    assert got == 1 and "hidden size 128 does not match the target's 64" in err
    assert len(err.strip().splitlines()) == 1


def test_trace_writes_a_line_per_step(run, mx_pair, tmp_path):
    """--trace: one JSON line per verify pass (speculative) or per token (plain), whose blocks and
    commits add up to the run's own report; a path that cannot be written is refused up front."""
    path = tmp_path / "steps.jsonl"
    code, out, err = _gen(run, mx_pair, "--json", "--draft", mx_pair / "draft", "--block-size", 3,
                          "--expert-cache-experts", 6, "--trace", path)
    assert code == 0, err
    rep = json.loads(out)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == rep["verify_steps"] and [r["step"] for r in lines] == list(range(1, len(lines) + 1))
    assert sum(r["committed"] for r in lines) == rep["generated_tokens"] - 1  # the first token is the prompt's
    assert sum(r["accepted"] for r in lines) == sum(r["committed"] for r in lines) - len(lines)
    assert lines[0]["block"] == 3 and all(r["block"] <= 3 for r in lines) and lines[0]["step_ms"] is None
    assert all(r["step_ms"] >= r["verify_ms"] > 0 for r in lines[1:])
    assert abs(sum(r["verify_ms"] for r in lines) - rep["verify_ms"]) < 1e-2 * len(lines)
    code, out, err = _gen(run, mx_pair, "--json", "--trace", path)  # plain: a line per generated token
    assert code == 0, err
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["token"] for r in lines] == json.loads(out)["token_ids"]
    assert all(r["step_ms"] > 0 for r in lines[1:])
    for bad, message in ((tmp_path, "is a directory"), (tmp_path / "missing" / "t.jsonl", "cannot write --trace")):
        code, out, err = _gen(run, mx_pair, "--trace", bad)
        assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    kept = path.read_text()  # a run that fails before decoding leaves an earlier trace as it was
    code, out, err = _gen(run, mx_pair, "--trace", path, "--max-new-tokens", 10**6)
    assert code != 0 and path.read_text() == kept
