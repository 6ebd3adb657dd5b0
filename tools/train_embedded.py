"""Train the small model pair that ships with pdflash (the embedded default).

    python tools/train_embedded.py --out models/stdlib-moe --device cuda \
        --target-minutes 4 --draft-minutes 4

    python tools/train_embedded.py --draft-only --target-dir models/stdlib-moe --out OUT

The second form retrains only the draft (phase 4) against a shipped target: the target is loaded
from ``--target-dir`` as pdflash's peers loader builds it (transformers' GptOssForCausalLM, MXFP4
experts dequantized, bf16), the corpus is split and encoded with that directory's tokenizer, and
``OUT/draft/`` plus ``OUT/training.json`` (the target directory's record with its ``draft``
section replaced) are written. Nothing else in ``--target-dir`` is touched unless OUT is it.

Phases, each recorded in ``<out>/training.json`` (corpus, steps, loss curve, wall time):

1. corpus: the ``.py`` files of this Python's standard library, a fixed 2 % of files (chosen
   by a hash of their relative path) held out for evaluation;
2. tokenizer: a byte-level BPE (``tokenizers``) trained on the training files;
3. target: a gpt-oss-architecture MoE (transformers' own GptOssForCausalLM: sinks, sliding
   window, top-k routed experts) trained from scratch, then its experts stored in MXFP4 like
   gpt-oss-20b; held-out loss measured before and after quantization;
4. draft: a DFlash block-diffusion drafter distilled on the quantized target's own greedy
   outputs and hidden states (see ``train_draft``).

Everything is seeded. The result loads with pdflash's normal loaders, on CPU or GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]


# ---- corpus ---------------------------------------------------------------------------------
def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    return root, files


def is_held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 50 == 0  # 2 % of files


def read_corpus(max_file_bytes: int = 200_000) -> tuple[list[str], list[str], dict]:
    root, files = stdlib_files()
    train, held, names = [], [], []
    total = 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip() or len(text) > max_file_bytes:
            continue
        rel = str(p.relative_to(root))
        (held if is_held_out(rel) else train).append(text)
        names.append(rel)
        total += len(text)
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
    info = {
        "source": f"Python {sysconfig.get_python_version()} standard library (*.py under {root})",
        "files": len(names),
        "train_files": len(train),
        "held_out_files": len(held),
        "characters": total,
        "file_list_sha256_16": digest,
    }
    return train, held, info


# ---- tokenizer ---------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>",
                "mask_token": "<|mask|>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return tok


def encode_all(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# ---- target ------------------------------------------------------------------------------------
def target_config(vocab_size: int, args) -> "GptOssConfig":
    from transformers import GptOssConfig

    n = args.layers
    return GptOssConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=n,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        sliding_window=args.sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        router_aux_loss_coef=args.aux_loss,
        output_router_logits=False,
        eos_token_id=0,
        pad_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **({"experts_implementation": args.experts_impl} if args.experts_impl else {}),
    )


def batches(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator, device):
    n = data.numel() - seq - 1
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        yield data[idx].long().to(device, non_blocking=True)


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, seq: int, device, max_windows: int = 256) -> float:
    """Mean next-token cross-entropy (nats) over non-overlapping held-out windows."""
    model.eval()
    windows = data[: (data.numel() // (seq + 1)) * (seq + 1)].view(-1, seq + 1)[:max_windows].long()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], 32):
        x = windows[i : i + 32].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def lr_at(step: int, total: int, peak: float, warmup: int, time_fraction: float = 0.0) -> float:
    """Linear warm-up, then cosine to 10 % of peak over whichever runs out first: steps or time."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_fraction))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(train_ids, held_ids, vocab_size: int, args, device, log) -> tuple[object, dict]:
    from transformers import GptOssForCausalLM

    torch.manual_seed(args.seed)
    cfg = target_config(vocab_size, args)
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg).to(device)
    try:  # probe: the default expert kernel of this transformers / torch / device
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(input_ids=train_ids[:64].long().view(2, 32).to(device)).logits.float().sum().backward()
        model.zero_grad(set_to_none=True)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log(f"default expert kernel failed ({exc}); training with the eager expert loop")
        args.experts_impl = "eager"
        cfg = target_config(vocab_size, args)
        cfg._attn_implementation = "eager"
        torch.manual_seed(args.seed)
        model = GptOssForCausalLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.seq, args.batch, gen, device)
    budget = args.target_minutes * 60
    est_steps = args.max_steps
    curve = []
    t0 = time.time()
    step = 0
    model.train()
    while step < args.max_steps and time.time() - t0 < budget:
        x = next(data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, est_steps, args.lr, args.warmup, (time.time() - t0) / budget)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=x[:, :-1], output_router_logits=args.aux_loss > 0)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        total = loss + (args.aux_loss * out.aux_loss if getattr(out, "aux_loss", None) is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            curve.append({"step": step, "seconds": round(time.time() - t0, 2), "loss": round(loss.item(), 4)})
            log(f"target step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
        step += 1
    wall = time.time() - t0
    model.eval()
    record = {
        "config": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "experts", "top_k", "sliding_window", "seq", "batch", "lr", "aux_loss")},
        "steps": step,
        "tokens_seen": step * args.batch * args.seq,
        "wall_seconds": round(wall, 1),
        "loss_curve": curve,
        "held_out_loss_bf16": held_out_loss(model, held_ids, args.seq, device),
    }
    return model, record


