#!/usr/bin/env python3
"""Generate tiny random Qwen3.5/3.8 reference fixtures with HF transformers (CPU, deterministic).

Usage:
    HF_HUB_OFFLINE=1 /work/venv/bin/python scripts/gen_fixtures.py fixtures

The venv needs torch, transformers (>= 5.x, with Qwen3_5*), safetensors, tokenizers.
Every fixture is a folder OUT/<name>/ with:
  config.json            as save_pretrained writes it (tiny-mha-tied-bf16: edited, see below)
  generation_config.json as save_pretrained writes it
  model.safetensors      HF checkpoint naming + our mtp.* tensors (TinyMTP, vLLM/SGLang naming)
  oracle.safetensors     reference outputs (f32 floats, i64 ids), computed from the model as
                         reloaded from disk with from_pretrained(dtype=float32)
  names.txt              tensor name / shape / dtype list of model.safetensors
and tiny-gqa-f32 also has tokenizer.json + tokenizer_config.json (ChatML template).

Fixtures
--------
tiny-gqa-f32        Qwen3_5ForConditionalGeneration, hidden 128, vocab 512, explicit
                    layer_types [linear x3, full], 6 q heads / 1 kv head x 64, GDN 2 k-heads /
                    6 v-heads x 32, untied (lm_head.weight stored), F32, tiny vision tower.
tiny-mha-tied-bf16  Qwen3_5ForConditionalGeneration, hidden 64, vocab 384, 4 layers built from
                    full_attention_interval=2 ([linear, full, linear, full]); config.json has NO
                    layer_types key (we delete it: save_pretrained writes the expanded list and
                    drops full_attention_interval, which __post_init__ pops) but has
                    full_attention_interval: 2. MHA 4/4 heads x 32, rotary 8 (mrope [2,1,1]),
                    GDN 2 k-heads x 16 / 4 v-heads x 32 (DK != DV), tied embeddings
                    (no lm_head.weight stored), every tensor stored BF16. References are computed
                    in float32 from the bf16 weights (exact upcast).
tiny-bare-text      bare Qwen3_5TextConfig (model_type qwen3_5_text) / Qwen3_5ForCausalLM, hidden 64,
                    vocab 256, explicit layer_types [linear x3, full], GQA 4/2 x 32, GDN 2/4 x 16,
                    untied, F32, no vision. With transformers 5.24 the saved names are
                    (checked and asserted below):
                      model.embed_tokens.weight, model.norm.weight, model.layers.{i}.*,
                      lm_head.weight, plus our mtp.*  (no `language_model`, no `model.visual.*`).

oracle.safetensors tensors (all fixtures)
-----------------------------------------
ids [1,320] i64                 random ids (seeded)
logits [1,320,V]                one full forward, use_cache=False (chunked GDN, 5 chunks of 64)
logits_incremental [1,320,V]    prefill ids[:, :200] with cache, then 120 single-token steps
hidden.{0..L} [1,320,H]         output_hidden_states: [0] embeddings, [i] residual after layer
                                i-1 (i<L), [L] = final-norm output (what lm_head sees)
hidden.last_layer_raw [1,320,H] residual after the last layer, before the final norm
mtp_hidden [1,319,H]            TinyMTP output (after mtp.norm), slot i = hidden[L][i] + embed(ids[i+1]),
                                rope position i
mtp_logits [1,319,V]            lm_head(mtp_hidden); predicts ids[i+2]
gen_prompt [1,12] i64           ids[:, :12]
gen_out [1,76] i64              HF generate greedy, 64 new tokens, eos disabled (checked equal to a
                                no-cache argmax loop)
tiny-gqa-f32 only:
chat_prompt [1,n] i64           tokenizer.apply_chat_template([{"role":"user","content":CHAT_TEXT}],
                                add_generation_prompt=True) (text in the file's metadata)
chat_gen [1,n+32] i64           HF greedy generate, 32 new tokens, eos disabled
file metadata (tiny-gqa-f32): one key "chat_json" = JSON {chat_text, chat_prompt_text, chat_gen_text}
"""
import hashlib
import json
import os
import random
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
import transformers
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

SEQ = 320
PREFILL = 200
GEN_NEW = 64
CHAT_NEW = 32
CHAT_TEXT = "Tell me a short story about a cat and a boat."
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2/3.5-style pre-tokenizer split (with \p{M} as in Qwen3.5)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=64)


