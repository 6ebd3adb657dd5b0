"""`pdflash generate` through the real entry point (main's error handling): output and bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pdflash.offload.config import ModelPreset
from pdflash.offload.synthetic import write_checkpoint
from references import gpt_oss_reference  # noqa: E402

TINY = ModelPreset.from_name("tiny")
PROMPT = "The router keeps the best experts for every token"


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "mx", TINY, seed=31, mxfp4=True)


def _reference_tokens(path, prompt_ids, n):

    model = gpt_oss_reference(path, dtype=torch.bfloat16)
    gen = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return gen[0, len(prompt_ids):].tolist()


def test_json_output_matches_transformers(ck, run):
    from transformers import AutoTokenizer

    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 10, "--expert-cache-experts", 3,
                         "--lookahead-depth", 1, "--json", "--device", "cpu")
    assert code == 0, err
    report = json.loads(out)  # exactly one JSON object on stdout
    prompt_ids = AutoTokenizer.from_pretrained(ck)(PROMPT).input_ids
    assert report["token_ids"] == _reference_tokens(ck, prompt_ids, 10)
    assert report["prompt_tokens"] == len(prompt_ids)
    for key in ("text", "tokens_per_second", "ttft_ms", "tpot_ms", "exposed_fetch_seconds"):
        assert key in report
    assert {"hits", "misses", "hit_rate"} <= set(report["cache"])
    assert [b["name"] for b in report["bands"]] == ["on-demand", "route-ahead", "background"]
    for b in report["bands"]:
        assert {"band", "name", "submitted", "completed", "stall_seconds", "queue_wait_seconds", "bytes"} <= set(b)
    assert report["cache"]["slots"] == 3 and report["bytes_moved"] > 0


def test_all_resident_by_default_and_stdin_prompt(ck, run):
    code, out, err = run("generate", "-", "--model", ck, "--max-new-tokens", 4, "--json", "--cpu-experts", "off",
                         stdin=PROMPT + "\n")
    assert code == 0, err
    report = json.loads(out)
    assert report["cache"]["slots"] == TINY.num_hidden_layers * TINY.num_local_experts
    assert report["exposed_fetch_seconds"] == 0.0 and report["cache"]["misses"] == 0  # preloaded
    assert report["cpu_experts"]["mode"] == "off" and report["experts_per_token"]["cpu"] == 0


def test_cpu_device_computes_experts_natively_by_default(ck, run):
    """On the CPU device, with no cache size or simulated link, every expert is computed by the
    native kernel from host memory; the greedy tokens are still transformers' own."""
    from transformers import AutoTokenizer

    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 8, "--json", "--device", "cpu",
                         "--cpu-threads", 2)
    assert code == 0, err
    report = json.loads(out)
    prompt_ids = AutoTokenizer.from_pretrained(ck)(PROMPT).input_ids
    assert report["token_ids"] == _reference_tokens(ck, prompt_ids, 8)
    ce, ept = report["cpu_experts"], report["experts_per_token"]
    assert ce["mode"] == "all" and ce["threads"] == 2 and ce["computed"] > 0 and ce["seconds"] > 0
    assert ept["cache"] == ept["fetched"] == 0 and ept["cpu"] > 0 and report["bytes_moved"] == 0
    # an offload experiment (a cache size) keeps the cache path
    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 2, "--json", "--device", "cpu",
                         "--expert-cache-experts", 4)
    assert code == 0, err
    assert json.loads(out)["cpu_experts"]["mode"] == "off"
    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 2, "--device", "cpu",
                         "--cpu-experts", "all", "--expert-cache-experts", 4, "--no-live")
    assert code == 0, err
    assert "experts/token: cache, fetched, cpu" in out