def quantize_experts_inplace(model) -> None:
    """Round every expert weight to MXFP4 (what the shipped checkpoint stores)."""
    from pdflash.offload.mxfp4 import dequantize, quantize

    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            blocks, scales = quantize(p.data.float())
            p.data.copy_(dequantize(blocks, scales, torch.float32).to(p.dtype))


def save_target(model, out: Path, shard_bytes: int = 9_000_000) -> None:
    """Write the target as a gpt-oss MXFP4 checkpoint (experts as blocks / scales, rest bf16),
    in shards of at most ``shard_bytes`` with a model.safetensors.index.json like the hub's."""
    from safetensors.torch import save_file

    from pdflash.offload.mxfp4 import quantize

    tensors = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name and not name.endswith("_bias") or (
            ".mlp.experts.down_proj" in name and not name.endswith("_bias")
        ):
            blocks, scales = quantize(t.float().cpu())
            tensors[name + "_blocks"] = blocks.contiguous()
            tensors[name + "_scales"] = scales.contiguous()
        else:
            tensors[name] = t.detach().to(torch.bfloat16).cpu().contiguous()
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    cfg = model.config.to_dict()
    cfg["architectures"] = ["GptOssForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg["output_router_logits"] = False
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    for k in list(cfg):
        if k.startswith("_") or k in ("transformers_version", "experts_implementation", "attn_implementation"):
            cfg.pop(k)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))


# ---- draft only -------------------------------------------------------------------------------
TARGET_FILES = ("config.json", "tokenizer.json", "training.json")


def draft_only_problem(args) -> str | None:
    """What stops ``--draft-only`` before any work, or None."""
    if args.target_dir is None:
        return "--draft-only needs --target-dir DIR (a trained target with its tokenizer.json and training.json)"
    missing = [name for name in TARGET_FILES if not (args.target_dir / name).is_file()]
    if not any((args.target_dir / name).is_file() for name in ("model.safetensors.index.json", "model.safetensors")):
        missing.append("model.safetensors(.index.json)")
    if missing:
        return f"--target-dir {args.target_dir} lacks {', '.join(missing)}"
    if args.draft_minutes <= 0:
        return "--draft-only needs --draft-minutes above 0"
    return None