# ---------------------------------------------------------------------------------------------
class TinyMTP(nn.Module):
    """Structure of vLLM/SGLang Qwen3_5 MTP (one full-attention decoder layer); weights mtp.*."""

    def __init__(self, cfg):
        super().__init__()
        H = cfg.hidden_size
        d = cfg.to_dict()
        d.update(num_hidden_layers=1, layer_types=["full_attention"])
        d.pop("full_attention_interval", None)
        mcfg = Qwen3_5TextConfig(**{k: v for k, v in d.items() if k not in ("model_type", "transformers_version")})
        mcfg._attn_implementation = "eager"
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mcfg, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, embeds, hidden, position_embeddings):
        T = embeds.shape[1]
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
        return self.norm(x)


def randomize_(module, mtp=False):
    """HF init leaves RMSNorm weights at 0 (x*(1+w)) and the gated norm at 1: randomise all."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if mtp:
                p.copy_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.05))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.05)


def text_part(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


# ---------------------------------------------------------------------------------------------
def make_corpus(seed=1234, n=3000):
    rng = random.Random(seed)
    names = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jack", "Mia", "Leo"]
    animals = ["cat", "dog", "bird", "fox", "horse", "rabbit", "mouse", "bear", "owl", "fish"]
    places = ["the park", "the river", "the forest", "the city", "the market", "the school", "a boat",
              "the garden", "the hill", "the beach"]
    verbs = ["saw", "found", "liked", "followed", "helped", "painted", "called", "watched"]
    adjs = ["small", "big", "happy", "quiet", "red", "old", "brave", "tired", "bright", "kind"]
    words = ("morning evening winter summer window mountain yellow purple green orange water bread apple "
             "chair table letter number question answer because before after always never maybe little "
             "together another picture wonderful strange friendly sleep dream travel remember forget "
             "through around between under over inside outside music people teacher doctor farmer").split()
    out = []
    for _ in range(n):
        k = rng.randrange(7)
        a, b = rng.choice(names), rng.choice(names)
        if k == 0:
            out.append(f"{a} {rng.choice(verbs)} a {rng.choice(adjs)} {rng.choice(animals)} near {rng.choice(places)}.")
        elif k == 1:
            out.append(f"Once upon a time, {a} and {b} went to {rng.choice(places)}. They were very {rng.choice(adjs)}.")
        elif k == 2:
            x, y = rng.randrange(100), rng.randrange(100)
            out.append(f"{x} + {y} = {x + y}")
        elif k == 3:
            out.append(f"Tell me a short story about a {rng.choice(animals)} and {rng.choice(places)}.")
        elif k == 4:
            out.append(f"def {rng.choice(animals)}_{rng.randrange(10)}(x):\n    return x * {rng.randrange(10)}\n")
        elif k == 5:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 12))).capitalize() + ".")
        else:
            out.append(f"The {rng.choice(adjs)} {rng.choice(animals)} is in {rng.choice(places)}, isn't it? Yes, it's there!")
    return out


def build_tokenizer(vocab_size, out_dir):
    """Byte-level BPE, Qwen-style pre-tokenizer; specials appended after the BPE vocab (like Qwen)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_bpe = vocab_size - len(SPECIALS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(make_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == n_bpe, (tok.get_vocab_size(), n_bpe)
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == vocab_size
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                          "single_word": False, "special": True} for s, i in ids.items()},
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
        f.write("\n")
    return ids


