#!/usr/bin/env python3
"""Train kvstream-demo-tiny: a small Qwen3.5-architecture model (hybrid Gated DeltaNet + gated
attention, 3:1) with an MTP head, on a corpus that this script generates itself.

Usage:
    # CPU default: 600 steps x 8 x 256 tokens, ~12 min on 2 idle cores (~1.8k tokens/s)
    HF_HUB_OFFLINE=1 nice -n 19 /work/venv/bin/python scripts/train_demo.py models/kvstream-demo-tiny
    # what produced the committed models/kvstream-demo-tiny (H200, ~3 min; eval/oracle on CPU):
    HF_HUB_OFFLINE=1 python scripts/train_demo.py models/kvstream-demo-tiny --device cuda --steps 1200 --batch 16 --threads 4
Options: --steps N (600), --batch N (8), --threads N (2), --device cpu|cuda, --quick (20 steps, test).

Everything is ours: the corpus is produced by the templates below (stories, ChatML dialogues,
lists, arithmetic, code-like lines), the tokenizer is trained on it here, and the weights are
trained from a fixed seed. Deterministic for a given torch build and thread count
(torch.use_deterministic_algorithms(True), fixed seeds).

Training: HF transformers' Qwen3_5ForCausalLM (text model; sdpa attention) plus TinyMTP (the
vLLM/SGLang MTP structure: mtp.fc / mtp.pre_fc_norm_{embedding,hidden} / mtp.layers.0 / mtp.norm).
Loss = CE(next token) + MTP_WEIGHT * CE_mtp(next-next token), where the MTP input at position i is
the post-final-norm hidden h_i and the shared embedding of token i+1, target token i+2, rope
position i. MTP gradients DO flow into the trunk (hidden states and the shared embedding/lm_head).

Output folder: config.json (Qwen3_5ForConditionalGeneration wrapper with text_config and a
minimal vision_config; the checkpoint holds NO model.visual.* tensors - HF loads it and just
initialises the unused vision tower), model.safetensors (bf16; model.language_model.*, lm_head.weight,
mtp.*), tokenizer.json, tokenizer_config.json (ChatML chat_template), generation_config.json,
oracle.safetensors, README.md.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS when --device cuda

import torch
import torch.nn.functional as F
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

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 1280  # model rows; the tokenizer has fewer ids (padded like Qwen's 248320 vs 248077)
SEQ = 256
BATCH = 8
MTP_WEIGHT = 0.5
LR = 3e-3
WARMUP = 60
SEED = 1234
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEXT_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=640, num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    attn_output_gate=True, output_gate_type="swish", mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False, full_attention_interval=4,
)
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                     patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
                     num_position_embeddings=64, out_hidden_size=256)

# ----------------------------------------------------------------------------------- corpus
NAMES = ("Anna Ben Clara David Ella Finn Grace Hugo Iris Jack Kate Leo Mia Noah Olivia Paul Quinn Rosa "
         "Sam Tara Uma Victor Wendy Max Zoe Lily Tom Lucy Oscar Ruby").split()
ANIMALS = "cat dog bird fox horse rabbit mouse bear owl fish frog duck goat lion tiger turtle wolf sheep".split()
ADJS = ("small big happy quiet red old brave tired bright kind little young clever funny gentle shy "
        "curious lazy busy sleepy friendly strong green blue yellow").split()
PLACES = ["the park", "the river", "the forest", "the city", "the market", "the school", "the garden",
          "the hill", "the beach", "the farm", "the village", "the lake", "the library", "the castle",
          "the kitchen", "the mountain"]
OBJECTS = ("ball box key hat book map cake kite boat lamp coin flower shell stone cup bell apple "
           "letter drum rope basket").split()
FOODS = "apples bread milk eggs cheese rice carrots tomatoes butter honey soup pasta beans oranges".split()
COLORS = "red blue green yellow purple orange white black pink brown".split()
FEELINGS = "happy sad surprised excited scared proud calm glad".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = ("January February March April May June July August September October November "
          "December").split()
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
            ("Japan", "Tokyo"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"),
            ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Poland", "Warsaw")]
NUMWORDS = "zero one two three four five six seven eight nine ten".split()


def an(w):
    return ("an " if w[0] in "aeiou" else "a ") + w


def story(r, a=None):
    n, adj, p = r.choice(NAMES), r.choice(ADJS), r.choice(PLACES)
    a = a or r.choice(ANIMALS)
    o, f, m = r.choice(OBJECTS), r.choice(FEELINGS), r.choice(NAMES)
    s = [f"Once upon a time, there was {an(adj)} {a} named {n}.", f"{n} lived near {p}."]
    s.append(r.choice([f"One day, {n} found {an(o)}.", f"One morning, {n} lost {an(o)}.",
                       f"Every day, {n} played with {an(o)}."]))
    s.append(r.choice([f"{n} was very {f}.", f"{n} felt {f} and smiled.", f"This made {n} {f}."]))
    s.append(r.choice([f"Then {n} met a friend called {m}.", f"Later, {m} the {r.choice(ANIMALS)} came to help.",
                       f"{m} said, \"Let's go to {r.choice(PLACES)} together!\""]))
    s.append(r.choice([f"They went to {r.choice(PLACES)} and had fun.", f"They shared the {o} and laughed.",
                       f"Together they looked for the {o} all day."]))
    s.append(r.choice(["The end.", f"From that day on, {n} and {m} were best friends.",
                       f"And {n} never forgot that day."]))
    return " ".join(s)


def arith(r):
    op = r.choice("+-*")
    if op == "*":
        x, y = r.randrange(2, 13), r.randrange(2, 13)
        return x, op, y, x * y
    x, y = r.randrange(1, 100), r.randrange(1, 100)
    if op == "-" and y > x:
        x, y = y, x
    return x, op, y, (x + y if op == "+" else x - y)


def chat(r):
    k = r.randrange(7)
    if k == 0:
        x, op, y, z = arith(r)
        u, a = f"What is {x} {op} {y}?", f"{x} {op} {y} = {z}."
    elif k == 1:
        a_ = r.choice(ANIMALS)
        u, a = f"Tell me a short story about {an(a_)}.", story(r, a_)
    elif k == 2:
        c, cap = r.choice(CAPITALS)
        u, a = f"What is the capital of {c}?", f"The capital of {c} is {cap}."
    elif k == 3:
        n = r.randrange(3, 6)
        what, pool = r.choice([("colors", COLORS), ("animals", ANIMALS), ("foods", FOODS), ("days", DAYS)])
        items = r.sample(pool, n)
        u = f"List {NUMWORDS[n]} {what}."
        a = f"Here are {NUMWORDS[n]} {what}:\n" + "\n".join(f"{i + 1}. {it}" for i, it in enumerate(items))
    elif k == 4:
        n = r.choice(NAMES)
        u, a = f"Hello! My name is {n}.", f"Hello {n}! Nice to meet you. How can I help you today?"
    elif k == 5:
        x = r.randrange(1, 50)
        u = f"Count from {x} to {x + 5}."
        a = ", ".join(str(i) for i in range(x, x + 6)) + "."
    else:
        w = r.choice(ANIMALS + OBJECTS)
        u, a = f"How do you spell {w}?", f"{w} is spelled " + "-".join(w.upper()) + "."
    msgs = [("user", u), ("assistant", a)]
    if r.random() < 0.3:
        msgs.insert(0, ("system", "You are a helpful assistant."))
    return "".join(f"<|im_start|>{ro}\n{c}<|im_end|>\n" for ro, c in msgs)


def listing(r):
    k = r.randrange(5)
    if k == 0:
        return "Shopping list:\n" + "\n".join(f"- {x}" for x in r.sample(FOODS, r.randrange(3, 7)))
    if k == 1:
        i = r.randrange(7)
        return "Days of the week: " + ", ".join(DAYS[i:] + DAYS[:i]) + "."
    if k == 2:
        i = r.randrange(12)
        return "Months: " + ", ".join(MONTHS[i:i + r.randrange(3, 7)]) + "."
    if k == 3:
        x, st = r.randrange(0, 50), r.randrange(1, 6)
        return "Numbers: " + ", ".join(str(x + st * j) for j in range(8)) + "."
    return "To do:\n" + "\n".join(f"{j + 1}. {v} the {o}" for j, (v, o) in enumerate(
        zip(r.sample(["find", "clean", "paint", "move", "open", "fix", "wash", "buy"], 4), r.sample(OBJECTS, 4))))


def arith_block(r):
    return "\n".join("{} {} {} = {}".format(*arith(r)) for _ in range(r.randrange(3, 8)))


def code(r):
    k = r.randrange(4)
    n, v = r.randrange(1, 10), r.choice(["x", "y", "n", "value"])
    if k == 0:
        op = r.choice(["+", "-", "*"])
        name = {"+": "add", "-": "sub", "*": "mul"}[op]
        return f"def {name}_{n}({v}):\n    return {v} {op} {n}\n\nprint({name}_{n}({r.randrange(10)}))"
    if k == 1:
        return f"for i in range({n}):\n    print(i * {r.randrange(1, 5)})"
    if k == 2:
        nm = r.choice(NAMES)
        return "{" + f'"name": "{nm}", "age": {r.randrange(5, 90)}, "pet": "{r.choice(ANIMALS)}"' + "}"
    items = r.sample(COLORS, 3)
    return f"colors = {items!r}\nfor c in colors:\n    print(c.upper())"


def make_corpus(seed, n_docs):
    r = random.Random(seed)
    gens = [story, chat, chat, listing, arith_block, code]
    return [r.choice(gens)(r) for _ in range(n_docs)]


# ----------------------------------------------------------------------------------- tokenizer
def build_tokenizer(docs):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(SPECIALS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])

    def strip(d):
        for s in SPECIALS:
            d = d.replace(s, "\n")
        return d

    tok.train_from_iterator((strip(d) for d in docs), trainer=trainer)
    n_bpe = tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)  # ids after the BPE vocab, as in Qwen
    return tok, n_bpe


def write_tokenizer_files(tok, out):
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
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
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
        f.write("\n")
    return ids


def encode_stream(tok, docs, eot):
    out = []
    for e in tok.encode_batch(docs, add_special_tokens=False):
        out.extend(e.ids)
        out.append(eot)
    return torch.tensor(out, dtype=torch.int64)


# ----------------------------------------------------------------------------------- MTP
class TinyMTP(nn.Module):
    """vLLM/SGLang Qwen3_5 MTP structure; state dict keys = checkpoint names without 'mtp.'."""

    def __init__(self, cfg, attn="eager"):
        super().__init__()
        H = cfg.hidden_size
        d = {k: v for k, v in cfg.to_dict().items() if k not in ("model_type", "transformers_version")}
        d.update(num_hidden_layers=1, layer_types=["full_attention"])
        d.pop("full_attention_interval", None)
        mcfg = Qwen3_5TextConfig(**d)
        mcfg._attn_implementation = attn
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mcfg, 0)])
        self.norm = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)

    def forward(self, embeds, hidden, position_embeddings):
        T = embeds.shape[1]
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
        return self.norm(x)


def mtp_logits_for(lm, lm_head, mtp, ids, h):
    """ids [B,T], h = post-final-norm hidden [B,T,H] -> MTP logits [B,T-1,V] (slot i predicts ids[i+2])."""
    T = ids.shape[1]
    emb = lm.embed_tokens(ids[:, 1:])
    pos = torch.arange(T - 1, device=ids.device)[None].expand(ids.shape[0], -1)
    pe = lm.rotary_emb(emb, pos[None].expand(3, -1, -1))
    return lm_head(mtp(emb, h[:, :-1], pe))


def init_weights_(model, mtp):
    """HF init (normal 0.02, norms at 0 i.e. scale 1, gated norm 1); scale residual outputs down."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]:
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * (model.config.num_hidden_layers + 1)))
            elif name.startswith("mtp.") and p.ndim == 2:
                p.normal_(0.0, 0.02)
            elif name.startswith("mtp.") and p.ndim == 1:
                p.zero_()


