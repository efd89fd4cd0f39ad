"""The optimiser, the jitted training step and the order of its batches.

Optimiser: ``clip_by_global_norm(grad_clip)`` then AdamW (betas 0.9/0.95 by
default) with linear warmup to ``lr`` over ``warmup_steps`` and cosine
decay to ``lr * min_lr_ratio`` at ``steps``.

The step (`make_train_step`) is one training-time test (train/ttt.py) on a batch's target
features, its gradient clipped and applied; `iter_batches` is the endless, seeded batch order
from a global cursor (the same batches whether a run was interrupted or not).
"""

from __future__ import annotations

from functools import partial
from typing import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from eagle_jax.config import DrafterConfig
from eagle_jax.train import data as data_lib
from eagle_jax.train import ttt
from eagle_jax.train.config import TrainConfig

__all__ = ["make_schedule", "make_optimizer", "optimizer_key", "make_train_step", "iter_batches"]


def make_schedule(cfg: TrainConfig):
    warm = max(0, min(cfg.warmup_steps, cfg.steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warm,
        decay_steps=max(cfg.steps, warm + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def optimizer_key(cfg: TrainConfig) -> tuple:
    """The settings that tell two optimisers apart (trainers with equal keys share a jitted step)."""
    return (cfg.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio, cfg.weight_decay, cfg.beta1, cfg.beta2,
            cfg.grad_clip)


def make_optimizer(cfg: TrainConfig):
    schedule = make_schedule(cfg)
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=cfg.beta1, b2=cfg.beta2, weight_decay=cfg.weight_decay))
    return tx, schedule


def make_train_step(dcfg: DrafterConfig, tx, *, ttt_length: int, step_decay: float = 0.8,
                    labels: str = "soft", compute_dtype=jnp.float32, impl: str = "auto", state_sharding=None):
    """A jitted ``train_step(state, embed, batch) -> (state, metrics)`` (state donated).

    batch: input_ids, loss_mask, lengths, aux [B,T,A*Ht], target_logits
    [B,T,Vd] float32, in_vocab [B,T] bool. On a mesh (`state_sharding`: the state's
    NamedShardings, `sharding.state_shardings`) the new state keeps them; the batch comes
    split over the data axis and XLA's partitioner adds the gradients' reduction.
    """

    def loss_fn(params, embed, batch):
        p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
        logits = ttt.unroll(p, dcfg, embed.astype(compute_dtype), batch["aux"].astype(compute_dtype),
                            batch["input_ids"], batch["lengths"], ttt_length, impl=impl)
        return ttt.ttt_loss(logits, batch["target_logits"], batch["in_vocab"], batch["loss_mask"],
                            step_decay=step_decay, labels=labels, impl=impl)

    @partial(jax.jit, donate_argnums=(0,))
    def train_step(state, embed, batch):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], embed, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        m = dict(m, loss=loss, grad_norm=optax.tree.norm(grads))
        new = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        if state_sharding is not None:
            new = jax.lax.with_sharding_constraint(new, state_sharding)
        return new, m

    return train_step


def iter_batches(examples: Sequence[Mapping], batch_size: int, seq_len: int, *, seed: int = 0,
                 start: int = 0, bucket_lengths: Sequence[int] | None = None,
                 pad_id: int = 0, rows: slice | None = None) -> Iterator[dict]:
    """Endless ``data.batches`` from the global batch cursor ``start`` (of each batch, only
    ``rows`` when given); an error (not silence) when the examples cannot fill one batch."""
    if data_lib.num_batches(len(examples), batch_size, True) == 0:
        raise ValueError(f"{len(examples)} training examples cannot fill one batch of {batch_size}")
    return data_lib.batches(examples, batch_size, seq_len, seed=seed, start=start, epochs=None,
                            bucket_lengths=bucket_lengths, pad_id=pad_id, rows=rows)
