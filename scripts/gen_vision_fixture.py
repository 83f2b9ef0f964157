#!/usr/bin/env python3
"""Generate the tiny vision-language fixture `fixtures/tiny-vl/` with HF transformers (CPU).

Usage:
    HF_HUB_OFFLINE=1 /work/venv/bin/python scripts/gen_vision_fixture.py fixtures/tiny-vl

Needs torch, transformers (>= 5.x, Qwen3_5*), safetensors and Pillow (no torchvision: the
processor is HF's PIL backend of the Qwen2-VL image processor, which Qwen3.5's
`Qwen3VLProcessor` uses; PIL bicubic resize, rescale 1/255, normalise with mean/std, patchify).

Writes into OUT:
  config.json, generation_config.json   save_pretrained of a tiny random
                                        Qwen3_5ForConditionalGeneration (F32) with a vision tower
  model.safetensors                     HF naming (model.language_model.*, model.visual.*, lm_head)
  preprocessor_config.json              Qwen2VLImageProcessor settings (patch 16, merge 2,
                                        temporal 2, mean/std 0.5, small min/max pixels)
  img_a.png .. img_d.png                deterministic generated RGB images (see IMAGES)
  img_e.jpg, img_f.webp                 lossy/other formats, decode-only checks (no oracle)
  oracle.safetensors:
    rgb.e, rgb.f [h, w, 3] u8           Pillow's decode of img_e.jpg / img_f.webp
    pix.<k> [n_patches, 1536] f32       processor pixel_values of image k (k = a, b, c, d)
    grid.<k> [3] i64                    image_grid_thw of image k (t, h, w in patches)
    vis.<k> [n_patches/4, out_hidden]   vision tower output (merger) of image k alone
    vis_ab [.., out_hidden]             the tower run on images a and b packed together
    ids [1, T] i64                      prompt: text, <vs> <pad>*n_a <ve>, text, <vs> <pad>*n_b <ve>, text
    positions [3, T] i64                get_rope_index(ids, image grids a, b)
    rope_delta [1] i64                  its mrope_position_deltas
    logits [1, T, V] f32                Qwen3_5ForConditionalGeneration(ids, pixel_values a+b)
    gen [1, T+8] i64                    HF greedy generate (cache on), 8 new tokens, eos disabled
Deterministic: seeded, 2 threads.
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

torch.manual_seed(0)
torch.set_num_threads(2)
out = sys.argv[1] if len(sys.argv) > 1 else "fixtures/tiny-vl"
os.makedirs(out, exist_ok=True)

VOCAB = 256
VS, VE, IMG, VID = 248, 249, 250, 251

text_config = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
    max_position_embeddings=4096, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1], mrope_interleaved=True),
    attn_output_gate=True, output_gate_type="swish", eos_token_id=0,
)
# 8x8 learned position grid: every test image's patch grid (4..8 per side) resamples it.
vision_config = dict(
    depth=2, hidden_size=64, intermediate_size=96, num_heads=4, in_channels=3, patch_size=16,
    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=64,
    hidden_act="gelu_pytorch_tanh",
)
config = Qwen3_5Config(text_config=text_config, vision_config=vision_config,
                       tie_word_embeddings=False, image_token_id=IMG, video_token_id=VID,
                       vision_start_token_id=VS, vision_end_token_id=VE)
config._attn_implementation = "eager"
config.text_config._attn_implementation = "eager"
config.vision_config._attn_implementation = "eager"
model = Qwen3_5ForConditionalGeneration(config).eval().float()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)
        elif p.ndim == 1:
            base = 1.0 if (name.endswith("linear_attn.norm.weight")
                           or (".visual." in name and "norm" in name and name.endswith("weight"))) else 0.0
            p.copy_(torch.randn_like(p) * 0.1 + base)
        elif name.endswith("pos_embed.weight"):
            p.copy_(torch.randn_like(p) * 0.5)
        else:
            p.copy_(torch.randn_like(p) * 0.08)
model.save_pretrained(out, safe_serialization=True)
model = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
model.config._attn_implementation = "eager"
model.config.text_config._attn_implementation = "eager"
model.config.vision_config._attn_implementation = "eager"
model.model.visual.config._attn_implementation = "eager"

# ------------------------------------------------------------------ images
rng = np.random.default_rng(7)


def make_image(w, h, seed):
    """Smooth gradients + a few rectangles + mild noise: resampling is exercised, not flat."""
    r = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([
        128 + 100 * np.sin(x / (5 + seed) + y / 11),
        128 + 100 * np.cos(y / (7 + seed) - x / 13),
        (x * 255 / max(w - 1, 1) + y * 90 / max(h - 1, 1)) % 256,
    ], axis=-1)
    for _ in range(4):
        x0, y0 = r.integers(0, w - 4), r.integers(0, h - 4)
        img[y0:y0 + r.integers(3, h // 2), x0:x0 + r.integers(3, w // 2)] = r.integers(0, 256, 3)
    img += r.normal(0, 6, img.shape)
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")


# (width, height): a, b are multiples of 32 (identity resize); c rounds (up in height, down in
# width); d exceeds max_pixels (the beta downscale branch, antialiased); RGBA (alpha dropped).
IMAGES = {"a": (64, 64, 1), "b": (96, 64, 2), "c": (75, 50, 3), "d": (300, 170, 4)}
imgs = {}
for k, (w, h, s) in IMAGES.items():
    im = make_image(w, h, s)
    if k == "d":
        im = im.convert("RGBA")
        a = np.array(im)
        a[..., 3] = (np.arange(w)[None, :] * 255 // w).astype(np.uint8)
        im = Image.fromarray(a, "RGBA")
    im.save(os.path.join(out, f"img_{k}.png"), optimize=True)
    imgs[k] = Image.open(os.path.join(out, f"img_{k}.png"))
make_image(48, 40, 5).save(os.path.join(out, "img_e.jpg"), quality=90)
make_image(40, 24, 6).save(os.path.join(out, "img_f.webp"), lossless=True)

proc_cfg = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 12},
}
with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
    json.dump(proc_cfg, f, indent=2)
proc = Qwen2VLImageProcessorPil(**{k: v for k, v in proc_cfg.items() if k != "image_processor_type"})

oracle = {}
# PIL's decode of the JPEG and the lossless WebP (RGB8), to measure our decoders against.
for k, f in (("e", "img_e.jpg"), ("f", "img_f.webp")):
    oracle[f"rgb.{k}"] = torch.from_numpy(np.array(Image.open(os.path.join(out, f)).convert("RGB")))
pix, grids = {}, {}
for k in IMAGES:
    r = proc(images=[imgs[k]], return_tensors="pt")
    pix[k] = r["pixel_values"].float().contiguous()
    grids[k] = r["image_grid_thw"][0].long()
    oracle[f"pix.{k}"] = pix[k]
    oracle[f"grid.{k}"] = grids[k].contiguous()
    print(k, IMAGES[k][:2], "->", grids[k].tolist(), tuple(pix[k].shape))

with torch.no_grad():
    vis = model.model.visual
    for k in IMAGES:
        o = vis(pix[k], grid_thw=grids[k][None]).pooler_output
        oracle[f"vis.{k}"] = o.contiguous()
    pab = torch.cat([pix["a"], pix["b"]])
    gab = torch.stack([grids["a"], grids["b"]])
    oracle["vis_ab"] = vis(pab, grid_thw=gab).pooler_output.contiguous()

    # ------------------------------------------------------------ multimodal prompt
    def n_tokens(g):
        return int(g.prod()) // 4

    g = torch.Generator().manual_seed(11)
    txt = lambda n: torch.randint(1, VS, (n,), generator=g).tolist()
    ids = (txt(5) + [VS] + [IMG] * n_tokens(grids["a"]) + [VE] + txt(3) + [VS]
           + [IMG] * n_tokens(grids["b"]) + [VE] + txt(4))
    ids = torch.tensor([ids], dtype=torch.long)
    mm = (ids == IMG).int()
    pos, delta = model.model.get_rope_index(ids, mm, image_grid_thw=gab)
    oracle["ids"] = ids
    oracle["positions"] = pos[:, 0, :].contiguous()
    oracle["rope_delta"] = delta.reshape(1).long()
    logits = model(input_ids=ids, pixel_values=pab, image_grid_thw=gab,
                   mm_token_type_ids=mm, use_cache=False).logits
    oracle["logits"] = logits.float().contiguous()
    # Greedy continuation with the cache: decode positions continue at max position + 1.
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pab,
                         image_grid_thw=gab, mm_token_type_ids=mm, max_new_tokens=8,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    oracle["gen"] = gen.contiguous()
    print("gen", gen[0, ids.shape[1]:].tolist())
    print("prompt", ids.shape[1], "positions max", int(pos.max()), "delta", int(delta))

save_file({k: v.contiguous() for k, v in oracle.items()}, os.path.join(out, "oracle.safetensors"))
total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
print("fixture bytes", total)
assert total < 3 * 1024 * 1024, total
