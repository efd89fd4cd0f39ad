"""Training data for the drafter: ShareGPT reading, chat rendering with loss
masks, a fixed held-out split, fixed-shape batches and a tokenized cache.

Pipeline::

    convs = iter_sharegpt(limit=2000)                    # normalised conversations
    train, heldout = split_conversations(convs, 0.02)    # fixed split by id
    examples = tokenize_conversations(train, tok, max_length=2048)
    for batch in batches(examples, batch_size=8, seq_len=2048, seed=0, start=cursor):
        ...

Conversation format (what :func:`iter_sharegpt` yields and :func:`render`
takes)::

    {"id": "QWJhYvA_0", "messages": [{"role": "system"|"user"|"assistant",
                                       "content": str}, ...]}

Example format (what :func:`render` / :func:`tokenize_conversations` return)::

    {"id": str, "input_ids": int32 [T], "loss_mask": int32 [T]}

Loss-mask convention (the one trap EAGLE.md section 6 warns about):
``loss_mask[t] == 1`` means token ``t`` is a *response* token, i.e. a token
the target model generates as the assistant: the content tokens of an
assistant turn plus the end-of-turn token (``<|im_end|>`` for ChatML) that
closes it.  Everything else is 0: system and user turns, the
``<|im_start|>assistant\\n`` header, the newline the template writes after
``<|im_end|>``, and padding.  The mask is indexed by the *label* position: a
model that predicts token ``t`` from position ``t - 1`` is trained at
``t - 1`` iff ``loss_mask[t] == 1`` (``loss_mask[0]`` is always 0).

One module per stage: ``sharegpt`` (reading, normalising), ``heldout`` (the
split), ``chat`` (rendering, loss masks), ``batching`` (fixed-shape batches),
``examples`` (the tokenized cache); this package exposes their public names.
"""

from eagle_jax.train.data.batching import batch_plan, batches, collate, num_batches
from eagle_jax.train.data.chat import render, tokenize_conversations
from eagle_jax.train.data.examples import (
    CACHE_FORMAT, load_examples, load_or_build_cache, save_examples, tokenizer_fingerprint)
from eagle_jax.train.data.heldout import base_id, is_heldout, split_conversations
from eagle_jax.train.data.sharegpt import (
    ROLE_MAP, SHAREGPT_FILENAME, iter_json_array, iter_sharegpt, iter_sharegpt_records,
    normalize_conversation, sharegpt_path)

__all__ = [
    "SHAREGPT_FILENAME",
    "ROLE_MAP",
    "CACHE_FORMAT",
    "sharegpt_path",
    "iter_json_array",
    "iter_sharegpt_records",
    "normalize_conversation",
    "iter_sharegpt",
    "base_id",
    "is_heldout",
    "split_conversations",
    "render",
    "tokenize_conversations",
    "batch_plan",
    "num_batches",
    "batches",
    "collate",
    "tokenizer_fingerprint",
    "save_examples",
    "load_examples",
    "load_or_build_cache",
]
