"""One engine over several processes: the leader's engine calls, made in the same order by the others.

On a mesh that spans processes (`runtime.initialize_distributed`, one process per host), every
process must run the same jitted programs in the same order with the same host arguments: each
program is one SPMD computation whose collectives join every process's devices. Process 0, the
leader, runs the HTTP server and the engine's scheduler. Before each of its engine calls
(`Engine._call`: admit a prompt into a row, prefill a chunk, catch up, step at a depth, read,
end rows) it sends the call's name and host arguments through a `Channel`; every other process,
a follower, runs `Engine.follow`, which receives the calls one by one and makes them. Only host
decisions travel (which request goes into which row with which settings, the draft depth, which
rows end), never arrays, as vLLM's multi-node executors broadcast the scheduler's output.

The channel is the JAX runtime's own coordination service (its key-value store, which
`jax.distributed.initialize` starts on process 0): no other transport, no extra port. Call n of
an engine is the JSON text at key ``eagle-jax/engine/<k>/<n>``; a follower blocks on the next key (in `poll_s` waits, so an
idle server costs nothing), and the leader deletes call n - `keep` as it sends call n (a
follower cannot lag that far: every step is a collective that waits for it).
"""

from __future__ import annotations

import itertools
import json

import jax

__all__ = ["Channel", "KeyValueChannel", "default_channel"]


class Channel:
    """Where the leader's engine calls go (`send`) and the followers read them (`receive`), in order.
    `leads`: whether this process is the one that sends."""
    leads: bool

    def send(self, call: tuple) -> None:
        raise NotImplementedError

    def receive(self) -> tuple:
        raise NotImplementedError


class KeyValueChannel(Channel):
    """A `Channel` over the JAX coordination service's key-value store (`client`: the
    `jax.distributed` client of this process)."""

    def __init__(self, client, leads: bool, name: str = "eagle-jax/engine", keep: int = 4096,
                 poll_s: float = 60.0):
        self.client, self.leads, self.name, self.keep, self.poll_ms = client, leads, name, keep, int(poll_s * 1e3)
        self.n = 0

    def send(self, call: tuple) -> None:
        self.client.key_value_set(f"{self.name}/{self.n}", json.dumps(call))
        if self.n >= self.keep:
            self.client.key_value_delete(f"{self.name}/{self.n - self.keep}")
        self.n += 1

    def receive(self) -> tuple:
        key = f"{self.name}/{self.n}"
        while True:
            try:
                text = self.client.blocking_key_value_get(key, self.poll_ms)
                break
            except jax.errors.JaxRuntimeError as e:  # its timeout: idle, wait on; anything else is fatal
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        self.n += 1
        return tuple(json.loads(text))


_ENGINES = itertools.count()  # engines made in this process: every process makes the same ones in order


def default_channel(mesh) -> Channel | None:
    """The channel of an engine on `mesh`: None unless the mesh spans processes (then the
    coordination service's, process 0 leading, under a name of its own: the k-th engine a
    process makes is the k-th of every process)."""
    if mesh is None or len({d.process_index for d in mesh.devices.flat}) < 2:
        return None
    from jax._src.distributed import global_state  # the client jax.distributed.initialize made

    if global_state.client is None:
        raise RuntimeError("a mesh over several processes needs jax.distributed.initialize first")
    return KeyValueChannel(global_state.client, leads=jax.process_index() == 0,
                           name=f"eagle-jax/engine/{next(_ENGINES)}")
