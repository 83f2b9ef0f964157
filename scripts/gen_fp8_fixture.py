#!/usr/bin/env python3
"""Builds fixtures/tiny-gqa-fp8: tiny-gqa-f32 in the public Qwen/DeepSeek "fine-grained" FP8 form.

Every decoder-layer linear weight (attention q/k/v/o, GDN in_proj_qkv/in_proj_z/out_proj, MLP
gate/up/down) and the MTP linears (mtp.fc, mtp.layers.0.*) become
  `<name>`            F8_E4M3 [N, K]            (torch.float8_e4m3fn, round-to-nearest-even)
  `<name>_scale_inv`  F32 [ceil(N/128), ceil(K/128)]   one scale per 128x128 block
with value = float(q) * scale_inv[n // 128][k // 128] and scale_inv = amax(block) / 448
(exactly what Qwen3 FP8 / DeepSeek-V3 checkpoints store). Everything else (embeddings, lm_head,
norms, GDN in_proj_a/in_proj_b/conv1d/A_log/dt_bias) stays F32. model.visual.* is dropped.
config.json gets quantization_config {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}.

oracle.safetensors: `ids` [1, 64] i64 (the first 64 ids of tiny-gqa-f32's oracle) and `logits`
[1, 64, V] f32: HF transformers (eager, f32, use_cache=False) on tiny-gqa-f32 whose FP8'd weights
were replaced by their DEQUANTIZED values float(q) * scale_inv, so an engine that reads the FP8
file exactly must match to f32 rounding (~1e-5).

Usage (needs torch with float8, transformers, safetensors; CI does not run this):
    HF_HUB_OFFLINE=1 /work/venv/bin/python scripts/gen_fp8_fixture.py [fixtures]
"""
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

root = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
src = os.path.join(root, "tiny-gqa-f32")
dst = os.path.join(root, "tiny-gqa-fp8")
os.makedirs(dst, exist_ok=True)
torch.manual_seed(0)
torch.set_num_threads(2)
B = 128
FP8_MAX = 448.0
LINEARS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
           "in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight",
           "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def is_fp8(name):
    if name.startswith("model.visual."):
        return False
    return name == "mtp.fc.weight" or name.endswith(LINEARS)


def quantize_blocks(w):
    """w [N, K] f32 -> (q fp8 [N, K], scale_inv f32 [ceil(N/B), ceil(K/B)], dequantized f32)."""
    n, k = w.shape
    gn, gk = -(-n // B), -(-k // B)
    pad = torch.zeros(gn * B, gk * B, dtype=torch.float32)
    pad[:n, :k] = w
    blocks = pad.view(gn, B, gk, B).abs().amax(dim=(1, 3))
    scale_inv = torch.where(blocks > 0, blocks / FP8_MAX, torch.ones_like(blocks))
    full = scale_inv.repeat_interleave(B, 0).repeat_interleave(B, 1)[:n, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    deq = q.to(torch.float32) * full
    return q, scale_inv.contiguous(), deq


tensors = load_file(os.path.join(src, "model.safetensors"))
out, deq_of = {}, {}
for name, t in sorted(tensors.items()):
    if name.startswith("model.visual."):
        continue
    if is_fp8(name):
        q, s, deq = quantize_blocks(t.to(torch.float32))
        out[name] = q.contiguous()
        out[name + "_scale_inv"] = s
        deq_of[name] = deq
    else:
        out[name] = t.contiguous()
save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})

cfg = json.load(open(os.path.join(src, "config.json")))
cfg["quantization_config"] = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [B, B],
}
json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2, sort_keys=True)
shutil.copy(os.path.join(src, "generation_config.json"), dst)

# Reference: HF on the dequantized weights.
model = Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
model.config._attn_implementation = "eager"
model.config.text_config._attn_implementation = "eager"
params = dict(model.named_parameters())
replaced = 0
with torch.no_grad():
    for name, deq in deq_of.items():
        if name in params:
            assert params[name].shape == deq.shape, name
            params[name].copy_(deq)
            replaced += 1
oracle = load_file(os.path.join(src, "oracle.safetensors"))
ids = oracle["ids"][:, :64].contiguous()
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits.to(torch.float32).contiguous()
    base = Qwen3_5ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    base.config._attn_implementation = "eager"
    base_logits = base(input_ids=ids, use_cache=False).logits
save_file({"ids": ids, "logits": logits}, os.path.join(dst, "oracle.safetensors"))
n_fp8 = len(deq_of)
print(f"{n_fp8} FP8 tensors ({replaced} in the HF model, the rest are mtp.*); "
      f"max |logits(fp8) - logits(f32)| = {(logits - base_logits).abs().max().item():.3e}; "
      f"|logits|max = {logits.abs().max().item():.3f}")
with open(os.path.join(dst, "names.txt"), "w") as f:
    for name, t in sorted(out.items()):
        f.write(f"{name}\t{list(t.shape)}\t{str(t.dtype).replace('torch.', '')}\n")
