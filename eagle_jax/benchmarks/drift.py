"""Attention-drift diagnostics for EAGLE-3 / EAGLE 3.1 drafters.

    eagle-jax bench --suite drift [--quick] [--draft DIR ...] [--random-drafter both]

EAGLE 3.1's change (EAGLE.md section 4) targets two symptoms of a drafter fed
its own hidden states: the fed-back hidden state's scale drifts with chain
depth (EAGLE-3 feeds back the pre-norm residual stream) and attention
collapses onto the first tokens (attention sinks). For each drafter and each
prompt this module measures, teacher-free, from the end of the prompt:

* ``hidden_rms_by_depth[j]``: RMS of the hidden state the drafter reads when it
  drafts token j+1 of a greedy chain. Depth 1 reads the FC projection of
  the target's features (the prompt's last position); depth >= 2 reads the
  feedback of the previous drafter step. ``feature_rms_prompt`` is the
  mean RMS of the projected target features over the prompt, the scale the
  drafter was trained on at depth 1;
* ``sink_mass_by_depth[j]``: share of the drafter's attention probability (mean
  over heads) on the first 4 positions of the sequence for the query that
  drafts token j+1; ``sink_mass_prompt``: the same share averaged over the
  prompt's own queries (positions >= 16, where target features are the input);
* ``root_accepted``: how many of the D drafted tokens match the target's greedy
  continuation (the acceptance of this one chain);
* ``tau`` and ``per_position_acceptance``: a real speculative generation
  (``Generator``, chain of depth D, greedy) on the same prompt.

The attention probabilities are recomputed here from the drafter's own
parameters (the q/k projection, RoPE and GQA grouping of
``eagle_jax.models.drafter.Drafter.step``), alongside the real ``Drafter.step``
calls that advance the cache; model code is not modified.

Contexts: short prompts (HumanEval, held-out ShareGPT) and the long-context
set (about 1k, 2k, 4k, 7k tokens; ``benchmarks/datasets.py``).

Prompt formats (``--prompt-formats``, the short prompts only; the article's
robustness claim): ``template`` (the model's own chat template with its
default system prompt), ``system-short``, ``system-long``, ``system-code``
(the template with one of three other system prompts, of different lengths
and styles: ``SYSTEM_PROMPTS``) and ``raw`` (the user text with no template).
"""

from __future__ import annotations

import math
import statistics
import time
import jax
import jax.numpy as jnp
import numpy as np

SINK_TOKENS = 4
PROMPT_QUERY_MIN_POS = 16

SYSTEM_PROMPTS = {
    "system-short": "Answer briefly.",
    "system-long": (
        "You are a careful technical assistant working for a software company. Read the user's request "
        "in full before answering. Prefer precise, verifiable statements over general advice; when a "
        "question is ambiguous, state the assumption you make and answer under it. Use short paragraphs "
        "and numbered steps for procedures, put code in fenced blocks with the language named, and never "
        "invent APIs, file names or citations. If you do not know something, say so plainly and suggest "
        "how the user could find out. Keep a neutral, professional tone throughout."),
    "system-code": "You are an expert Python programmer. Reply with code only, no explanations.",
}
PROMPT_FORMATS = ("template", *SYSTEM_PROMPTS, "raw")


def format_prompt(tokenizer, text: str, fmt: str) -> list[int]:
    """Token ids of the user message `text` in prompt format `fmt` (one of `PROMPT_FORMATS`)."""
    if fmt == "raw":
        return tokenizer.encode(text)
    if fmt == "template":
        return tokenizer.apply_chat(text)
    if fmt not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown prompt format {fmt!r}; known: {', '.join(PROMPT_FORMATS)}")
    return tokenizer.apply_chat([{"role": "system", "content": SYSTEM_PROMPTS[fmt]},
                                 {"role": "user", "content": text}])


# ----------------------------------------------------------------------------- probe


