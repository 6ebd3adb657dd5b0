"""Distil a DFlash draft from a trained gpt-oss target (phase 4 of train_embedded.py).

Data is the target's own greedy output: prompts are windows of the training corpus, continued
greedily by the (MXFP4-rounded) target, so a block's labels are exactly what greedy verification
accepts. For every sequence the target's features (outputs of decoder layers
``target_layer_ids``) are captured with the same hook the runtime uses (draft.taps.FeatureTap).

Training uses a batched form of the draft forward of draft/model.py: many blocks per sequence,
each block [x_a, MASK x (B-1)] at positions a .. a+B-1 attends, non-causally, to the projected
context of positions < a and to its own block, exactly what inference computes for a block
starting after a committed tokens. The draft's layers, norms and rotary are the model's own
modules; only the batching and the mask are written here.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pdflash.draft.config import DFlashConfig, TargetShape, spread_layer_ids
from pdflash.draft.model import DFlashDraftModel, _apply_rotary
from pdflash.draft.taps import FeatureTap


def draft_config(target, args, mask_id: int) -> DFlashConfig:
    shape = TargetShape.from_config(target.config)
    return DFlashConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=args.draft_intermediate,
        num_hidden_layers=args.draft_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        block_size=args.block_size,
        mask_token_id=mask_id,
        target_layer_ids=spread_layer_ids(shape.num_hidden_layers, args.draft_features),
        num_target_layers=shape.num_hidden_layers,
        rms_norm_eps=shape.rms_norm_eps,
        attention_bias=True,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters=dict(shape.rope_parameters),
        dtype="bfloat16",
    )


@torch.no_grad()
def make_sequences(target, train_ids, n_seq: int, prompt_len: int, gen_len: int, batch: int, seed: int, device, log):
    """[n_seq, prompt_len + gen_len] token ids: corpus prompts continued greedily by the target."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    t0 = time.time()
    for i in range(0, n_seq, batch):
        nb = min(batch, n_seq - i)
        starts = torch.randint(0, train_ids.numel() - prompt_len - 1, (nb,), generator=gen)
        ids = (train_ids[starts[:, None] + torch.arange(prompt_len)[None]]).long().to(device)
        cache = DynamicCache()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            seq = [ids]
            for _ in range(gen_len):
                nxt = logits.argmax(-1, keepdim=True)
                seq.append(nxt)
                logits = target(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        out.append(torch.cat(seq, dim=1).cpu())
        log(f"draft data: {i + nb}/{n_seq} sequences ({time.time() - t0:.0f}s)")
    return torch.cat(out)


@torch.no_grad()
def target_features(target, seqs, layer_ids, batch: int, device) -> torch.Tensor:
    """[N, T, K*H] bf16 features of every position, as the runtime's FeatureTap sees them."""
    feats = []
    with FeatureTap(target, layer_ids) as tap:
        for i in range(0, seqs.shape[0], batch):
            x = seqs[i : i + batch].to(device)
            with tap.capture(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                target.model(input_ids=x)
            feats.append(tap.take().to(torch.bfloat16))
    return torch.cat(feats)


def block_forward(draft: DFlashDraftModel, feats, seqs, anchors, block: int):
    """Batched training forward. feats [N, T, K*H], seqs [N, T], anchors [M] (same for the batch).

    Returns logits [N, M, B-1, V] for the masked positions a+1 .. a+B-1 of every block.
    """
    cfg = draft.config
    n, t = seqs.shape
    m = anchors.numel()
    dev = feats.device
    dtype = draft.fc.weight.dtype
    ctx = draft.hidden_norm(draft.fc(feats.to(dtype)))  # [N, T, H]
    ids = torch.full((n, m, block), cfg.mask_token_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = seqs[:, anchors]
    x = draft.embed_tokens(ids.view(n, m * block)).to(dtype)  # [N, MB, H]
    pos_blk = (anchors[:, None] + torch.arange(block, device=dev)[None]).reshape(-1)  # [MB]
    pos_ctx = torch.arange(t, device=dev)
    cos_b, sin_b = draft.rotary_emb(x, pos_blk[None])
    cos_c, sin_c = draft.rotary_emb(x, pos_ctx[None])
    # mask [MB, T + MB]: block j sees context < a_j and its own block
    blk_of = torch.arange(m, device=dev).repeat_interleave(block)
    see_ctx = pos_ctx[None, :] < anchors[blk_of][:, None]
    see_blk = blk_of[:, None] == blk_of[None, :]
    mask = torch.cat((see_ctx, see_blk), dim=1)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in draft.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = _apply_rotary(att.q_norm(att.q_proj(h).view(n, m * block, hq, d)).transpose(1, 2), cos_b, sin_b)
        kb = _apply_rotary(att.k_norm(att.k_proj(h).view(n, m * block, hkv, d)).transpose(1, 2), cos_b, sin_b)
        vb = att.v_proj(h).view(n, m * block, hkv, d).transpose(1, 2)
        kc = _apply_rotary(att.k_norm(att.k_proj(ctx).view(n, t, hkv, d)).transpose(1, 2), cos_c, sin_c)
        vc = att.v_proj(ctx).view(n, t, hkv, d).transpose(1, 2)
        k = torch.cat((kc, kb), dim=2).repeat_interleave(hq // hkv, dim=1)
        v = torch.cat((vc, vb), dim=2).repeat_interleave(hq // hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + att.o_proj(o.transpose(1, 2).reshape(n, m * block, hq * d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = draft.norm(x).view(n, m, block, -1)[:, :, 1:]
    return draft.lm_head(x)  # [N, M, B-1, V]


def train_draft(target, train_ids, held_ids, out: Path, args, device, log) -> dict:
    """Train, save and evaluate the draft; returns the record for training.json."""
    from safetensors.torch import save_file

    from pdflash.draft.speculative import speculative_generate

    target.eval().requires_grad_(False)
    mask_id = 1  # "<|mask|>" in train_embedded's tokenizer specials
    cfg = draft_config(target, args, mask_id)
    torch.manual_seed(args.seed + 7)
    draft = DFlashDraftModel(cfg, target.model.embed_tokens, target.lm_head).to(device)
    draft.requires_grad_(True)
    budget = args.draft_minutes * 60
    t0 = time.time()

    prompt_len, gen_len = 64, args.draft_gen_len
    seqs = make_sequences(target, train_ids, args.draft_sequences, prompt_len, gen_len, args.draft_gen_batch, args.seed, device, log)
    feats = target_features(target, seqs, cfg.target_layer_ids, 64, device)
    seqs = seqs.to(device)
    data_s = time.time() - t0
    log(f"draft data ready: {tuple(seqs.shape)} tokens, features {tuple(feats.shape)} ({data_s:.0f}s)")

    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.draft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    b = cfg.block_size
    weights = torch.exp(-torch.arange(b - 1, dtype=torch.float32, device=device) / (b / 2))  # early positions count more
    weights = weights / weights.sum()
    gen = torch.Generator().manual_seed(args.seed + 11)
    curve = []
    step = 0
    t_train = time.time()
    n_total = seqs.shape[0]
    lo, hi = prompt_len, seqs.shape[1] - b  # anchors inside the generated region
    while step < args.draft_max_steps and time.time() - t0 < budget:
        idx = torch.randint(0, n_total, (args.draft_batch,), generator=gen).to(device)
        anchors = torch.randint(lo, hi, (args.draft_anchors,), generator=gen).to(device)
        for g in opt.param_groups:
            frac = max(step / args.draft_max_steps, (time.time() - t_train) / max(1.0, budget - data_s))
            g["lr"] = args.draft_lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = block_forward(draft, feats[idx], seqs[idx], anchors, b).float()  # [N, M, B-1, V]
        labels = seqs[idx][:, anchors[:, None] + torch.arange(1, b, device=device)[None]]  # [N, M, B-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(*labels.shape) * weights).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0:
            with torch.no_grad():
                acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            curve.append({"step": step, "seconds": round(time.time() - t_train, 2), "loss": round(loss.item(), 4),
                          "token_accuracy_by_position": [round(a, 3) for a in acc.tolist()]})
            log(f"draft step {step} loss {loss.item():.3f} acc@1 {acc[0].item():.2f} ({time.time() - t0:.0f}s)")
        step += 1
    wall = time.time() - t0
    draft.eval().requires_grad_(False)

    (out / "draft").mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in draft.state_dict().items()}
    save_file(state, str(out / "draft" / "model.safetensors"), metadata={"format": "pt"})
    (out / "draft" / "config.json").write_text(cfg.to_json())

    # quick acceptance check on held-out prompts with the project's own speculative loop
    accept = []
    gen_eval = torch.Generator().manual_seed(args.seed + 13)
    for _ in range(8):
        s = int(torch.randint(0, held_ids.numel() - 65, (1,), generator=gen_eval))
        prompt = held_ids[s : s + 64].tolist()
        res = speculative_generate(target, draft, prompt, 64)
        accept.append(res.stats.acceptance_length)
    return {
        "config": cfg.to_dict(),
        "sequences": int(seqs.shape[0]),
        "sequence_length": int(seqs.shape[1]),
        "data_seconds": round(data_s, 1),
        "steps": step,
        "wall_seconds": round(wall, 1),
        "loss_curve": curve,
        "held_out_acceptance_length": round(sum(accept) / len(accept), 3),
        "held_out_acceptance_by_prompt": [round(a, 3) for a in accept],
    }


def add_arguments(ap) -> None:
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-intermediate", type=int, default=512)
    ap.add_argument("--draft-features", type=int, default=4, help="number of target layers read")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--draft-sequences", type=int, default=2048)
    ap.add_argument("--draft-gen-len", type=int, default=192)
    ap.add_argument("--draft-gen-batch", type=int, default=256)
    ap.add_argument("--draft-batch", type=int, default=32)
    ap.add_argument("--draft-anchors", type=int, default=16)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--draft-max-steps", type=int, default=3000)