def test_table_reports_the_hybrid_guard(ck, run, capsys):
    """On CUDA auto's guard decides; the summary table says which arm it keeps and what each
    measured (the CPU device has no guard: its auto is all, or off for an offload experiment, so
    the guard's stats are set on a real CPU report here)."""
    from pdflash.cli.generate import _print_summary, _threads_text, _timeline_text

    code, out, err = run("generate", PROMPT, "--model", ck, "--max-new-tokens", 2, "--json", "--device", "cpu",
                         "--cpu-threads", 1)
    assert code == 0, err
    report = json.loads(out)
    assert report["cpu_experts"]["guard"] is None
    report["cpu_experts"]["guard"] = {"arm": "all", "host_path": True, "checks": 2, "full_checks": 1, "off_ms": 43.55,
                                      "all_ms": 31.36, "model_ms": 44.52, "host_ms": None, "hold_steps": 128}
    _print_summary(report)
    text = capsys.readouterr().out
    assert "hybrid guard" in text and "kept all after 2 check(s)" in text
    assert "off 43.5" in text and "all 31.4" in text and "host" not in text.split("hybrid guard")[1].split("\n")[0]
    report["cpu_experts"]["host_timeline_ms"] = {"split": {"steps": 47, "step": 27.97, "head": 0.43, "node": 17.22,
                                                           "kernel": 11.84, "fetch_wait": 4.38, "gaps": 9.78,
                                                           "tail": 0.55}}
    _print_summary(report)
    assert "host steps (split), ms each" in capsys.readouterr().out  # the row (its text wraps in the table)
    line = _timeline_text(report["cpu_experts"]["host_timeline_ms"]["split"])
    assert line == ("27.97 over 47 steps: host nodes 17.22 (CPU kernel 11.84, fetch wait 4.38), device between "
                    "nodes 9.78, launch and end 0.98")
    assert _threads_text({"threads": 14, "fetch_threads": 12}) == "14 threads, 12 beside fetches"
    assert _threads_text({"threads": 2, "fetch_threads": 2}) == _threads_text({"threads": 2}) == "2 threads"
    with_books = dict(report["cpu_experts"]["host_timeline_ms"]["split"], bookkeeping=0.41)
    assert _timeline_text(with_books) == line + "; bookkeeping after it 0.41"
    report["cpu_experts"]["guard"].update(checks=0, arm="off", off_ms=None, all_ms=None, model_ms=None)
    _print_summary(report)
    assert "no check completed yet" in capsys.readouterr().out


def test_cpu_experts_bad_values(ck, run):
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--cpu-experts", "some", "--device", "cpu")[::2])
    assert "--cpu-experts" in line and "auto" in line
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--cpu-experts", "all", "--lookahead-depth", 1,
                                "--device", "cpu")[::2])
    assert "fetches nothing" in line
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--history-depth", 2, "--device", "cpu")[::2])
    assert "every expert is computed from host memory (--cpu-experts auto)" in line and "--cpu-experts off" in line
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--cpu-experts", "all", "--dtype", "float16",
                                "--device", "cpu")[::2])
    assert "float16" in line


def test_chat_template_and_table_output(ck, run):
    code, out, err = run("generate", "hi", "--model", ck, "--max-new-tokens", 3, "--chat", "--no-live")
    assert code == 0, err
    assert "tokens/s (decode)" in out and "cache hit rate" in out
    code, out, _ = run("generate", "hi", "--model", ck, "--max-new-tokens", 3, "--chat", "--json")
    plain = json.loads(run("generate", "hi", "--model", ck, "--max-new-tokens", 3, "--json")[1])
    assert json.loads(out)["prompt_tokens"] > plain["prompt_tokens"]


# -- bad input: one line on stderr, non-zero exit, no traceback ----------------------------------------
def _one_error_line(code, err, expect_code=1):
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == expect_code
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err
    return lines[0]