def attention_probe(dparams, dcfg, tokens, hidden, positions, cache, embed, valid_len):
    """Sink share and input RMS for the queries of one `Drafter.step` call.

    tokens [B, T], hidden [B, T, H] (the step's hidden input), positions [B, T];
    cache: the drafter KV cache *before* the step (committed slots = positions
    0..lengths-1). `valid_len` [B]: keys at positions >= valid_len are ignored
    (padding of the last prompt chunk). Returns (sink [B, T], rms [B, T]).
    """
    from eagle_jax.kernels import fused_norm_matmul
    from eagle_jax.models.layers import split_heads
    from eagle_jax.nn import apply_rope, rope_tables

    layer = dparams["layer"]
    eps = dcfg.rms_norm_eps
    emb = dparams["embed"] if dcfg.has_embedding else embed
    e = jnp.take(emb, tokens, axis=0).astype(hidden.dtype)
    norms = jnp.stack([layer["input_layernorm"], layer["hidden_norm"]])
    qkv = fused_norm_matmul(jnp.concatenate([e, hidden], axis=-1), norms, layer["wqkv"], eps=eps,
                            segments=2, bias=layer.get("bqkv"))
    q, k, _ = split_heads(qkv, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim)
    cos, sin = rope_tables(positions, dcfg.rope, dcfg.head_dim)
    q = apply_rope(q, cos, sin).astype(jnp.float32)
    k = apply_rope(k, cos, sin).astype(jnp.float32)
    b, t, hq, d = q.shape
    hkv = dcfg.num_kv_heads
    g = hq // hkv
    qh = q.reshape(b, t, hkv, g, d)
    kc = cache.k[0].astype(jnp.float32)  # [B, Hkv, S, D]
    s_cache = jnp.einsum("btkgd,bksd->btkgs", qh, kc) / math.sqrt(d)
    s_new = jnp.einsum("btkgd,bukd->btkgu", qh, k) / math.sqrt(d)
    slots = jnp.arange(kc.shape[2])
    cache_ok = (slots[None] < cache.lengths[:, None])[:, None, None, None, :]  # [B,1,1,1,S]
    causal = positions[:, :, None] >= positions[:, None, :]
    new_ok = (causal & (positions[:, None, :] < valid_len[:, None, None]))[:, :, None, None, :]
    s_cache = jnp.where(cache_ok, s_cache, -jnp.inf)
    s_new = jnp.where(new_ok, s_new, -jnp.inf)
    peak = jnp.maximum(s_cache.max(-1, keepdims=True), s_new.max(-1, keepdims=True))
    w_cache = jnp.where(cache_ok, jnp.exp(s_cache - peak), 0.0)
    w_new = jnp.where(new_ok, jnp.exp(s_new - peak), 0.0)
    denom = w_cache.sum(-1) + w_new.sum(-1)
    sink_c = jnp.where((slots < SINK_TOKENS)[None, None, None, None, :], w_cache, 0.0).sum(-1)
    sink_n = jnp.where((positions < SINK_TOKENS)[:, None, None, None, :], w_new, 0.0).sum(-1)
    sink = ((sink_c + sink_n) / jnp.maximum(denom, 1e-30)).mean(axis=(2, 3))  # [B, T]
    rms = jnp.sqrt(jnp.mean(jnp.square(hidden.astype(jnp.float32)), axis=-1))
    return sink, rms


def _make_target_chunk(cfg, aux_layers):
    from eagle_jax.models import target

    @jax.jit
    def f(tparams, tokens, positions, cache):
        return target.Target(cfg, tparams)(tokens, positions, cache, aux_layers=aux_layers)

    return f


def _make_drafter_step(dcfg, with_features: bool):
    from eagle_jax.models import drafter

    @jax.jit
    def f(dparams, embed, tokens, x, positions, cache, valid_len, logits_at):
        model = drafter.Drafter(dcfg, dparams)
        hidden = model.project_features(x) if with_features else x
        sink, rms = attention_probe(dparams, dcfg, tokens, hidden, positions, cache, embed, valid_len)
        logits, feedback, cache = model.step(tokens, hidden, positions, cache, embed=embed, logits_at=logits_at)
        return sink, rms, logits[:, 0], feedback, cache

    return f


