"""The engine drafts exactly what the training-time test trains.

Greedy chain drafting of k tokens per verify step, simulated from the
teacher-forced TTT predictions (train/ttt.py `unroll` over the target's own
greedy text: step i at drafter position t predicts x_{t+2+i}), must accept
the same number of tokens at the same steps as the real engine. A pairing
error anywhere between the two (features at t with token t+1 in the prefill,
the features gathered along the accepted path, the feedback of step i) shows
up as a different count.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from spec_helpers import random_prompts, tiny_drafter, tiny_target

from eagle_jax.config import SpecConfig
from eagle_jax.generate import Generator
from eagle_jax.train import features, ttt


def _simulate(preds, seq, prompt_len, n_new, k):
    """(accepted, verify steps) of a greedy k-chain driven by teacher-forced predictions."""
    t, emitted, accepted, steps = prompt_len - 1, 1, 0, 0
    while emitted < n_new:
        j = 0
        while j < k and t + 2 + j < len(seq) and preds[j][t] == seq[t + 2 + j]:
            j += 1
        n = min(j + 1, n_new - emitted)
        accepted += min(j, n)
        emitted += n
        steps += 1
        t += n
    return accepted, steps


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
@pytest.mark.parametrize("k", [1, 3])
def test_engine_acceptance_equals_teacher_forced_simulation(variant, k):
    tcfg, tparams = tiny_target(vocab=8, scale=0.5)
    dcfg, dparams, vocab = tiny_drafter(tcfg, variant, scale=0.5)
    prompts = random_prompts(tcfg.vocab_size, [5, 9, 14])
    n_new = 40
    plain = Generator(tcfg, tparams).generate(prompts, max_new_tokens=n_new, chat=False)
    spec = Generator(tcfg, tparams, drafter=(dcfg, dparams, vocab),
                     spec=SpecConfig(method="chain", num_speculative_tokens=k)).generate(
        prompts, max_new_tokens=n_new, chat=False)
    assert spec.token_ids == plain.token_ids

    target_ids = jnp.asarray(vocab.target_ids, jnp.int32)
    total = 0
    for row, (p, g) in enumerate(zip(prompts, plain.token_ids)):
        seq = p + g
        tokens = jnp.asarray([seq], jnp.int32)
        aux, _, _ = features.target_features(tparams, tcfg, tokens, aux_layers=dcfg.aux_layer_ids,
                                             head=features.draft_head(tparams, tcfg, target_ids), t2d=vocab.t2d,
                                             argmax_mode="skip")
        logits = ttt.unroll(dparams, dcfg, tparams["embed"], aux, tokens,
                            jnp.asarray([len(seq)], jnp.int32), k)
        preds = [np.asarray(target_ids[jnp.argmax(lg[0], -1)]) for lg in logits]
        want = _simulate(preds, seq, len(p), n_new, k)
        st = spec.stats_of([row])
        assert (st["accepted_tokens"], st["num_verify_steps"]) == want, (row, st, want)
        total += want[0]
    assert total > 0  # the drafter is accepted sometimes: the comparison is not vacuous
