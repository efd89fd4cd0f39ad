"""The decoding engine: continuous batching over rows, one request type, the draft policy.

engine.py runs requests (admission, chunked prefill, steps over row buckets, stop strings);
request.py is what a client submits and hears back; policy.py picks each step's draft depth.
"""

from eagle_jax.engine.engine import Engine, fitting_max_len
from eagle_jax.engine.policy import DraftPolicy, draft_depths
from eagle_jax.engine.request import (Delta, Done, EngineError, Request, Sampling, SpecCounts, sampling_arrays,
                                      spec_counts)

__all__ = ["Engine", "fitting_max_len", "DraftPolicy", "draft_depths", "Delta", "Done", "EngineError", "Request",
           "Sampling", "SpecCounts", "sampling_arrays", "spec_counts"]