def _copy(ck, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(ck, dst)
    return dst


def test_missing_directory(run, tmp_path):
    line = _one_error_line(*run("generate", PROMPT, "--model", tmp_path / "none")[::2])
    assert "no such directory" in line


def test_malformed_config(run, ck, tmp_path):
    d = _copy(ck, tmp_path)
    (d / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _one_error_line(*run("generate", PROMPT, "--model", d)[::2])


def test_unsupported_architecture(run, ck, tmp_path):
    d = _copy(ck, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    assert "unsupported model" in _one_error_line(*run("generate", PROMPT, "--model", d)[::2])


def test_truncated_safetensors(run, ck, tmp_path):
    d = _copy(ck, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert "not a readable safetensors file" in _one_error_line(*run("generate", PROMPT, "--model", d)[::2])


def test_missing_tensor(run, ck, tmp_path):
    d = _copy(ck, tmp_path)
    f = d / "model.safetensors"
    with safe_open(str(f), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if k != "model.layers.3.mlp.experts.down_proj_blocks"}
    save_file(tensors, str(f))
    assert "down_proj_blocks is missing" in _one_error_line(*run("generate", PROMPT, "--model", d)[::2])


def test_cache_below_minimum(run, ck):
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--expert-cache-experts", 1)[::2])
    assert "the minimum is 2" in line
    line = _one_error_line(*run("generate", PROMPT, "--model", ck, "--expert-cache-mib", 0.001)[::2])
    assert "holds 0 experts" in line


def test_empty_prompt(run, ck):
    assert "prompt is empty" in _one_error_line(*run("generate", "", "--model", ck)[::2])
    assert "prompt is empty" in _one_error_line(*run("generate", "-", "--model", ck, stdin="  \n")[::2])


def test_no_tokenizer(run, ck, tmp_path):
    d = _copy(ck, tmp_path)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()
    assert "no tokenizer files" in _one_error_line(*run("generate", PROMPT, "--model", d)[::2])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_requested_without_cuda(run, ck):
    assert "no CUDA device" in _one_error_line(*run("generate", PROMPT, "--model", ck, "--device", "cuda")[::2])


def test_console_entry_point_end_to_end(ck):
    """The installed command in a fresh process: stdin prompt, JSON on stdout, nothing else there."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run(
        [sys.executable, "-m", "pdflash.cli.main", "generate", "-", "--model", str(ck), "--max-new-tokens", "3",
         "--expert-cache-experts", "4", "--link-gbps", "1", "--json"],
        input=PROMPT, capture_output=True, text=True, timeout=300, env=env,
    )
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert len(report["token_ids"]) == 3 and report["bytes_moved"] > 0
    bad = subprocess.run([sys.executable, "-m", "pdflash.cli.main", "generate", "x", "--model", "/nonexistent/dir"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("Error: ") and "Traceback" not in bad.stderr


def test_live_table_places_the_host_steps_so_far():
    """The live table's host-step column: mean ms per step inside the host nodes and between
    them, every mode's steps together; nothing before the first host step."""
    from pdflash.cli.generate import _live_timeline
    from pdflash.offload.stats import FetchStats

    fs = FetchStats(num_layers=2)
    assert _live_timeline(fs) == ""
    parts = dict(step=0.02, head=0.001, kernel=0.01, fetch_wait=0.0, tail=0.001)
    fs.add_host_step("host", {**parts, "node": 0.012, "gaps": 0.006})
    fs.add_host_step("all", {**parts, "node": 0.016, "gaps": 0.004})
    assert _live_timeline(fs) == " (14.0 ms in nodes, 5.0 between, per step)"
    assert fs.host_timeline_ms()["host"]["node"] == pytest.approx(12.0)
    fs.add_host_step("split", {**parts, "node": 0.010, "gaps": 0.009})
    assert fs.host_step_mean_s("gaps", ("split",)) == pytest.approx(0.009)  # one mode's steps alone
    assert fs.host_step_mean_s("gaps", ("host", "split")) == pytest.approx(0.0075)
    assert fs.host_step_mean_s("gaps") == pytest.approx(0.019 / 3)
    assert fs.host_step_mean_s("gaps", ("other",)) is None