# ---------------------------------------------------------------------------------------------
def make_fixture(out_root, name, seed, text_cfg, wrapper=True, tied=False, store_bf16=False,
                 drop_layer_types=False, tokenizer=False):
    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)

    V = text_cfg["vocab_size"]
    tok_ids = None
    if tokenizer:
        tok_ids = build_tokenizer(V, d)
        text_cfg = dict(text_cfg, eos_token_id=tok_ids["<|im_end|>"], pad_token_id=tok_ids["<|endoftext|>"])

    text_cfg = dict(text_cfg, tie_word_embeddings=tied)
    if wrapper:
        vis = dict(VISION, out_hidden_size=text_cfg["hidden_size"])
        extra = {}
        if tok_ids is not None:
            extra = dict(eos_token_id=tok_ids["<|im_end|>"], pad_token_id=tok_ids["<|endoftext|>"])
        config = Qwen3_5Config(text_config=text_cfg, vision_config=vis, tie_word_embeddings=tied, **extra)
        config.text_config._attn_implementation = "eager"
        cls = Qwen3_5ForConditionalGeneration
    else:
        config = Qwen3_5TextConfig(**text_cfg)
        cls = Qwen3_5ForCausalLM
    config._attn_implementation = "eager"

    model = cls(config).eval().float()
    randomize_(model)
    tc = model.config.text_config if wrapper else model.config
    if tied:
        assert model.lm_head.weight.data_ptr() == text_part(model).embed_tokens.weight.data_ptr()
    mtp = TinyMTP(tc).eval().float()
    randomize_(mtp, mtp=True)

    # ---- save
    if store_bf16:
        model = model.to(torch.bfloat16)
        mtp = mtp.to(torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)
    sd_path = os.path.join(d, "model.safetensors")
    sd = load_file(sd_path)
    for k, v in mtp.state_dict().items():
        sd["mtp." + k] = v.contiguous()
    save_file(dict(sorted(sd.items())), sd_path, metadata={"format": "pt"})
    if tied:
        assert "lm_head.weight" not in sd, "tied model saved lm_head.weight"
    else:
        assert "lm_head.weight" in sd
    if not wrapper:
        assert all(k.startswith(("model.embed_tokens", "model.norm", "model.layers.", "lm_head.", "mtp."))
                   for k in sd), sorted(sd)[:5]
    cfg_path = os.path.join(d, "config.json")
    cj = json.load(open(cfg_path))
    if drop_layer_types:
        tcj = cj["text_config"] if wrapper else cj
        expected_lt = tcj.pop("layer_types", None)
        tcj["full_attention_interval"] = text_cfg["full_attention_interval"]
        with open(cfg_path, "w") as f:
            json.dump(cj, f, indent=2, sort_keys=True)
            f.write("\n")
    with safe_open(sd_path, "pt") as f, open(os.path.join(d, "names.txt"), "w") as gf:
        for k in sorted(f.keys()):
            gf.write(f"{k}\t{list(f.get_slice(k).get_shape())}\t{f.get_slice(k).get_dtype()}\n")

    # ---- reload exactly what is on disk, in f32
    model2 = cls.from_pretrained(d, dtype=torch.float32).eval()
    model2.config._attn_implementation = "eager"
    tc2 = model2.config.text_config if wrapper else model2.config
    tc2._attn_implementation = "eager"
    if drop_layer_types:
        assert tc2.layer_types == expected_lt, (tc2.layer_types, expected_lt)
    lm = text_part(model2)
    if tied:
        assert torch.equal(model2.lm_head.weight, lm.embed_tokens.weight)
    # every reloaded tensor equals the stored one (upcast)
    sd_m2 = model2.state_dict()
    for k, v in sd.items():
        if k.startswith("mtp."):
            continue
        if not wrapper or k.startswith(("model.", "lm_head")):
            assert torch.equal(sd_m2[k], v.float()), k
    mtp2 = TinyMTP(tc2).eval().float()
    mtp2.load_state_dict({k[4:]: v.float() for k, v in sd.items() if k.startswith("mtp.")})

    res = {}
    ids = torch.randint(0, V, (1, SEQ), generator=g)
    res["ids"] = ids
    with torch.no_grad():
        out = model2(input_ids=ids, use_cache=False, output_hidden_states=True)
        res["logits"] = out.logits
        for i, h in enumerate(out.hidden_states):
            res[f"hidden.{i}"] = h
        raw = {}
        hook = lm.layers[-1].register_forward_hook(lambda m, a, o: raw.__setitem__("x", o))
        h_normed = lm(input_ids=ids, use_cache=False).last_hidden_state
        hook.remove()
        res["hidden.last_layer_raw"] = raw["x"]
        assert torch.equal(h_normed, out.hidden_states[-1])

        # chunked prefill + token-by-token recurrent decode
        pre = model2(input_ids=ids[:, :PREFILL], use_cache=True)
        cache = pre.cache if getattr(pre, "cache", None) is not None else pre.past_key_values
        steps = [pre.logits]
        for t in range(PREFILL, SEQ):
            o = model2(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = o.cache if getattr(o, "cache", None) is not None else o.past_key_values
            steps.append(o.logits)
        inc = torch.cat(steps, dim=1)
        res["logits_incremental"] = inc
        diff = (res["logits"] - inc).abs().max().item()

        # MTP
        emb = lm.embed_tokens(ids[:, 1:])
        pos = torch.arange(SEQ - 1)[None]
        pe = lm.rotary_emb(emb, pos[None].expand(3, 1, -1))
        mh = mtp2(emb, h_normed[:, :-1], pe)
        res["mtp_hidden"] = mh
        res["mtp_logits"] = model2.lm_head(mh)

        # greedy generate, eos disabled. NB: generate() fills every None field of the passed
        # GenerationConfig from model.generation_config, so eos must be cleared there too.
        model2.generation_config.eos_token_id = None
        gc = GenerationConfig(do_sample=False, max_new_tokens=GEN_NEW, min_new_tokens=0,
                              eos_token_id=None, pad_token_id=0, bos_token_id=None, use_cache=True)
        prompt = ids[:, :12]
        gen = model2.generate(input_ids=prompt, generation_config=gc)
        assert gen.shape == (1, 12 + GEN_NEW), gen.shape
        seq = prompt
        for _ in range(GEN_NEW):
            nxt = model2(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        gen_ok = torch.equal(gen, seq)
        assert gen_ok, "generate != no-cache greedy loop"
        res["gen_prompt"] = prompt
        res["gen_out"] = gen

        meta = {}
        if tokenizer:
            from transformers import AutoTokenizer
            hf_tok = AutoTokenizer.from_pretrained(d)
            msgs = [{"role": "user", "content": CHAT_TEXT}]
            text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            assert text == f"<|im_start|>user\n{CHAT_TEXT}<|im_end|>\n<|im_start|>assistant\n", repr(text)
            cp = hf_tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            from tokenizers import Tokenizer
            raw_tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
            for s in (text, "  two  spaces\n\n\ttab, it's 12345! h\u00e9llo \u65e5\u672c \U0001F642"):
                assert raw_tok.encode(s, add_special_tokens=False).ids == hf_tok(s, add_special_tokens=False)["input_ids"]
            assert cp[0, 0].item() == tok_ids["<|im_start|>"]
            gc2 = GenerationConfig(do_sample=False, max_new_tokens=CHAT_NEW, eos_token_id=None,
                                   pad_token_id=0, bos_token_id=None, use_cache=True)
            cg = model2.generate(input_ids=cp, generation_config=gc2)
            assert cg.shape[1] == cp.shape[1] + CHAT_NEW
            res["chat_prompt"] = cp
            res["chat_gen"] = cg
            meta = {"chat_text": CHAT_TEXT, "chat_prompt_text": text,
                    "chat_gen_text": hf_tok.decode(cg[0, cp.shape[1]:], skip_special_tokens=False)}

    out_res = {k: (v.detach().to(torch.int64) if k in ("ids", "gen_prompt", "gen_out", "chat_prompt", "chat_gen")
                   else v.detach().float()).contiguous().clone() for k, v in res.items()}
    # one metadata key only: safetensors writes __metadata__ from a hash map, so several keys
    # come out in a random order and the file would not be bitwise reproducible
    save_file(dict(sorted(out_res.items())), os.path.join(d, "oracle.safetensors"),
              metadata={"chat_json": json.dumps(meta, sort_keys=True)} if meta else None)
    nparams = sum(v.numel() for v in sd.values())
    print(f"[{name}] tensors={len(sd)} params={nparams} layer_types={tc2.layer_types} "
          f"max|chunked-incremental|={diff:.3e} |logits|max={res['logits'].abs().max().item():.3f} "
          f"gen==loop:{gen_ok}", flush=True)
    return diff


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
    os.makedirs(out_root, exist_ok=True)
    common = dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
                  linear_conv_kernel_dim=4, attn_output_gate=True, output_gate_type="swish",
                  mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    diffs = {}
    diffs["tiny-gqa-f32"] = make_fixture(out_root, "tiny-gqa-f32", 100, dict(
        common, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=6, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[3, 3, 2], mrope_interleaved=True),
        full_attention_interval=4), tokenizer=True)
    diffs["tiny-mha-tied-bf16"] = make_fixture(out_root, "tiny-mha-tied-bf16", 200, dict(
        common, vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        eos_token_id=0), tied=True, store_bf16=True, drop_layer_types=True)
    diffs["tiny-bare-text"] = make_fixture(out_root, "tiny-bare-text", 300, dict(
        common, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[2, 1, 1], mrope_interleaved=True),
        full_attention_interval=4, eos_token_id=0), wrapper=False)

    print(f"torch {torch.__version__} transformers {transformers.__version__}")
    for name in diffs:
        for fn in sorted(os.listdir(os.path.join(out_root, name))):
            p = os.path.join(out_root, name, fn)
            h = hashlib.sha256(open(p, "rb").read()).hexdigest()
            print(f"{h}  {os.path.getsize(p):>9}  {name}/{fn}")


if __name__ == "__main__":
    main()