def probe_prompt(target_cfg, tparams, dcfg, dparams, vocab, ids: list[int], depth: int,
                 chunk: int = 256, fns: dict | None = None) -> dict:
    """Prefill target and drafter on `ids`, then draft a greedy chain of `depth` tokens."""
    from eagle_jax.models import drafter, target

    fns = {} if fns is None else fns
    n = len(ids)
    c = min(chunk, 16 * math.ceil(n / 16))
    p = c * math.ceil(n / c)
    cache_len = 64 * math.ceil((p + depth + 2) / 64)
    dtype = tparams["embed"].dtype
    key = ("t", target_cfg, dcfg.aux_layer_ids)
    if key not in fns:
        fns[key] = _make_target_chunk(target_cfg, dcfg.aux_layer_ids)
    tfwd = fns[key]
    for name, feats in (("dfeat", True), ("dfb", False)):
        if (name, dcfg) not in fns:
            fns[(name, dcfg)] = _make_drafter_step(dcfg, feats)
    dstep_f, dstep_h = fns[("dfeat", dcfg)], fns[("dfb", dcfg)]

    tokens = np.zeros((1, p), np.int32)
    tokens[0, :n] = ids
    tcache = target.create_cache(target_cfg, 1, cache_len, dtype)
    auxes, last_h = [], None
    for s in range(0, p, c):
        pos = jnp.arange(s, s + c, dtype=jnp.int32)[None]
        h, tcache, aux = tfwd(tparams, jnp.asarray(tokens[:, s:s + c]), pos, tcache)
        tcache = tcache.commit(jnp.full((1,), c, jnp.int32))
        auxes.append(aux)
        if s <= n - 1 < s + c:
            last_h = h[:, n - 1 - s]
    first = int(jnp.argmax(target.Target(target_cfg, tparams).logits(last_h), -1)[0])
    dtok = np.zeros((1, p), np.int32)
    dtok[0, :n - 1] = ids[1:]
    dtok[0, n - 1] = first
    dcache = drafter.create_cache(dcfg, 1, cache_len, dtype)
    valid = jnp.array([n], jnp.int32)
    sinks, rmss = [], []
    root_logits = root_fb = None
    for i, s in enumerate(range(0, p, c)):
        pos = jnp.arange(s, s + c, dtype=jnp.int32)[None]
        at = jnp.array([min(max(n - 1 - s, 0), c - 1)], jnp.int32)
        sink, rms, logits, fb, dcache = dstep_f(dparams, tparams["embed"], jnp.asarray(dtok[:, s:s + c]),
                                               auxes[i], pos, dcache, valid, at)
        dcache = dcache.commit(jnp.full((1,), c, jnp.int32))
        sinks.append(np.asarray(sink[0]))
        rmss.append(np.asarray(rms[0]))
        if s <= n - 1 < s + c:
            root_logits, root_fb = logits, fb[:, n - 1 - s]
    sink_all = np.concatenate(sinks)[:n]
    rms_all = np.concatenate(rmss)[:n]
    dcache = dcache.replace(lengths=jnp.array([n], jnp.int32))
    # greedy chain from the root (token `first` at position n-1 has been processed)
    target_ids = np.asarray(vocab.target_ids)
    drafted = [int(target_ids[int(jnp.argmax(root_logits[0]))])]
    hidden_rms = [float(rms_all[n - 1])]
    sink_depth = [float(sink_all[n - 1])]
    fb_out_rms = [float(jnp.sqrt(jnp.mean(jnp.square(root_fb.astype(jnp.float32)))))]
    fb = root_fb
    for j in range(1, depth):
        pos = jnp.array([[n - 1 + j]], jnp.int32)
        sink, rms, logits, fb_new, dcache = dstep_h(
            dparams, tparams["embed"], jnp.array([[drafted[-1]]], jnp.int32), fb[:, None, :], pos, dcache,
            jnp.array([n + j], jnp.int32), jnp.zeros((1,), jnp.int32))
        dcache = dcache.commit(jnp.ones((1,), jnp.int32))
        hidden_rms.append(float(rms[0, 0]))
        sink_depth.append(float(sink[0, 0]))
        fb = fb_new[:, 0]
        fb_out_rms.append(float(jnp.sqrt(jnp.mean(jnp.square(fb.astype(jnp.float32))))))
        drafted.append(int(target_ids[int(jnp.argmax(logits[0]))]))
    mask = np.arange(n) >= min(PROMPT_QUERY_MIN_POS, max(n - 1, 0))
    return {
        "prompt_tokens": n, "first_token": first, "drafted": drafted,
        "hidden_rms_by_depth": hidden_rms, "feedback_out_rms_by_depth": fb_out_rms,
        "sink_mass_by_depth": sink_depth,
        "feature_rms_prompt": float(rms_all[mask].mean()),
        "sink_mass_prompt": float(sink_all[mask].mean()),
    }