# ----------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(model, mtp, stream, n_seq=8, T=SEQ):
    lm = model.model
    tot = dict(n=0, ce=0.0, acc=0, mn=0, mce=0.0, macc=0, mgreedy=0)
    for j in range(n_seq):
        ids = stream[j * T:(j + 1) * T][None]
        h = lm(input_ids=ids, use_cache=False).last_hidden_state
        lg = model.lm_head(h)
        ml = mtp_logits_for(lm, model.lm_head, mtp, ids, h)
        tot["ce"] += F.cross_entropy(lg[0, :-1], ids[0, 1:], reduction="sum").item()
        tot["acc"] += (lg[0, :-1].argmax(-1) == ids[0, 1:]).sum().item()
        tot["n"] += T - 1
        tot["mce"] += F.cross_entropy(ml[0, :-1], ids[0, 2:], reduction="sum").item()
        tot["macc"] += (ml[0, :-1].argmax(-1) == ids[0, 2:]).sum().item()
        # acceptance vs the main model's own greedy choice for position i+2 (teacher-forced prefix)
        tot["mgreedy"] += (ml[0, :-1].argmax(-1) == lg[0, 1:-1].argmax(-1)).sum().item()
        tot["mn"] += T - 2
    return dict(ce=tot["ce"] / tot["n"], acc=tot["acc"] / tot["n"], mtp_ce=tot["mce"] / tot["mn"],
                mtp_acc=tot["macc"] / tot["mn"], mtp_vs_greedy=tot["mgreedy"] / tot["mn"])


