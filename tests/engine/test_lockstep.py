"""One engine over several processes (engine/lockstep.py), in one process: a follower engine that
makes the leader's calls, received through a channel, ends in the leader's state, bit for bit,
whatever the leader's scheduler decided (admissions, queueing, draft depths, cancellations, stop
strings). tests/mesh/test_mesh.py runs it across two real processes."""

from __future__ import annotations

import json
import os
import queue
import sys
import threading

import jax
import numpy as np
import pytest

from eagle_jax.config import SpecConfig
from eagle_jax.engine import Engine, EngineError, Sampling
from eagle_jax.engine.lockstep import Channel
from eagle_jax.generate import Generator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode"))
import spec_helpers as H  # noqa: E402


class QueueChannel(Channel):
    """Calls through a queue, as JSON text (what the key-value store carries)."""

    def __init__(self, q: queue.Queue, leads: bool):
        self.q, self.leads, self.sent = q, leads, []

    def send(self, call):
        self.sent.append(call[0])
        self.q.put(json.dumps(call))

    def receive(self):
        return tuple(json.loads(self.q.get(timeout=600)))


def test_a_follower_making_the_leaders_calls_ends_in_the_leaders_state():
    cfg, params = H.tiny_target(vocab=16)
    gen = Generator(cfg, params, H.word_tokenizer(16), drafter=H.tiny_drafter(cfg, "eagle3.1"),
                    spec=SpecConfig(num_speculative_tokens=3, disable_by_batch_size=1), impl="xla")
    q = queue.Queue()
    # steps over two running rows are plain, over one they draft 3 deep: both, and catch-ups between
    kw = dict(max_rows=2, max_len=128, adaptive=False, prefill_chunk=16, prefill_budget=16)
    follower = Engine(gen, channel=QueueChannel(q, leads=False), **kw)
    with pytest.raises(EngineError, match="follows the engine of process 0"):
        follower.submit([1, 2, 3], Sampling(max_new_tokens=4))
    followed = threading.Thread(target=follower.follow)
    followed.start()
    channel = QueueChannel(q, leads=True)
    leader = Engine(gen, channel=channel, **kw)
    with pytest.raises(EngineError, match="runs its own loop"):
        leader.follow()
    ids = H.random_prompts(16, [5, 20, 9, 33])
    reqs = [leader.submit(ids[0], Sampling(max_new_tokens=24)),
            leader.submit(ids[1], Sampling(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)),
            leader.submit(ids[2], Sampling(max_new_tokens=30, stop=("t3",))),  # queued: two rows
            leader.submit(ids[3], Sampling(max_new_tokens=60))]
    for _ in reqs[3]:  # cancelled once it has started
        reqs[3].cancel()
        break
    done = [list(r)[-1] for r in reqs]
    assert done[3].finish_reason == "abort" and done[0].finish_reason == "length"
    leader.close()
    followed.join(timeout=600)
    assert not followed.is_alive() and follower.closed
    assert {"fill", "prefill_chunk", "catch_up", "step_rows", "read", "finish", "drop"} <= set(channel.sent) or \
        {"fill", "prefill_chunk", "catch_up", "step_rows", "read", "finish"} <= set(channel.sent)
    assert set(leader.steps) == {0, 3}
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), leader._state, follower._state)
    assert all(jax.tree.leaves(same)), same
    assert int(np.asarray(leader._state.num_generated).sum()) > 0