def _prefix_match(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


# ----------------------------------------------------------------------------- suite


def run(args, log) -> dict:
    from eagle_jax.benchmarks import datasets as ds
    from eagle_jax.benchmarks import harness as H
    from eagle_jax.benchmarks.drafters import resolve_drafters
    from eagle_jax.config import SpecConfig
    from eagle_jax.convert.registry import load_target
    from eagle_jax.generate import Generator
    from eagle_jax.runtime import default_dtype, enable_compilation_cache

    quick = args.quick
    depth = args.drift_depth or 6
    max_new = args.max_new_tokens or 64
    lengths = args.long_lengths if args.long_lengths is not None else ([1024] if quick else list(ds.LONG_CONTEXT_LENGTHS))
    lengths = [x for x in lengths if x > 0]
    per_length = args.long_per_length or (1 if quick else 2)
    n_short = args.num_prompts or (1 if quick else 4)
    result = H.result_header("drift")
    result["mode"] = args.label or ("quick" if quick else "full")
    result["settings"] = {"depth": depth, "max_new_tokens": max_new, "long_lengths": lengths,
                          "long_per_length": per_length, "short_prompts_per_dataset": n_short,
                          "sink_tokens": SINK_TOKENS, "prompt_query_min_pos": PROMPT_QUERY_MIN_POS}
    enable_compilation_cache()
    dtype = args.dtype or default_dtype()
    t = load_target(args.target, dtype=dtype)
    drafters, notes = resolve_drafters(args, t, args.target, log)
    result["notes"] = notes
    result["drafters"] = [{k: v for k, v in d.items() if k != "bundle"} for d in drafters]
    if not drafters:
        result["notes"].append("no drafter to diagnose: pass --draft DIR or --random-drafter")
        result["records"] = []
        return result
    suite = ds.build_suite(t.tokenizer, humaneval=n_short, sharegpt=n_short, long_lengths=lengths,
                           long_per_length=per_length)
    result["datasets"] = ds.summarize_suite(suite)
    formats = list(args.prompt_formats or ["template"])
    prompts = [(p, "short", f) for name in ("humaneval", "sharegpt") for p in suite.get(name, []) for f in formats]
    prompts += [(p, p.meta["target_tokens"], "template") for p in suite.get("long", [])]
    result["settings"]["prompt_formats"] = formats
    result["settings"]["system_prompts"] = {f: SYSTEM_PROMPTS[f] for f in formats if f in SYSTEM_PROMPTS}
    plain = Generator(t.cfg, t.params, t.tokenizer)
    ids_of = {(p.id, f): format_prompt(t.tokenizer, p.text, f) for p, _, f in prompts}
    log(f"{len(prompts)} prompts; continuations from plain greedy decoding")
    cont = {}
    for p, _, f in prompts:
        r = plain.generate([ids_of[p.id, f]], max_new_tokens=depth + 1)
        cont[p.id, f] = r.token_ids[0]
    records = []
    fns: dict = {}
    for d in drafters:
        dcfg, dparams, vocab = d["bundle"]
        gen = Generator(t.cfg, t.params, t.tokenizer, drafter=d["bundle"],
                        spec=SpecConfig(method="chain", num_speculative_tokens=depth, disable_by_batch_size=None))
        for p, ctx, f in prompts:
            t0 = time.perf_counter()
            rec = probe_prompt(t.cfg, t.params, dcfg, dparams, vocab, ids_of[p.id, f], depth, fns=fns)
            c = cont[p.id, f]
            rec["root_accepted"] = _prefix_match(rec["drafted"], c[1:1 + depth]) if c and c[0] == rec["first_token"] else 0
            r = gen.generate([ids_of[p.id, f]], max_new_tokens=max_new)
            rec.update({"drafter": d["tag"], "label": d["label"], "variant": d["variant"],
                        "random_init": d["random_init"], "dataset": p.dataset, "prompt_id": p.id,
                        "context": ctx, "format": f, "tau": r.stats.get("acceptance_length"),
                        "per_position_acceptance": r.stats.get("per_position_acceptance"),
                        "draft_acceptance_rate": r.stats.get("draft_acceptance_rate"),
                        "generated_tokens": r.num_generated, "seconds": time.perf_counter() - t0})
            records.append(rec)
            log(f"{d['tag']} {p.id} [{f}] ({rec['prompt_tokens']} tok): tau {rec['tau']}, "
                f"rms {['%.2f' % x for x in rec['hidden_rms_by_depth']]}, "
                f"sink prompt {rec['sink_mass_prompt']:.2f} drafted {rec['sink_mass_by_depth'][-1]:.2f}")
    result["records"] = records
    result["summary"] = summarize(records, depth)
    return result


def summarize(records: list[dict], depth: int) -> list[dict]:
    """Means per (drafter, context, prompt format), contexts ordered short, then by length, formats
    in `PROMPT_FORMATS` order. ``tau_by_depth[k-1]``: the acceptance length of a chain of depth k,
    1 + the per-position acceptance summed over positions 1..k (greedy: a depth-k chain drafts the
    first k tokens of the depth-D one)."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["drafter"], r["context"], r.get("format", "template")), []).append(r)

    def mean_vec(key, rs):
        vs = [r[key] for r in rs if r.get(key)]
        if not vs:
            return []
        m = min(len(v) for v in vs)
        return [float(np.mean([v[i] for v in vs])) for i in range(m)]

    out = []
    def order(kv):
        (dr, ctx, f), _ = kv
        return dr, -1 if ctx == "short" else ctx, PROMPT_FORMATS.index(f) if f in PROMPT_FORMATS else len(PROMPT_FORMATS)

    for (dr, ctx, f), rs in sorted(groups.items(), key=order):
        taus = [r["tau"] for r in rs if r.get("tau") is not None]
        per_pos = mean_vec("per_position_acceptance", rs)
        out.append({
            "drafter": dr, "label": rs[0]["label"], "variant": rs[0]["variant"],
            "random_init": rs[0]["random_init"], "context": ctx, "format": f, "num_prompts": len(rs),
            "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in rs])),
            "tau": statistics.mean(taus) if taus else None,
            "per_position_acceptance": per_pos,
            "tau_by_depth": [float(1 + sum(per_pos[:k])) for k in range(1, len(per_pos) + 1)],
            "hidden_rms_by_depth": mean_vec("hidden_rms_by_depth", rs),
            "feedback_out_rms_by_depth": mean_vec("feedback_out_rms_by_depth", rs),
            "sink_mass_by_depth": mean_vec("sink_mass_by_depth", rs),
            "feature_rms_prompt": float(np.mean([r["feature_rms_prompt"] for r in rs])),
            "sink_mass_prompt": float(np.mean([r["sink_mass_prompt"] for r in rs])),
            "root_accepted_mean": float(np.mean([r["root_accepted"] for r in rs])),
        })
    return out