def retrain_draft(args, device, log) -> dict:
    """Phase 4 alone against the target in ``args.target_dir``; returns the new training record."""
    import transformers
    from tokenizers import Tokenizer

    from pdflash.bench.peers import load_transformers_reference
    from train_draft import train_draft  # tools/train_draft.py

    t0 = time.time()
    record = json.loads((args.target_dir / "training.json").read_text())
    train_texts, held_texts, corpus = read_corpus()
    tok = Tokenizer.from_file(str(args.target_dir / "tokenizer.json"))
    train_ids, held_ids = encode_all(tok, train_texts), encode_all(tok, held_texts)
    log(f"corpus: {corpus}; {train_ids.numel()} train / {held_ids.numel()} held-out tokens ({time.time() - t0:.0f}s)")
    same = (corpus.get("file_list_sha256_16") == record.get("corpus", {}).get("file_list_sha256_16")
            and train_ids.numel() == record.get("tokenizer", {}).get("train_tokens"))
    if not same:
        log("warning: this corpus differs from the one the target was trained on (recorded in draft.corpus)")
    target = load_transformers_reference(args.target_dir, device, torch.bfloat16, experts_implementation=args.experts_impl)
    log(f"target loaded from {args.target_dir} ({time.time() - t0:.0f}s)")
    draft = train_draft(target, train_ids, held_ids, args.out, args, device, log)
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = shlex.join(["python3", *sys.argv])
    draft = {
        "note": f"the draft was retrained alone on {when} against the shipped target (tools/train_embedded.py "
                f"--draft-only); the seed, device, corpus, tokenizer and target sections are those of the original run",
        "date": when,
        "command": command,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "software": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "wall_seconds_total": round(time.time() - t0, 1),
        **({} if same else {"corpus": {**corpus, "train_tokens": int(train_ids.numel()), "held_out_tokens": int(held_ids.numel())}}),
        **draft,
    }
    return {**record, "draft": draft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draft-only", action="store_true", help="retrain only the draft of the target in --target-dir")
    ap.add_argument("--target-dir", type=Path, default=None, help="trained target for --draft-only (e.g. models/stdlib-moe)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--sliding-window", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--aux-loss", type=float, default=0.01)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--target-minutes", type=float, default=4.0)
    ap.add_argument("--draft-minutes", type=float, default=4.0, help="cap on draft data + training")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--experts-impl", default=None, help="transformers experts implementation (default: its own)")
    from train_draft import add_arguments, argument_problem  # tools/train_draft.py

    add_arguments(ap)
    args = ap.parse_args()
    problem = argument_problem(args) or (draft_only_problem(args) if args.draft_only else None)
    if problem:
        print(f"train_embedded: {problem}", file=sys.stderr)
        raise SystemExit(2)

    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"train_embedded: --device {args.device!r} is not a torch device (cpu, cuda, cuda:0, ...)", file=sys.stderr)
        raise SystemExit(2)
    random.seed(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.draft_only:
        from pdflash import PdflashError

        try:
            record = retrain_draft(args, device, log)
        except PdflashError as exc:
            print(f"train_embedded: {exc}", file=sys.stderr)
            raise SystemExit(1)
        (out / "training.json").write_text(json.dumps(record, indent=2))
        log(f"done in {record['draft']['wall_seconds_total']}s -> {out / 'draft'}, {out / 'training.json'}")
        return

    record: dict = {"seed": args.seed, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    t0 = time.time()
    train_texts, held_texts, record["corpus"] = read_corpus()
    log(f"corpus: {record['corpus']}")
    tok = train_tokenizer(train_texts, args.vocab, out)
    train_ids, held_ids = encode_all(tok, train_texts), encode_all(tok, held_texts)
    record["tokenizer"] = {"type": "byte-level BPE", "vocab_size": tok.get_vocab_size(), "train_tokens": int(train_ids.numel()), "held_out_tokens": int(held_ids.numel())}
    log(f"tokenizer: {record['tokenizer']} ({time.time() - t0:.0f}s)")

    model, record["target"] = train_target(train_ids, held_ids, tok.get_vocab_size(), args, device, log)
    quantize_experts_inplace(model)
    record["target"]["held_out_loss_mxfp4"] = held_out_loss(model, held_ids, args.seq, device)
    log(f"held-out loss: bf16 {record['target']['held_out_loss_bf16']:.3f}, mxfp4 {record['target']['held_out_loss_mxfp4']:.3f}")
    save_target(model, out)

    if args.draft_minutes > 0:
        from train_draft import train_draft  # noqa: E402  (tools/train_draft.py)

        record["draft"] = train_draft(model, train_ids, held_ids, out, args, device, log)
    record["wall_seconds_total"] = round(time.time() - t0, 1)
    (out / "training.json").write_text(json.dumps(record, indent=2))
    log(f"done in {record['wall_seconds_total']}s -> {out}")


if __name__ == "__main__":
    main()
