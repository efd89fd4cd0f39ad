"""An independent PyTorch EAGLE-3 / EAGLE 3.1 drafter, written from
shared/reference/EAGLE.md (sections 2-5), not from the JAX code.

It holds its weights in the SafeAILab PyTorch layout (nn.Linear weights are
[out, in], `midlayer.*`), runs one drafter step over a plain growing KV cache,
and writes itself as a real checkpoint directory: native (`midlayer.*`,
`model.safetensors` or `pytorch_model.bin`) or speculators (`layers.0.*`).
The config.json files are written here from the format description, so the
JAX parser is tested against configs it did not produce.

Computation (EAGLE.md section 2):
    h   = fc(concat(aux))             (fc_norm: per-slot RMSNorm first;
                                       norm_before_fc: one RMSNorm over the concat)
    e   = embed(next_ids)
    res = hidden_norm(h) if norm_before_residual else h
    x   = concat(input_layernorm(e), hidden_norm(h))
    h   = res + o_proj(attn(q_proj(x), k_proj(x), v_proj(x)))    GQA, rotate_half RoPE
    h   = h + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(h)
    logits = lm_head(norm(h));  feedback = norm(h) if norm_output else h
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class RefSpec:
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 300  # target vocabulary
    draft_vocab: int = 300
    target_hidden: int = 64
    aux_ids: tuple = (2, 4, 5)  # inputs of target layers
    eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF style: {"rope_type": "llama3", ...} or linear
    max_position_embeddings: int = 2048
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    attention_bias: bool = False
    has_embedding: bool = False
    draft_target_ids: tuple | None = None  # sorted target ids of the draft vocab (None = identity)
    extra: dict = field(default_factory=dict)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    def __init__(self, s: RefSpec):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.attention_bias)


class MLP(nn.Module):
    def __init__(self, s: RefSpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: RefSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)


def rope_inv_freq(s: RefSpec) -> torch.Tensor:
    """HF default / linear / llama3 inverse frequencies, float64."""
    d = s.head_dim
    inv = 1.0 / (s.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = s.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(kind)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RefCache:
    """A growing KV cache: k, v [S, kv_heads, D] (committed and in-flight alike)."""

    def __init__(self, s: RefSpec):
        self.k = torch.zeros(0, s.kv_heads, s.head_dim)
        self.v = torch.zeros(0, s.kv_heads, s.head_dim)


class TorchEagleDrafter(nn.Module):
    def __init__(self, s: RefSpec):
        super().__init__()
        self.s = s
        a = len(s.aux_ids)
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.fc = nn.Linear(a * s.target_hidden, s.hidden, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(s.target_hidden, s.eps) for _ in range(a)]) if s.fc_norm else None
        self.input_norm = RMSNorm(a * s.target_hidden, s.eps) if s.norm_before_fc else None
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.draft_vocab, bias=False)
        if s.draft_target_ids is None:
            assert s.draft_vocab == s.vocab
            ids = torch.arange(s.vocab)
        else:
            ids = torch.tensor(s.draft_target_ids, dtype=torch.int64)
            assert ids.shape == (s.draft_vocab,)
        self.register_buffer("d2t", ids - torch.arange(s.draft_vocab, dtype=torch.int64))
        t2d = torch.zeros(s.vocab, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)

    # ------------------------------------------------------------------ weights
    def randomize(self, seed: int, scale: float = 0.06) -> "TorchEagleDrafter":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm."):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                elif name == "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=g))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(scale * torch.randn(p.shape, generator=g))
        return self

    def checkpoint_state(self, layer_prefix: str = "midlayer", include_vocab: bool = True) -> dict:
        out = {}
        for k, v in self.state_dict().items():
            if k == "embed_tokens.weight" and not self.s.has_embedding:
                continue
            if k in ("d2t", "t2d") and not include_vocab:
                continue
            if k.startswith("midlayer."):
                k = layer_prefix + k[len("midlayer"):]
            out[k] = v.detach().clone().contiguous()
        return out

    # ------------------------------------------------------------------ math
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, A*Ht] -> [T, H]."""
        if self.fc_norm is not None:
            chunks = aux.split(self.s.target_hidden, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        elif self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def _attention(self, x, positions, cache: RefCache, key_mask=None):
        s, at = self.s, self.midlayer.self_attn
        t = x.shape[0]
        q = at.q_proj(x).view(t, s.heads, s.head_dim)
        k = at.k_proj(x).view(t, s.kv_heads, s.head_dim)
        v = at.v_proj(x).view(t, s.kv_heads, s.head_dim)
        freqs = positions.to(torch.float64)[:, None] * rope_inv_freq(s)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        past = cache.k.shape[0]
        cache.k = torch.cat([cache.k, k])
        cache.v = torch.cat([cache.v, v])
        groups = s.heads // s.kv_heads
        kk = cache.k.repeat_interleave(groups, dim=1)  # [S, heads, D]
        vv = cache.v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("thd,shd->hts", q, kk).float() / math.sqrt(s.head_dim)
        if key_mask is None:  # causal over everything in the cache
            key_mask = torch.arange(kk.shape[0])[None] <= past + torch.arange(t)[:, None]
        scores = scores.masked_fill(~key_mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(vv.dtype)
        out = torch.einsum("hts,shd->thd", probs, vv).reshape(t, s.heads * s.head_dim)
        return at.o_proj(out)

    def step(self, token_ids, hidden, positions, cache: RefCache, embed: torch.Tensor | None = None,
             key_mask=None):
        """token_ids [T] (target ids), hidden [T, H], positions [T] ->
        (draft logits [T, Vd], feedback [T, H]); appends to `cache`. `key_mask`
        [T, S] (S = cache length after the append) replaces the causal mask."""
        m = self.midlayer
        table = self.embed_tokens.weight if (self.s.has_embedding or embed is None) else embed
        e = table[token_ids]
        residual = m.hidden_norm(hidden) if self.s.norm_before_residual else hidden
        x = torch.cat([m.input_layernorm(e), m.hidden_norm(hidden)], dim=-1)
        h = residual + self._attention(x, positions, cache, key_mask)
        h = h + m.mlp(m.post_attention_layernorm(h))
        normed = self.norm(h)
        logits = self.lm_head(normed)
        return logits, (normed if self.s.norm_output else h)

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits):
        full = torch.full(draft_logits.shape[:-1] + (self.s.vocab,), float("-inf"))
        full[..., torch.arange(self.s.draft_vocab) + self.d2t] = draft_logits
        return full

    # ------------------------------------------------------------------ checkpoints
    def _layer_fields(self, with_rope: bool) -> dict:
        s = self.s
        d = {
            "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "num_hidden_layers": 1, "vocab_size": s.vocab,
            "rms_norm_eps": s.eps, "hidden_act": "silu",
            "max_position_embeddings": s.max_position_embeddings,
            "attention_bias": s.attention_bias, "tie_word_embeddings": False,
            "model_type": "llama",
        }
        if with_rope:
            d["rope_theta"] = s.rope_theta
            d["rope_scaling"] = s.rope_scaling
        return d

    def save_native(self, out_dir, *, weights: str = "safetensors", with_rope: bool = True,
                    with_aux_ids: bool = True, include_vocab: bool = True,
                    architecture: str = "LlamaForCausalLM", overrides: dict | None = None):
        """SafeAILab layout: midlayer.* keys, LlamaForCausalLM-style config."""
        s = self.s
        os.makedirs(out_dir, exist_ok=True)
        cfg = {"architectures": [architecture], **self._layer_fields(with_rope),
               "draft_vocab_size": s.draft_vocab, "torch_dtype": "float32"}
        if s.target_hidden != s.hidden:
            cfg["target_hidden_size"] = s.target_hidden
        for flag in ("fc_norm", "norm_before_fc", "norm_before_residual", "norm_output"):
            if getattr(s, flag):
                cfg[flag] = True
        if with_aux_ids:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(s.aux_ids)
        cfg.update(overrides or {})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        state = self.checkpoint_state("midlayer", include_vocab)
        if weights == "bin":
            torch.save(state, os.path.join(out_dir, "pytorch_model.bin"))
        else:
            from safetensors.torch import save_file

            save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return out_dir

    def save_speculators(self, out_dir, *, with_rope: bool = True, verifier: str = "test/target",
                         overrides: dict | None = None):
        """speculators layout: layers.0.* keys, speculators_model_type eagle3."""
        from safetensors.torch import save_file

        s = self.s
        os.makedirs(out_dir, exist_ok=True)
        cfg = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"],
                                         **self._layer_fields(with_rope)},
            "draft_vocab_size": s.draft_vocab,
            "target_hidden_size": s.target_hidden,
            "norm_before_residual": s.norm_before_residual,
            "norm_before_fc": s.norm_before_fc,
            "fc_norm": s.fc_norm,
            "norm_output": s.norm_output,
            "eagle_aux_hidden_state_layer_ids": list(s.aux_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
            },
            "torch_dtype": "float32",
        }
        cfg.update(overrides or {})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        save_file(self.checkpoint_state("layers.0"), os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        return out_dir


def run_chain(ref: TorchEagleDrafter, aux, tokens, embed=None, steps: int = 3):
    """Step 0 over the prompt (T features + next tokens, positions 0..T-1), then
    `steps - 1` single-token steps fed with the previous feedback and the argmax
    draft token mapped to a target id. Returns per step (draft_logits,
    target_logits, feedback, next_target_token)."""
    cache = RefCache(ref.s)
    t = tokens.shape[0]
    out = []
    with torch.no_grad():
        hidden = ref.project(aux)
        toks, pos = tokens, torch.arange(t)
        for i in range(steps):
            logits, fb = ref.step(toks, hidden, pos, cache, embed)
            nxt = int(ref.to_target_ids(logits[-1].argmax()))
            out.append((logits, ref.target_logits(logits), fb, nxt))
            toks, hidden, pos = torch.tensor([nxt]), fb[-1:], torch.tensor([t + i])
    return out


def run_ttt(ref: TorchEagleDrafter, aux, tokens, embed=None, steps: int = 2):
    """Training-time-test unroll (EAGLE.md section 6) without loss: step 0 is
    causal over the T positions; step i >= 1 reads the feedback of step i-1,
    the teacher-forced tokens shifted left by i (zero padded), RoPE positions
    t + i, and sees the causal step-0 keys plus its own position's key of each
    later step (the diagonal). Returns the draft logits [T, Vd] of each step."""
    cache = RefCache(ref.s)
    t = tokens.shape[0]
    out = []
    with torch.no_grad():
        hidden = ref.project(aux)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        for i in range(steps):
            toks = torch.cat([tokens[i:], tokens.new_zeros(i)])
            mask = torch.cat([causal] + [torch.eye(t, dtype=torch.bool)] * i, dim=1)
            logits, hidden = ref.step(toks, hidden, torch.arange(t) + i, cache, embed, key_mask=mask)
            out.append(logits)
    return out
