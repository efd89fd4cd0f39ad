"""The drafter training loop: one `Trainer` run, from its starting drafter to its export.

    cfg = TrainConfig(output_dir="runs/x", steps=2000, ...)
    trainer = Trainer(cfg, target_cfg, target_params, train_examples, vocab,
                      eval_prompts=[[...token ids...], ...], tokenizer=tok)
    summary = trainer.run()

A run is made of the modules beside this one: its settings (train/config.py), its starting
drafter (train/initialize.py), the optimiser and jitted step (train/step.py) over the target's
features (train/features.py), its checkpoints (train/checkpoint.py: a killed run resumes from the
last one, with the batches the uninterrupted run would have seen), and what it leaves to read
(train/card.py: log, curves, model card). This module runs the loop: resume or start, one step a
batch, log, evaluate through the real engine (greedy chain, `evaluate_acceptance`), checkpoint,
export the drafter (speculators format by default) and, when asked, the training state
(train/state.py) and a learning-curve point (benchmarks/learning_curve.py).

``resume_from`` (a committed training state) starts from the state's drafter, continues its data
cursor when the data order is the same, and adds the state's steps and token positions to the
run's. The embedding is the target's ``embed`` [V, H], passed to every step as a frozen input:
it is not part of the trained parameters, the optimiser state, the checkpoints or the export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from eagle_jax.config import ConfigError, DrafterConfig, TargetConfig
from eagle_jax.kernels import ops
from eagle_jax.models import drafter, target
from eagle_jax.sharding import MeshShape, make_mesh, parse_mesh, shard_model, state_shardings
from eagle_jax.train import checkpoint
from eagle_jax.train import features as features_lib
from eagle_jax.train.card import model_card, plot_curves, read_log
from eagle_jax.train.config import DTYPES, TrainConfig
from eagle_jax.train.initialize import (build_drafter_config, init_drafter_params, init_source, load_init_drafter,
                                        widen_lm_head, widen_mlp)
from eagle_jax.train.step import iter_batches, make_optimizer, make_train_step, optimizer_key

__all__ = ["Trainer", "evaluate_acceptance"]

# ----------------------------------------------------------------------------- evaluation

def _local_rows(mesh, batch_size: int) -> slice:
    """The rows of a [batch_size, ...] batch split over `mesh`'s data axis that this process's
    devices hold (one contiguous range: a process holds whole data shards)."""
    held = NamedSharding(mesh, PartitionSpec("data")).addressable_devices_indices_map((batch_size,))
    starts = sorted({(ix[0].start or 0, ix[0].stop or batch_size) for ix in held.values()})
    first, last = starts[0][0], starts[-1][1]
    if sum(b - a for a, b in starts) != last - first:
        raise ConfigError(f"this process holds rows {starts} of the batch: not one range (the mesh's data axis "
                          "must give each process whole, adjacent shards)")
    return slice(first, last)


def evaluate_acceptance(tcfg: TargetConfig, tparams, tokenizer, dcfg: DrafterConfig, dparams,
                        vocab, prompts: Sequence[Sequence[int]], *, k: int = 5,
                        max_new_tokens: int = 48, mesh: MeshShape | None = None) -> dict:
    """Greedy chain drafting with k tokens through `eagle_jax.generate.Generator` (on `mesh`)."""
    from eagle_jax.config import SpecConfig
    from eagle_jax.generate import Generator

    dtype = tparams["embed"].dtype
    dp = jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), dparams)
    gen = Generator(tcfg, tparams, tokenizer, drafter=(dcfg, dp, vocab),
                    spec=SpecConfig("chain", num_speculative_tokens=k, disable_by_batch_size=None),
                    unroll_layers=False, mesh=mesh)  # acceptance only: the scanned layers compile faster
    t0 = time.perf_counter()
    res = gen.generate([list(map(int, p)) for p in prompts], max_new_tokens=max_new_tokens)
    wall = time.perf_counter() - t0
    s = res.stats
    return {"tau": s.get("acceptance_length"), "per_position": s.get("per_position_acceptance"),
            "draft_acceptance_rate": s.get("draft_acceptance_rate"),
            "verify_steps": s.get("num_verify_steps"), "generated": res.num_generated,
            "wall_s": wall, "k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens}


# ----------------------------------------------------------------------------- trainer

# Jitted steps and feature passes, shared by trainers with the same static settings.
_JIT_CACHE: dict = {}

# Settings whose change makes a resumed run differ from the uninterrupted one.
_RESUME_KEYS = ("variant", "parallel_drafting", "mask_token_id", "draft_vocab_size", "intermediate_size", "batch_size",
                "seq_len", "bucket_lengths", "ttt_length",
                "step_decay", "labels", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2",
                "grad_clip", "dtype", "target_dtype", "param_dtype", "seed", "data", "max_conversations", "target",
                "steps", "init_from", "resume_from")
# The settings a learning-curve point and a training state record.
_RECORDED_KEYS = ("target", "variant", "parallel_drafting", "mask_token_id", "draft_vocab_size", "intermediate_size",
                  "ttt_length", "step_decay", "labels", "lr", "warmup_steps", "min_lr_ratio", "steps", "batch_size",
                  "seq_len", "bucket_lengths",
                  "dtype", "target_dtype", "param_dtype", "seed", "data", "max_conversations", "heldout_fraction",
                  "init_from", "resume_from", "output_dir")


class Trainer:
    """One training run (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, target_cfg: TargetConfig, target_params,
                 train_examples: Sequence[Mapping], vocab: drafter.DraftVocab, *,
                 eval_prompts: Sequence[Sequence[int]] = (), tokenizer=None,
                 data_info: Mapping | None = None, pad_id: int = 0):
        cfg.validate()
        self.cfg = cfg
        # On a mesh: the target over its model axis (its fused projections regrouped, its config
        # saying so), the batches over its data axis, the drafter's state as `cfg.fsdp` says.
        self.mesh_shape = parse_mesh(cfg.mesh) if cfg.mesh else None
        self.mesh = make_mesh(self.mesh_shape) if self.mesh_shape and self.mesh_shape.devices > 1 else None
        if self.mesh is not None:
            target_cfg, target_params = shard_model(target.Target, target_cfg, target_params, self.mesh)
        # Several processes (one per host, `runtime.initialize_distributed`): each builds only the
        # batch rows its devices hold; process 0 alone writes the log, exports and the model card.
        self.lead = jax.process_index() == 0
        self.local_rows = _local_rows(self.mesh, cfg.batch_size) if jax.process_count() > 1 else None
        if self.local_rows is not None and (cfg.feature_cache or cfg.learning_curve):
            raise ConfigError("a multi-process run keeps no feature cache and measures no learning curve: "
                              "drop feature_cache / --learning-curve (measure the exported drafter afterwards: "
                              "eagle-jax bench --suite learning-curve)")
        self.tcfg = target_cfg
        self.tparams = target_params
        self.examples = train_examples
        self.vocab = vocab
        self.eval_prompts = [list(p) for p in eval_prompts][: cfg.eval_prompts]
        if cfg.parallel_drafting and self.eval_prompts:
            # the engine drafts sequentially; a parallel drafter is measured teacher-forced
            # (benchmarks/teacher_forced.py: per-position accuracy and the greedy chain's tau)
            print("[train] parallel drafting: no evaluation through the engine", file=sys.stderr)
            self.eval_prompts = []
        self.tokenizer = tokenizer
        self.data_info = dict(data_info or {})
        self.pad_id = pad_id
        from eagle_jax.train import state as state_lib

        self.resume_state = state_lib.read_state(cfg.resume_from) if cfg.resume_from else None
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "train_log.jsonl"
        self.dcfg = build_drafter_config(target_cfg, cfg)
        self.compute_dtype = DTYPES[cfg.dtype]
        # the target pass may run in another dtype than the drafter (target_dtype: bf16 features on CPU)
        feature_dtype = DTYPES[cfg.target_dtype or cfg.dtype]
        self.feature_params = (target_params if jax.tree.leaves(target_params)[0].dtype == feature_dtype
                               else jax.tree.map(lambda x: jnp.asarray(x, feature_dtype), target_params))
        # the decoder layers of the feature pass run on the native kernels' packed weights where they load
        # (benchmarks/results/analysis.md, "Training twice as fast on CPU")
        try:  # once: the jitted step and feature pass carry it
            self.impl = ops.resolve_on_devices(cfg.impl, self.mesh.size if self.mesh is not None else 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.forward_params = (target.prepare_for_decoding(self.feature_params, target_cfg, impl=self.impl)
                               if self.impl == "native" else None)
        self.param_dtype = DTYPES[cfg.param_dtype]
        self.tx, self.schedule = make_optimizer(cfg)
        # Jitted functions are shared by trainers with the same static settings (a restarted
        # trainer in the same process does not compile again).
        self.state_sharding = None  # on a mesh: the training state's NamedShardings (`init_state`)
        if self.mesh is not None:
            shapes = jax.eval_shape(lambda: self._fresh_state(0))
            self.state_sharding = state_shardings(shapes, self.mesh, fsdp=cfg.fsdp)
        step_key = ("step", self.dcfg, optimizer_key(cfg), cfg.ttt_length, cfg.step_decay, cfg.labels,
                    cfg.dtype, self.impl, self.mesh, cfg.fsdp)
        if step_key not in _JIT_CACHE:
            _JIT_CACHE[step_key] = make_train_step(self.dcfg, self.tx, ttt_length=cfg.ttt_length,
                                                   step_decay=cfg.step_decay, labels=cfg.labels,
                                                   compute_dtype=self.compute_dtype, impl=self.impl,
                                                   state_sharding=self.state_sharding)
        self.train_step = _JIT_CACHE[step_key]
        # the in-vocabulary test multiplies each device's own columns of the head (`vocab_shards`)
        vocab_shards = features_lib.vocab_shards(self.feature_params)
        feat_key = ("features", target_cfg, self.dcfg.aux_layer_ids, cfg.argmax_mode, self.impl,
                    cfg.feature_cache, self.mesh, vocab_shards)
        if feat_key not in _JIT_CACHE:
            _JIT_CACHE[feat_key] = features_lib.make_feature_fn(
                target_cfg, self.dcfg.aux_layer_ids, argmax_mode=cfg.argmax_mode, vocab_shards=vocab_shards,
                impl=self.impl, return_normed=cfg.feature_cache)
        self.feature_fn = _JIT_CACHE[feat_key]
        self.logits_fn = jax.jit(features_lib.draft_vocab_logits)
        # the head's draft-vocabulary columns, taken once (on a mesh: split over the model axis)
        self.draft_head = features_lib.draft_head(self.feature_params, target_cfg,
                                                  jnp.asarray(vocab.target_ids, jnp.int32))
        if self.mesh is not None:
            self.draft_head = jax.device_put(self.draft_head, NamedSharding(self.mesh, PartitionSpec(
                None, "model" if self.draft_head.shape[1] % self.mesh.shape["model"] == 0 else None)))
        self.t2d = jnp.asarray(vocab.t2d, bool)
        self.feature_cache = None
        if cfg.feature_cache:
            meta = {"target": target_cfg.name_or_path or cfg.target, "aux": list(self.dcfg.aux_layer_ids),
                    "dtype": cfg.target_dtype or cfg.dtype, "vocab": int(np.asarray(vocab.target_ids).sum()),
                    "n": len(train_examples), "seq_len": cfg.seq_len, "argmax": cfg.argmax_mode}
            self.feature_cache = features_lib.FeatureCache(
                cfg.feature_cache_dir or (self.out / "features"), meta)
        self._mngr = None
        self.widened = False  # set by init_state: the starting drafter's vocabulary was smaller
        self.widened_mlp_from = None  # set by init_state: the starting drafter's MLP width, when smaller

    # -------------------------------------------------------------- state and checkpoints
    def init_state(self) -> dict:
        key = jax.random.PRNGKey(self.cfg.seed)
        key, sub = jax.random.split(key)
        source = init_source(self.cfg)
        if source:
            params, vocab = load_init_drafter(source, self.dcfg, self.tcfg, self.param_dtype)
            if self.dcfg.parallel_drafting and "mask_hidden" not in params:  # from a sequential drafter
                params["mask_hidden"] = drafter.init_mask_hidden(self.dcfg, jax.random.fold_in(sub, 2),
                                                                 self.param_dtype)
            self.widened = len(vocab.target_ids) < len(self.vocab.target_ids)
            if self.widened:
                params = widen_lm_head(params, vocab, self.vocab, self.tcfg, self.tparams)
            elif not np.array_equal(np.asarray(vocab.target_ids), np.asarray(self.vocab.target_ids)):
                raise ConfigError(f"init_from {source}: its draft vocabulary differs from the "
                                  "one given to the trainer")
            width = params["layer"]["w_down"].shape[0]
            if width < self.dcfg.intermediate_size:
                self.widened_mlp_from = width
                params = widen_mlp(params, self.dcfg.intermediate_size, jax.random.fold_in(sub, 1))
        else:
            return self._placed(self._fresh_state(self.cfg.seed))  # the same key as `key, sub` above
        return self._placed({"step": jnp.zeros((), jnp.int32), "params": params,
                             "opt_state": self.tx.init(params), "key": key})

    def _fresh_state(self, seed) -> dict:
        """A new drafter's training state (random weights, the target's head and norm)."""
        key, sub = jax.random.split(jax.random.PRNGKey(seed))
        params = init_drafter_params(self.dcfg, self.tcfg, self.tparams, self.vocab, sub, dtype=self.param_dtype)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params), "key": key}

    def _placed(self, state: dict) -> dict:
        """The state laid out as the train step takes it (on a mesh: `self.state_sharding`)."""
        return state if self.state_sharding is None else jax.device_put(state, self.state_sharding)

    def _rows(self, x) -> jax.Array:
        """A batch array on the device(s): on a mesh split over the data axis by rows (with several
        processes, `x` holds this process's rows, `self.local_rows`, of the global batch)."""
        if self.mesh is None:
            return jnp.asarray(x)
        rows = NamedSharding(self.mesh, PartitionSpec("data"))
        if self.local_rows is None:
            return jax.device_put(x, rows)
        return jax.make_array_from_process_local_data(rows, np.asarray(x), (self.cfg.batch_size, *x.shape[1:]))

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def manager(self):
        if self._mngr is None:
            self._mngr = checkpoint.manager(self.ckpt_dir, self.cfg.max_to_keep)
        return self._mngr

    def save(self, state, meta: dict) -> None:
        checkpoint.save(self.manager(), state, meta)

    def restore(self, template) -> tuple[dict, dict] | None:
        return checkpoint.restore(self.manager(), template)

    # -------------------------------------------------------------- logging
    def _log(self, rec: dict) -> None:
        if not self.lead:
            return
        with open(self.log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -------------------------------------------------------------- features
    def batch_features(self, batch) -> dict:
        tokens = self._rows(batch["input_ids"])
        idx = batch["example_indices"]
        fc = self.feature_cache
        if fc is not None and fc.has_all([i for i in idx if i >= 0]) and fc.num_shards:
            aux, normed, in_vocab = fc.collate(idx, tokens.shape[1], self.dcfg.fc_in_size)
            aux = self._rows(aux).astype(self.compute_dtype)
            normed = self._rows(normed).astype(self.compute_dtype)
            logits = self.logits_fn(normed, self.draft_head)
            feats = features_lib.Features(aux, logits, self._rows(in_vocab))
        elif fc is not None:
            feats, normed = self.feature_fn(self.feature_params, tokens, self.draft_head, self.t2d,
                                            self.forward_params)
            aux_h, normed_h, iv_h = np.asarray(feats.aux), np.asarray(normed), np.asarray(feats.in_vocab)
            for r, k in enumerate(idx):
                if k >= 0:
                    n = int(batch["lengths"][r])
                    fc.add(int(k), aux_h[r, :n], normed_h[r, :n], iv_h[r, :n])
        else:
            feats = self.feature_fn(self.feature_params, tokens, self.draft_head, self.t2d, self.forward_params)
        return {"input_ids": tokens, "loss_mask": self._rows(batch["loss_mask"]),
                "lengths": self._rows(batch["lengths"]), "aux": feats.aux.astype(self.compute_dtype),
                "target_logits": feats.logits, "in_vocab": feats.in_vocab}

    # -------------------------------------------------------------- evaluation
    def evaluate(self, params, step: int) -> dict | None:
        if not self.eval_prompts:
            return None
        rec = evaluate_acceptance(self.tcfg, self.tparams, self.tokenizer, self.dcfg, params,
                                  self.vocab, self.eval_prompts, k=self.cfg.eval_k,
                                  max_new_tokens=self.cfg.eval_max_new_tokens, mesh=self.mesh_shape)
        rec = {"type": "eval", "step": step, **rec}
        self._log(rec)
        try:
            if self.lead:
                plot_curves(self.log_path, self.out / "training_curves.png")
        except Exception as e:  # a plot must never stop training
            print(f"[train] plot failed: {e}", file=sys.stderr)
        return rec

    # -------------------------------------------------------------- main loop
    def run(self, *, stop_after: int | None = None) -> dict:
        """Train to ``cfg.steps`` (or stop after ``stop_after`` more steps, for tests)."""
        cfg = self.cfg
        state = self.init_state()
        start, elapsed_before, positions = 0, 0.0, 0
        restored = self.restore(state) if cfg.resume else None
        if not cfg.resume and self.ckpt_dir.exists() and self.manager().latest_step() is not None:
            raise FileExistsError(f"{self.ckpt_dir} holds checkpoints and resume is off: "
                                  "use another output_dir or --resume")
        if restored is not None:
            state, meta = restored
            old = meta.get("config") or {}
            # a key missing from an older checkpoint's config had its default then
            defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
            changed = {k: [old.get(k, defaults[k]), getattr(cfg, k)] for k in _RESUME_KEYS
                       if old.get(k, defaults[k]) != getattr(cfg, k)}
            if changed:
                print(f"[train] warning: resuming with changed {', '.join(changed)} "
                      f"(was {', '.join(repr(v[0]) for v in changed.values())}): the run is no longer the "
                      "continuation of the checkpointed one", file=sys.stderr)
            self._log({"type": "resume", "step": int(meta["step"]), "cursor": int(meta["cursor"]),
                       "changed": changed})
            start = int(meta["cursor"])
            elapsed_before = float(meta.get("elapsed_s", 0.0))
            positions = int(meta.get("token_positions", 0))
            print(f"[train] resumed from step {int(meta['step'])} (cursor {start})", file=sys.stderr)
        elif self.resume_state is not None:
            from eagle_jax.train import state as state_lib

            start, why = state_lib.start_batch(self.resume_state["cursor"], self.data_cursor(0))
            self._log({"type": "resume_from", "state": cfg.resume_from, "drafter": self.resume_state["drafter"],
                       "state_step": self.resume_state["step"],
                       "state_token_positions": self.resume_state["token_positions"], "start_batch": start,
                       "why": why})
            print(f"[train] starting from the state {cfg.resume_from}: {why}", file=sys.stderr)
        embed = jnp.asarray(self.tparams["embed"])
        step = int(state["step"])
        end = cfg.steps if stop_after is None else min(cfg.steps, step + stop_after)
        evals = []
        if cfg.eval_at_start and step == 0 and end > 0:
            evals.append(self.evaluate(state["params"], 0))
        batches = iter_batches(self.examples, cfg.batch_size, cfg.seq_len, seed=cfg.seed, start=start,
                               bucket_lengths=cfg.bucket_lengths, pad_id=self.pad_id, rows=self.local_rows)
        bar = None
        if cfg.progress and self.lead:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=step, dynamic_ncols=True, desc="train", file=sys.stderr)
        t_run = time.perf_counter()
        tokens_seen = real_seen = 0
        train_s = 0.0  # step time after the first (compiling) step
        compile_s = None
        last = {}
        cursor = start
        scope = partial(jax.set_mesh, self.mesh) if self.mesh is not None else contextlib.nullcontext
        while step < end:
            batch = next(batches)
            t0 = time.perf_counter()
            with scope():  # the Pallas kernels run on each device's block of the mesh
                feats = self.batch_features(batch)
                state, m = self.train_step(state, embed, feats)
            m = jax.device_get(m)
            dt = time.perf_counter() - t0
            cursor = batch["index"] + 1
            step += 1
            ntok = cfg.batch_size * int(batch["input_ids"].shape[1])  # the whole batch's, on every process
            nreal = batch["real_tokens"]
            positions += ntok
            if compile_s is None:
                compile_s = dt
            else:
                tokens_seen += ntok
                real_seen += nreal
                train_s += dt
            spent = train_s
            tok_s = tokens_seen / spent if tokens_seen and spent > 0 else float("nan")
            last = {"type": "train", "step": step, "loss": float(m["loss"]),
                    "loss_i": [float(x) for x in m["loss_i"]], "acc_i": [float(x) for x in m["acc_i"]],
                    "count_i": [int(x) for x in m["count_i"]], "grad_norm": float(m["grad_norm"]),
                    "lr": float(self.schedule(step - 1)), "step_s": dt, "tokens": ntok,
                    "real_tokens": nreal, "tok_s": tok_s,
                    "real_tok_s": real_seen / spent if real_seen and spent > 0 else float("nan"),
                    "epoch": int(batch["epoch"]),
                    "elapsed_s": elapsed_before + time.perf_counter() - t_run}
            if step % cfg.log_every == 0 or step == end:
                self._log(last)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}",
                                acc="/".join(f"{a:.2f}" for a in last["acc_i"]),
                                tok_s=f"{tok_s:.0f}")
            meta = {"step": step, "cursor": cursor, "elapsed_s": last["elapsed_s"],
                    "token_positions": positions, "config": cfg.to_dict()}
            if step % cfg.save_every == 0 or step == cfg.steps:
                self.save(state, meta)
            if cfg.eval_every and step % cfg.eval_every == 0 and step != cfg.steps:
                evals.append(self.evaluate(state["params"], step))
        if bar is not None:
            bar.close()
        if self.feature_cache is not None:
            self.feature_cache.flush()
        if not last:  # resumed at the end (e.g. to export): the last step is in the log
            last = next((r for r in reversed(read_log(self.log_path))
                         if r.get("type") == "train" and r.get("step", 0) <= step), {})
        summary = {"step": step, "last": last, "compile_s": compile_s, "token_positions": positions,
                   "wall_s": elapsed_before + time.perf_counter() - t_run}
        if step >= cfg.steps:
            final_eval = self.evaluate(state["params"], step) if self.eval_prompts else None
            summary["eval"] = final_eval
            params = state["params"] if self.local_rows is None else multihost_utils.process_allgather(
                state["params"], tiled=True)  # whole on every process (a collective: all take part)
        if step >= cfg.steps and self.lead:
            summary["start_eval"] = next((e for e in evals if e and e["step"] == 0), None) or next(
                (r for r in read_log(self.log_path) if r.get("type") == "eval" and r.get("step") == 0), None)
            try:
                plot_curves(self.log_path, self.out / "training_curves.png")
            except Exception as e:
                print(f"[train] plot failed: {e}", file=sys.stderr)
            if cfg.export:
                summary["export"] = str(self.export(params))
            self.write_model_card(summary)
            training = self.training_record(step, positions, cursor)
            if cfg.export_state:
                summary["state"] = str(self.export_state(training))
            if cfg.learning_curve:
                summary["learning_curve"] = self.append_learning_curve(training)
        if self.feature_cache is not None:
            summary["feature_cache_bytes"] = self.feature_cache.size_bytes()
        self.state = state
        return summary

    # -------------------------------------------------------------- training state, learning curve
    def data_cursor(self, next_batch: int) -> dict:
        """This run's data order (train/state.py CURSOR_KEYS) and the index of its next batch."""
        from eagle_jax.train import state as state_lib

        cfg = self.cfg
        return {"data": cfg.data, "max_conversations": cfg.max_conversations, "seed": cfg.seed,
                "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "examples_sha1": state_lib.examples_sha1(self.examples), "next_batch": int(next_batch)}

    def training_record(self, step: int, positions: int, cursor: int) -> dict:
        """Steps, token positions (with the state's when resumed from one), cursor, data and settings."""
        cfg, before = self.cfg, self.resume_state
        source = f"batch rows x padded length over the {step} steps of {cfg.output_dir} ({positions})"
        if before is not None:
            source += f" + the state {cfg.resume_from} ({before['token_positions']}: {before['token_positions_source']})"
        elif cfg.init_from:
            source += f" + the unrecorded positions of init_from {cfg.init_from}"
        run = {"date": time.strftime("%Y-%m-%d"), "output_dir": cfg.output_dir, "steps": step,
               "token_positions": positions, "start": cfg.resume_from or cfg.init_from or "random init"}
        return {"token_positions": positions + (before["token_positions"] if before else 0),
                "token_positions_source": source, "steps": step + (before["step"] if before else 0),
                "data": self.data_info.get("sources") or [{"source": cfg.data, "examples": len(self.examples)}],
                "settings": {k: getattr(cfg, k) for k in _RECORDED_KEYS},
                "runs": (before.get("runs", []) if before else []) + [run], "cursor": self.data_cursor(cursor)}

    def export_state(self, training: dict) -> Path:
        from eagle_jax.train import state as state_lib

        return state_lib.write_state(self.cfg.export_state, drafter=self.out / "drafter", copy_drafter=True,
                                     step=training["steps"], token_positions=training["token_positions"],
                                     token_positions_source=training["token_positions_source"],
                                     cursor=training["cursor"], data=training["data"],
                                     settings=training["settings"], runs=training["runs"])

    def append_learning_curve(self, training: dict) -> dict:
        """Measure the exported drafter at the learning curve's fixed setting (float32) and append its point."""
        from eagle_jax.benchmarks import learning_curve as lc
        from eagle_jax.convert.drafter_formats import load_drafter

        tcfg, tparams, tok = self.tcfg, self.tparams, self.tokenizer
        if tparams["embed"].dtype != jnp.float32:
            from eagle_jax.convert.registry import load_target

            lt = load_target(self.cfg.target, dtype="float32")
            tcfg, tparams, tok = lt.cfg, lt.params, lt.tokenizer
        heldout = lc.read_heldout_set(lc.HELDOUT_SET)
        drafter_dir = self.out / "drafter"
        measured = lc.measure(tcfg, tparams, tok, load_drafter(drafter_dir, tcfg), heldout)
        point = lc.make_point(os.path.basename(os.path.normpath(self.cfg.output_dir)), str(drafter_dir),
                              self.cfg.variant, {k: v for k, v in training.items() if k != "cursor"},
                              measured, heldout)
        lc.append_point(point, lc.CURVE_FILE)
        print(f"[train] learning curve: {lc.summary_line(point)}", file=sys.stderr)
        return point

    # -------------------------------------------------------------- export
    def export(self, params) -> Path:
        from eagle_jax.convert.drafter_formats import save_drafter

        dt = DTYPES[self.cfg.export_dtype] if self.cfg.export_dtype else None
        return save_drafter(self.out / "drafter", self.dcfg, jax.tree.map(np.asarray, params), self.vocab,
                            format=self.cfg.export_format, dtype=dt, overwrite=True)

    def write_model_card(self, summary: dict) -> None:
        text = model_card(self.cfg, self.dcfg, summary, self.data_info, self.log_path, widened=self.widened,
                          widened_mlp_from=self.widened_mlp_from)
        (self.out / "model_card.md").write_text(text)
        if (self.out / "drafter").is_dir():
            (self.out / "drafter" / "model_card.md").write_text(text)
