"""An independent PyTorch EAGLE-3 / EAGLE 3.1 drafter with multi-head latent attention,
written from vLLM's computation (docs/notes/mla-drafter.md), not from the JAX code.

vLLM's `Eagle3DeepseekV2ForCausalLM` (model_executor/models/deepseek_eagle3.py) runs one
`DeepseekV2Eagle3DecoderLayer`: DeepSeek-V2's `DeepseekV2MLAAttention` built with
input_size 2H, a dense `DeepseekV2MLP`, and RoPE "deepseek_yarn"
(`DeepseekScalingRotaryEmbedding`, interleaved pairs: is_neox_style=False). Here the
attention expands the keys and values per head and keeps them in a plain growing cache
(vLLM's kernels attend from the latent; the scores are the same), so the absorbed-latent
attention of eagle_jax is checked against the textbook form.

    h   = fc(concat(fc_norm_i(aux_i)))                      (fc_norm; else fc(aux))
    e   = input_layernorm(embed(next_ids))
    res = hidden_norm(h) if norm_before_residual else h;  x = concat(e, hidden_norm(h))
    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))   (q_proj(x) without q_lora_rank), per head [Dn | Dr]
    c, k_pe = kv_a_proj_with_mqa(x);  k_nope, v = kv_b_proj(kv_a_layernorm(c)) per head
    q_pe, k_pe rotated (interleaved pairs, YaRN inv_freq, cos/sin x mscale(f, mscale) / mscale(f, mscale_all_dim))
    attn = softmax(q.k * (Dn + Dr)^-1/2 * mscale(f, mscale_all_dim)^2) v    causal over the cache
    h   = res + o_proj(attn);  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h));  feedback = norm(h) if norm_output else h
Every RMSNorm (q_a / kv_a included) has eps = rms_norm_eps, as vLLM builds them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class MLASpec:
    hidden: int = 32
    intermediate: int = 48
    heads: int = 4
    q_lora_rank: int | None = 24
    kv_lora_rank: int = 16
    qk_nope: int = 8
    qk_rope: int = 8
    v_head: int = 12
    vocab: int = 40
    target_hidden: int = 24
    aux_ids: tuple = (2, 4, 5)
    eps: float = 1e-5
    rope_theta: float = 50000.0
    # DeepSeek YaRN keys as a Kimi config writes them, or None (no scaling)
    rope_scaling: dict | None = None
    fc_norm: bool = True
    norm_output: bool = True
    norm_before_residual: bool = False


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.float32)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_cos_sin(s: MLASpec, positions: torch.Tensor):
    """cos, sin [T, Dr] in vLLM's interleaved layout (each frequency twice in a row)."""
    d, base = s.qk_rope, s.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = s.rope_scaling
    if sc is None:
        inv, mscale = 1.0 / pos_freqs, 1.0
    else:
        f = sc["factor"]

        def correction_dim(rot):
            return d * math.log(sc["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(sc["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(sc["beta_slow"])), d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp
        inv = (1.0 / (f * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        mscale = yarn_get_mscale(f, sc["mscale"]) / yarn_get_mscale(f, sc["mscale_all_dim"])
    freqs = positions.to(torch.float64)[:, None] * inv[None]
    cos, sin = (freqs.cos() * mscale).float(), (freqs.sin() * mscale).float()
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def rotate_gptj(x):
    """vLLM's rotate_gptj: (x0, x1) -> (-x1, x0) for each interleaved pair."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, s: MLASpec):
        super().__init__()
        self.s = s
        qk = s.heads * (s.qk_nope + s.qk_rope)
        if s.q_lora_rank is None:
            self.q_proj = nn.Linear(2 * s.hidden, qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(2 * s.hidden, s.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, s.eps)
            self.q_b_proj = nn.Linear(s.q_lora_rank, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * s.hidden, s.kv_lora_rank + s.qk_rope, bias=False)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.eps)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, s.heads * (s.qk_nope + s.v_head), bias=False)
        self.o_proj = nn.Linear(s.heads * s.v_head, s.hidden, bias=False)

    def softmax_scale(self) -> float:
        s = self.s
        scale = (s.qk_nope + s.qk_rope) ** -0.5
        if s.rope_scaling is not None:
            m = yarn_get_mscale(s.rope_scaling["factor"], s.rope_scaling["mscale_all_dim"])
            scale *= m * m
        return scale

    def forward(self, x, positions, cache: "RefCache"):
        s = self.s
        t = x.shape[0]
        q = self.q_proj(x) if s.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, s.heads, s.qk_nope + s.qk_rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, s.heads, s.qk_nope + s.v_head)
        k_nope, v = kv.split([s.qk_nope, s.v_head], dim=-1)
        cos, sin = rope_cos_sin(s, positions)
        cos, sin = cos[:, None], sin[:, None]
        q_pe = q[..., s.qk_nope:] * cos + rotate_gptj(q[..., s.qk_nope:]) * sin
        k_pe = k_pe[:, None] * cos + rotate_gptj(k_pe[:, None]) * sin  # one rope key shared by the heads
        q = torch.cat([q[..., :s.qk_nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, s.heads, s.qk_rope)], dim=-1)
        past = cache.k.shape[0]
        cache.k, cache.v = torch.cat([cache.k, k]), torch.cat([cache.v, v])
        scores = torch.einsum("thd,shd->hts", q, cache.k).float() * self.softmax_scale()
        causal = torch.arange(cache.k.shape[0])[None] <= past + torch.arange(t)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal[None], float("-inf")), dim=-1)
        out = torch.einsum("hts,shd->thd", probs, cache.v).reshape(t, s.heads * s.v_head)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, s: MLASpec):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: MLASpec):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.self_attn = MLAAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)


class RefCache:
    """Expanded keys [S, heads, Dn + Dr] and values [S, heads, Dv], growing."""

    def __init__(self, s: MLASpec):
        self.k = torch.zeros(0, s.heads, s.qk_nope + s.qk_rope)
        self.v = torch.zeros(0, s.heads, s.v_head)


class TorchMLADrafter(nn.Module):
    def __init__(self, s: MLASpec):
        super().__init__()
        self.s = s
        a = len(s.aux_ids)
        self.fc = nn.Linear(a * s.target_hidden, s.hidden, bias=False)
        self.fc_norm = nn.ModuleList([RMSNorm(s.target_hidden, s.eps) for _ in range(a)]) if s.fc_norm else None
        self.layers = nn.ModuleList([DecoderLayer(s)])
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)

    def randomize(self, seed: int, scale: float = 0.15) -> "TorchMLADrafter":
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(scale * torch.randn(p.shape, generator=g))
        return self

    def project(self, aux):
        """aux [T, A*Ht] -> [T, H]."""
        if self.fc_norm is not None:
            chunks = aux.split(self.s.target_hidden, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, token_ids, hidden, positions, cache: RefCache, embed):
        """token_ids [T], hidden [T, H], positions [T] -> (logits [T, V], feedback [T, H]),
        appending the T tokens' keys and values to `cache` (vLLM's forward order)."""
        m = self.layers[0]
        e = m.input_layernorm(embed[token_ids])
        if self.s.norm_before_residual:
            hidden = m.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, m.hidden_norm(hidden)
        h = residual + m.self_attn(torch.cat([e, hidden], dim=-1), positions, cache)
        h = h + m.mlp(m.post_attention_layernorm(h))
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.s.norm_output else h)

    def config(self) -> dict:
        """The drafter's config.json: the fields vLLM's Eagle3 DeepSeek layer reads, in a Kimi
        drafter's layout (tests/convert/test_mla_drafter.py, `kimi_k26_eagle31_mla`)."""
        s = self.s
        return {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2",
                "hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": 1,
                "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "q_lora_rank": s.q_lora_rank,
                "kv_lora_rank": s.kv_lora_rank, "qk_nope_head_dim": s.qk_nope, "qk_rope_head_dim": s.qk_rope,
                "v_head_dim": s.v_head, "hidden_act": "silu", "rms_norm_eps": s.eps, "vocab_size": s.vocab,
                "draft_vocab_size": s.vocab, "target_hidden_size": s.target_hidden, "torch_dtype": "float32",
                "rope_theta": s.rope_theta, "rope_scaling": s.rope_scaling, "max_position_embeddings": 4096,
                "fc_norm": s.fc_norm, "norm_output": s.norm_output, "norm_before_residual": s.norm_before_residual,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(s.aux_ids), "use_aux_hidden_state": True}}

    def save(self, out_dir) -> str:
        """config.json + model.safetensors with vLLM's keys (`layers.0.*`, TorchSpec's export)."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config(), f, indent=2)
        state = {k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return out_dir


def run_chain(ref: TorchMLADrafter, aux, tokens, embed, steps: int = 3):
    """Step 0 over the T prompt positions, then `steps - 1` single-token steps fed with the
    previous feedback and the argmax token. Returns per step (logits, feedback, next token)."""
    cache = RefCache(ref.s)
    t = tokens.shape[0]
    out = []
    with torch.no_grad():
        hidden = ref.project(aux)
        toks, pos = tokens, torch.arange(t)
        for i in range(steps):
            logits, fb = ref.step(toks, hidden, pos, cache, embed)
            nxt = int(logits[-1].argmax())
            out.append((logits, fb, nxt))
            toks, hidden, pos = torch.tensor([nxt]), fb[-1:], torch.tensor([t + i])
    return out
