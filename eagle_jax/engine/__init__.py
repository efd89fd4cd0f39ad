"""The decoding engine: continuous batching over rows, its static-batch path, one request type,
the draft policy.

engine.py runs requests (admission, chunked prefill, steps over row buckets, stop strings);
batch.py runs rows that start together to their end in one device loop; request.py is what a
client submits and hears back; policy.py picks each step's draft depth; lockstep.py carries the
engine's calls from process 0 to the others when its mesh spans processes.
"""

from eagle_jax.engine.batch import BatchOutput, batch_inputs, padded_prompt_len, run_batch
from eagle_jax.engine.engine import Engine, fitting_max_len
from eagle_jax.engine.policy import DraftPolicy, draft_depths
from eagle_jax.engine.request import (Delta, Done, EngineError, Request, Sampling, SpecCounts, sampling_arrays,
                                      spec_counts)

__all__ = ["BatchOutput", "batch_inputs", "padded_prompt_len", "run_batch", "Engine", "fitting_max_len", "DraftPolicy",
           "draft_depths", "Delta", "Done", "EngineError", "Request", "Sampling", "SpecCounts", "sampling_arrays",
           "spec_counts"]