@torch.no_grad()
def greedy_acceptance(model, mtp, prompts, n_new=64):
    """Generate greedily (eos disabled) from each prompt, then measure: fraction of generated
    positions j where argmax MTP(h_{j-2}, tok_{j-1}) == tok_j (tok_j = the model's greedy token)."""
    lm = model.model
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_new, eos_token_id=None, pad_token_id=0,
                          bos_token_id=None, use_cache=True)
    model.generation_config.eos_token_id = None  # generate() fills None fields from it
    hit = tot = 0
    for p in prompts:
        seq = model.generate(input_ids=p, generation_config=gc)
        h = lm(input_ids=seq, use_cache=False).last_hidden_state
        ml = mtp_logits_for(lm, model.lm_head, mtp, seq, h)  # slot i predicts seq[i+2]
        n = p.shape[1]
        pred = ml[0, n - 2:seq.shape[1] - 2].argmax(-1)  # predicts seq[n:], the generated tokens
        hit += (pred == seq[0, n:]).sum().item()
        tot += seq.shape[1] - n
    return hit / tot


# ----------------------------------------------------------------------------------- card
def write_readme(out, S):
    tc = TEXT_CONFIG
    ev = S["eval"]
    cpu = S.get("cpu_seconds")
    samples = "\n\n".join("```\n" + x + "\n```" for x in S["samples"])
    cpu_note = "" if S["device"] == "cpu" else (
        "\nOn a CPU this model trains at about 1.8k tokens/s on 2 idle cores (measured), so the script's "
        "CPU default\n(`--steps 600 --batch 8`, 1.2M tokens) takes about 12 min and this GPU recipe "
        "(4.9M tokens) about 45 min.\nThe GPU was used because the 2-core build host was saturated by "
        "compile jobs (a `nice -n 19` step took\n~37 s instead of ~1 s).")
    text = f"""# kvstream-demo-tiny

A tiny **Qwen3.5-architecture** (`Qwen3_5ForConditionalGeneration`, text part `qwen3_5_text`) language
model with an **MTP head**, trained from scratch by `scripts/train_demo.py` on a corpus that the script
generates itself. It exists to demo and test kvstream end to end (tokenizer, chat template, hybrid
GDN + gated attention, greedy/sampled decoding, MTP speculative decoding) with weights that produce
real text. It knows only its templates: short stories, ChatML Q&A (sums, capitals, lists, counting,
spelling, greetings), lists, arithmetic and code-like snippets. It is far too small to be right about
anything (its sums are often wrong); what matters is that the text has the shape of its corpus.

## Architecture

| | |
|---|---|
| layers | {tc["num_hidden_layers"]}: `layer_types` = [linear, linear, linear, full] x 2 (Gated DeltaNet 3 : 1 gated attention) |
| hidden / intermediate | {tc["hidden_size"]} / {tc["intermediate_size"]} (SwiGLU) |
| full attention | {tc["num_attention_heads"]} q heads / {tc["num_key_value_heads"]} kv heads x head_dim {tc["head_dim"]}, output gate, q/k norm, partial rotary 0.25 (rotary dim 16, theta 1e7, mrope_section [3,3,2] interleaved) |
| Gated DeltaNet | {tc["linear_num_key_heads"]} q/k heads x {tc["linear_key_head_dim"]}, {tc["linear_num_value_heads"]} v heads x {tc["linear_value_head_dim"]}, conv kernel 4 |
| vocab | model {tc["vocab_size"]} rows; tokenizer {S["tokenizer_vocab"]} ids ({S["bpe_tokens"]} byte-level BPE + 3 specials). Rows {S["tokenizer_vocab"]}..{tc["vocab_size"] - 1} are padding, as in Qwen (248320 rows, 248077 ids) |
| embeddings | untied (`lm_head.weight` stored) |
| MTP | 1 layer, vLLM/SGLang Qwen3.5 structure: `mtp.fc` [H, 2H] on concat(norm(embed(t[i+1])), norm(h_i)), one full-attention decoder layer, `mtp.norm`; shares embed_tokens and lm_head. 15 `mtp.*` tensors |
| parameters | {S["params_main"]:,} main + {S["params_mtp"]:,} MTP = {S["params_main"] + S["params_mtp"]:,} |
| stored dtype | bfloat16 (all tensors) |

config.json is the wrapper form with a minimal `vision_config` (HF requires one), but
**model.safetensors holds no `model.visual.*` tensors**: HF's `from_pretrained` still loads it
(it initialises the unused vision tower and reports the keys missing). Tensor names:
`model.language_model.*`, `lm_head.weight`, `mtp.*`.

Special tokens: `<|endoftext|>` = {S["specials"]["<|endoftext|>"]}, `<|im_start|>` = {S["specials"]["<|im_start|>"]}, `<|im_end|>` = {S["specials"]["<|im_end|>"]}
(after the BPE vocab, as in Qwen). Chat template: ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`,
generation prompt `<|im_start|>assistant\\n`). config eos = `<|im_end|>`; generation_config.json
eos = [`<|im_end|>`, `<|endoftext|>`], sampling temperature 0.7, top_k 20, top_p 0.95 (greedy works
well too).

## Data

Generated by `make_corpus()` in the script (seeded templates), so it is ours to redistribute:
{S["n_docs"]} training documents ({S["train_stream_tokens"]:,} tokens), joined with `<|endoftext|>`;
a held-out set of 1500 documents from another seed for evaluation. The tokenizer is trained on the
training documents (specials removed) with the `tokenizers` library and Qwen3.5's pre-tokenizer
(NFC, the Qwen3.5 split regex, byte-level).

## Training

```
HF_HUB_OFFLINE=1 nice -n 19 python scripts/train_demo.py models/kvstream-demo-tiny --steps {S["steps"]} --batch {S["batch"]} --threads {S["threads"]} --device {S["device"]}
```
This folder was produced with that command on {S["device_name"]} (training) and the CPU (evaluation,
oracle), torch {S["torch"]}, transformers {S["transformers"]}; seeds fixed, deterministic algorithms.
(`--device cpu` runs the same recipe on a CPU; results then differ in the last bits, not in kind.){cpu_note}
HF `Qwen3_5ForCausalLM` (sdpa attention, HF's pure-torch GDN fallback) + the MTP module; AdamW
(lr {LR}, betas 0.9/0.95, wd 0.1 on matrices, {WARMUP} warmup steps, cosine to 10%), grad clip 1.0,
batch {S["batch"]} x {S["seq"]} tokens, {S["steps"]} steps = {S["train_tokens_seen"]:,} tokens seen.
Loss = CE(next token) + {MTP_WEIGHT} x CE_MTP(next-next token): MTP input at position i is the
post-final-norm hidden h_i and the embedding of token i+1, target token i+2, rope position i.
**The MTP loss gradients flow into the trunk** (hidden states, shared embedding and lm_head).
Trained in f32, saved in bf16.

Time: training {S["train_seconds"]:.0f} s wall, whole script {S["total_seconds"]:.0f} s wall
({S["device_name"]}, {S["threads"]} CPU threads){"" if cpu is None else f"; {cpu:.0f} s of CPU time"}.
Final training batch: loss {S["final_log"][1]:.4f}, MTP loss {S["final_log"][2]:.4f}.

## Evaluation (held-out generated text, bf16 weights computed in f32)

| metric | value |
|---|---|
| next-token cross-entropy | {ev["ce"]:.4f} (top-1 accuracy {ev["acc"]:.4f}) |
| MTP next-next-token cross-entropy | {ev["mtp_ce"]:.4f} |
| MTP next-next-token top-1 accuracy (vs the true token i+2) | {ev["mtp_acc"]:.4f} |
| MTP top-1 == main model's greedy token at i+2 (teacher-forced held-out text) | {ev["mtp_vs_greedy"]:.4f} |
| **MTP greedy acceptance on the model's own greedy generations** (12 prompts x 64 tokens) | **{S["mtp_greedy_acceptance"]:.4f}** |

The last row is what MTP speculative decoding with one draft token would accept under greedy
decoding: at each generated position j, argmax MTP(h_(j-2), t_(j-1)) == t_j.

## Samples (greedy, 64 new tokens, eos disabled; the same as in oracle.safetensors)

{samples}

## oracle.safetensors

HF transformers reference outputs, computed from this folder with
`Qwen3_5ForConditionalGeneration.from_pretrained(dtype=float32)` (exact upcast of the bf16
weights), eager attention:

| tensor | what |
|---|---|
| `prompt0` [1,n] i64 | ChatML prompt "What is 23 + 45?" (apply_chat_template, add_generation_prompt) |
| `prompt1` [1,n] i64 | "Once upon a time, there was a" |
| `prompt2` [1,n] i64 | "def mul_4(x):\\n" |
| `gen{{i}}` [1,n+64] i64 | HF `generate` greedy, 64 new tokens, eos disabled |
| `ids` [1,64] i64 | the first 64 tokens of the held-out stream |
| `logits` [1,64,{tc["vocab_size"]}] f32 | full forward (use_cache=False) |
| `mtp_logits` [1,63,{tc["vocab_size"]}] f32 | MTP logits, slot i = post-norm hidden i + token i+1 (predicts ids[i+2]) |

`train_summary.json` has the numbers above and the loss log.
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--device", default="cpu", help="where to train (cpu or cuda); eval/oracle always on CPU in f32")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.steps = 20
    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=args.device != "cpu")
    torch.manual_seed(SEED)
    dev = torch.device(args.device)
    random.seed(SEED)

    out = args.out
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    # ---- corpus + tokenizer
    n_docs = 4000 if args.quick else 60000
    train_docs = make_corpus(SEED, n_docs)
    eval_docs = make_corpus(SEED + 777, 1500)
    tok, n_bpe = build_tokenizer(train_docs)
    ids = write_tokenizer_files(tok, out)
    eot, im_start, im_end = ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]
    tok_vocab = tok.get_vocab_size()
    assert tok_vocab <= VOCAB
    train = encode_stream(tok, train_docs, eot)
    evals = encode_stream(tok, eval_docs, eot)
    print(f"tokenizer: {n_bpe} BPE + {len(SPECIALS)} specials = {tok_vocab} (model vocab {VOCAB}); "
          f"specials {ids}; train tokens {len(train)}, eval tokens {len(evals)}; "
          f"{time.time() - t_start:.1f}s", flush=True)

    # ---- model
    tcfg = Qwen3_5TextConfig(**TEXT_CONFIG, eos_token_id=im_end, pad_token_id=eot, bos_token_id=None)
    tcfg._attn_implementation = "sdpa"
    model = Qwen3_5ForCausalLM(tcfg)
    mtp = TinyMTP(model.config, attn="sdpa")
    init_weights_(model, mtp)
    model.to(dev)
    mtp.to(dev)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"params: main {n_main:,} + mtp {n_mtp:,} = {n_main + n_mtp:,}", flush=True)

    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(s):
        if s < WARMUP:
            return LR * (s + 1) / WARMUP
        pr = (s - WARMUP) / max(1, args.steps - WARMUP)
        return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * pr)))

    g = torch.Generator().manual_seed(SEED + 1)
    lm = model.model
    model.train()
    mtp.train()
    log = []
    t_train = time.time()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - SEQ - 1, (args.batch,), generator=g)
        x = torch.stack([train[s:s + SEQ] for s in starts.tolist()]).to(dev)
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step)
        h = lm(input_ids=x, use_cache=False).last_hidden_state
        logits = model.lm_head(h)
        loss_main = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        ml = mtp_logits_for(lm, model.lm_head, mtp, x, h)
        loss_mtp = F.cross_entropy(ml[:, :-1].reshape(-1, VOCAB), x[:, 2:].reshape(-1))
        loss = loss_main + MTP_WEIGHT * loss_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d} lr {lr_at(step):.2e} loss {loss_main.item():.4f} mtp {loss_mtp.item():.4f} "
                  f"{el:7.1f}s ({(step + 1) * args.batch * SEQ / el:.0f} tok/s)", flush=True)
            log.append((step, loss_main.item(), loss_mtp.item()))
    train_s = time.time() - t_train
    model.to("cpu").eval()
    mtp.to("cpu").eval()

    # ---- save: wrapper naming, bf16, no model.visual.*
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        sd[k] = v.detach().to(torch.bfloat16).contiguous()
    for k, v in mtp.state_dict().items():
        sd["mtp." + k] = v.detach().to(torch.bfloat16).contiguous()
    save_file(dict(sorted(sd.items())), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tc_dict = {k: v for k, v in tcfg.to_dict().items() if k not in ("transformers_version", "_attn_implementation")}
    wcfg = Qwen3_5Config(text_config=tc_dict, vision_config=VISION_CONFIG, tie_word_embeddings=False,
                         eos_token_id=im_end, pad_token_id=eot)
    wcfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    wcfg.dtype = torch.bfloat16
    wcfg.save_pretrained(out)
    gen_cfg = GenerationConfig(bos_token_id=None, eos_token_id=[im_end, eot], pad_token_id=eot,
                               do_sample=True, temperature=0.7, top_k=20, top_p=0.95)
    gen_cfg.save_pretrained(out)

    # ---- reload through HF (wrapper class) in f32 from the bf16 file
    ref = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    ref.config.text_config._attn_implementation = "eager"
    rlm = ref.model.language_model
    for k, v in sd.items():
        if not k.startswith("mtp."):
            assert torch.equal(ref.state_dict()[k], v.float()), k
    rmtp = TinyMTP(ref.config.text_config).eval()
    rmtp.load_state_dict({k[4:]: v.float() for k, v in sd.items() if k.startswith("mtp.")})

    # text-only view with the same (rounded) weights, for eval
    emodel = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT_CONFIG, eos_token_id=im_end, pad_token_id=eot)).eval()
    emodel.config._attn_implementation = "eager"
    emodel.load_state_dict({(("model." + k[len("model.language_model."):]) if k.startswith("model.language_model.")
                             else k): v.float() for k, v in sd.items() if not k.startswith("mtp.")})

    ev = evaluate(emodel, rmtp, evals)
    print("held-out eval (bf16 weights, f32 compute):", json.dumps(ev), flush=True)

    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(out)

    def chat_ids(u):
        t = hf_tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=False)
        return torch.tensor([tok.encode(t, add_special_tokens=False).ids])

    acc_prompts = [chat_ids(u) for u in ["What is 12 + 7?", "Tell me a short story about a fox.",
                                         "List four colors.", "What is the capital of Japan?",
                                         "Count from 10 to 15.", "Hello! My name is Mia."]]
    acc_prompts += [torch.tensor([tok.encode(t).ids]) for t in [
        "Once upon a time, there was a", "Shopping list:\n-", "def add_3(x):\n", "5 + 8 = 13\n9 - 4 =",
        "Days of the week: Monday,", "for i in range(4):\n"]]
    acc = greedy_acceptance(emodel, rmtp, acc_prompts)
    print(f"MTP greedy acceptance on the model's own greedy generations: {acc:.4f}", flush=True)

    # ---- oracle
    res = {}
    gc = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=eot,
                          bos_token_id=None, use_cache=True)
    prompts = [chat_ids("What is 23 + 45?"), torch.tensor([tok.encode("Once upon a time, there was a").ids]),
               torch.tensor([tok.encode("def mul_4(x):\n").ids])]
    samples = []
    ref.generation_config.eos_token_id = None  # generate() fills None fields from it
    with torch.no_grad():
        for i, p in enumerate(prompts):
            gout = ref.generate(input_ids=p, generation_config=gc)
            assert gout.shape[1] == p.shape[1] + 64
            res[f"prompt{i}"] = p
            res[f"gen{i}"] = gout
            samples.append(tok.decode(gout[0].tolist(), skip_special_tokens=False))
        seq = evals[:64][None]
        o = ref(input_ids=seq, use_cache=False)
        res["ids"] = seq
        res["logits"] = o.logits
        h = rlm(input_ids=seq, use_cache=False).last_hidden_state
        res["mtp_logits"] = mtp_logits_for(rlm, ref.lm_head, rmtp, seq, h)
        # cross-check: the wrapper class and the text-only class agree
        assert (emodel(input_ids=seq, use_cache=False).logits - o.logits).abs().max().item() < 1e-4
    res = {k: (v.to(torch.int64) if not v.is_floating_point() else v.float()).contiguous().clone()
           for k, v in res.items()}
    save_file(dict(sorted(res.items())), os.path.join(out, "oracle.safetensors"))
    for s in samples:
        print("----\n" + s, flush=True)

    total_s = time.time() - t_start
    summary = dict(params_main=n_main, params_mtp=n_mtp, train_stream_tokens=len(train), n_docs=n_docs,
                   cpu_seconds=round(time.process_time(), 1), device=args.device,
                   device_name=(torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"),
                   steps=args.steps, batch=args.batch, seq=SEQ,
                   train_tokens_seen=args.steps * args.batch * SEQ, train_seconds=round(train_s, 1),
                   total_seconds=round(total_s, 1), threads=args.threads, final_log=log[-1], eval=ev,
                   mtp_greedy_acceptance=acc, tokenizer_vocab=tok_vocab, bpe_tokens=n_bpe, specials=ids,
                   torch=torch.__version__, transformers=transformers.__version__, samples=samples,
                   log=log)
    with open(os.path.join(out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    write_readme(out, summary)
    print(f"done in {total_s:.0f}s (training {train_s:.0f}s)")


if __name__ == "__main__":
    main()
