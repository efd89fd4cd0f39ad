"""Peer engines on the same weights, for ratios against eagle-jax in the same run.

* ``transformers``: `LlamaForCausalLM.generate` on the SmolLM2 GGUF loaded
  with ``gguf_file=`` (the dequantised Q4_1 tensors, PyTorch float32), plain
  greedy decoding; ``transformers-pld``: the same with prompt-lookup decoding
  (``prompt_lookup_num_tokens=10``).
* ``llama.cpp-*`` (only when ``llama-cpp-python`` is importable; it is an
  optional extra): the same GGUF run by llama.cpp, at F32 and F16 (copies
  written once with ``llama_cpp.llama_model_quantize``, ``LLAMA_FTYPE_ALL_F32``
  / ``LLAMA_FTYPE_MOSTLY_F16``, ``allow_requantize``, cached under
  ``$EAGLE_JAX_CACHE/peers``; F16 is the peer of eagle-jax bfloat16) and
  natively at Q4_1, each plain and with ``LlamaPromptLookupDecoding(num_pred_tokens=10)``.

Every peer takes the prompt as the token ids eagle-jax encoded (same chat
template, same tokenizer), decodes greedily at batch 1, stops at the same end
tokens and is timed from the call to the last token (TTFT: to the first
generated token).

Threads: with `threads="auto"` (the default) each peer is calibrated once on
a short greedy run at 1 thread and at every core the process may use, and
keeps the faster setting (recorded with both rates). On a shared machine a
2-thread OpenMP (PyTorch) or ggml thread pool can be several times slower
than 1 thread when other jobs hold the cores, so a fixed thread count would
measure the contention rather than the engine. eagle-jax keeps XLA's
default thread pool (not tuned), which favours the peers, if anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time

from eagle_jax.benchmarks.harness import RunRecord

PLD_TOKENS = 10


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def peer_cache_dir() -> str:
    root = os.path.expanduser(os.environ.get("EAGLE_JAX_CACHE") or "~/.cache/eagle_jax")
    path = os.path.join(root, "peers")
    os.makedirs(path, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- transformers


def load_transformers_model(gguf_path: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(_threads())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
    return model.eval()


class _FirstTokenTimer:
    """A `generate` streamer noting when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


class TransformersEngine:
    kind = "transformers"
    max_batch = 1

    def __init__(self, name: str, model, eos_ids, *, prompt_lookup: int | None = None):
        self.name = name
        self.model = model
        self.eos_ids = list(eos_ids)
        self.prompt_lookup = prompt_lookup
        self.threads = None  # None: leave torch's setting alone
        self.calibration = None

    def set_threads(self, n: int) -> None:
        self.threads = n

    def describe(self) -> dict:
        import torch
        import transformers

        return {"engine": self.kind, "method": "prompt-lookup" if self.prompt_lookup else "plain",
                "setting": f"prompt_lookup_num_tokens={self.prompt_lookup}" if self.prompt_lookup else None,
                "dtype": "float32", "weights": "GGUF Q4_1 dequantised (gguf_file=)",
                "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
                "threads": self.threads or torch.get_num_threads(), "thread_calibration": self.calibration}

    def run(self, ids, max_new_tokens, temperature, seed) -> RunRecord:
        import torch

        if len(ids) != 1:
            raise ValueError("the transformers peer runs batch 1 only")
        if temperature != 0:
            raise ValueError("the transformers peer is benchmarked greedy only")
        if self.threads:
            torch.set_num_threads(self.threads)  # global in torch: both transformers peers set theirs
        x = torch.tensor([ids[0]], dtype=torch.long)
        timer = _FirstTokenTimer()
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                  top_k=None, eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0],
                  attention_mask=torch.ones_like(x), streamer=timer)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, **kw)
        wall = time.perf_counter() - t0
        gen = out[0, x.shape[1]:].tolist()
        gen = _cut_at_eos(gen, self.eos_ids)
        ttft = (timer.first - t0) if timer.first is not None else None
        return RunRecord(token_ids=[gen], wall_s=wall, ttft_s=ttft)


def _cut_at_eos(tokens: list[int], eos_ids) -> list[int]:
    eos = set(eos_ids)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


# ----------------------------------------------------------------------------- llama.cpp


def llama_cpp_status() -> dict:
    """Whether llama-cpp-python is importable (and why not)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # ImportError, or a broken build raising OSError
        return {"available": False, "reason": f"{type(e).__name__}: {e}"}
    return {"available": True, "version": getattr(llama_cpp, "__version__", None)}


def requantized_gguf(src: str, precision: str, out_dir: str | None = None) -> str:
    """An F32 or F16 copy of `src` (requantised by llama.cpp), written once and cached."""
    import llama_cpp

    ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}[precision]
    st = os.stat(src)
    base = os.path.splitext(os.path.basename(src))[0]
    base = base.rsplit(".", 1)[0] if base.upper().endswith(("Q4_1", "Q4_0", "Q8_0", "F16")) else base
    out = os.path.join(out_dir or peer_cache_dir(), f"{base}.{precision}-{st.st_size}-{st.st_mtime_ns}.gguf")
    if os.path.isfile(out):
        return out
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = _threads()
    tmp = out + ".tmp"
    with _quiet_fds():  # llama.cpp logs every tensor on the C stdout
        rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0 or not os.path.isfile(tmp):
        raise RuntimeError(f"llama_model_quantize({src} -> {precision}) returned {rc}")
    os.replace(tmp, out)
    return out


@contextlib.contextmanager
def _quiet_fds():
    """Send the process's C-level stdout/stderr to /dev/null for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


class LlamaCppEngine:
    kind = "llama.cpp"
    max_batch = 1

    def __init__(self, name: str, model_path: str, eos_ids, *, precision: str,
                 prompt_lookup: int | None = None, n_ctx: int = 2048):
        import llama_cpp

        self.name = name
        self.model_path = model_path
        self.precision = precision
        self.prompt_lookup = prompt_lookup
        self.eos_ids = set(eos_ids)
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
        with _quiet_fds():  # model-load logs go to the C stderr even with verbose=False
            self.llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_batch=512,
                                       n_threads=_threads(), n_threads_batch=_threads(),
                                       draft_model=draft, verbose=False, seed=0)
        self.eos_ids.add(int(self.llm.token_eos()))
        self.threads = _threads()
        self.calibration = None

    def set_threads(self, n: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.llm._ctx.ctx, n, n)
        self.threads = n

    def describe(self) -> dict:
        import llama_cpp

        return {"engine": self.kind, "method": "prompt-lookup" if self.prompt_lookup else "plain",
                "setting": f"num_pred_tokens={self.prompt_lookup}" if self.prompt_lookup else None,
                "dtype": self.precision, "weights": os.path.basename(self.model_path),
                "versions": {"llama_cpp_python": llama_cpp.__version__}, "threads": self.threads,
                "thread_calibration": self.calibration}

    def run(self, ids, max_new_tokens, temperature, seed) -> RunRecord:
        if len(ids) != 1:
            raise ValueError("the llama.cpp peer runs batch 1 only")
        if temperature != 0:
            raise ValueError("the llama.cpp peer is benchmarked greedy only")
        self.llm.reset()  # no KV/prefix reuse between runs: every run prefills the prompt
        out: list[int] = []
        t0 = time.perf_counter()
        first = None
        for tok in self.llm.generate(list(ids[0]), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return RunRecord(token_ids=[out], wall_s=wall, ttft_s=None if first is None else first - t0)


# ----------------------------------------------------------------------------- assembly


def calibrate_threads(engine, ids: list[int], *, tokens: int = 16, log=print) -> dict:
    """Time a short greedy run at 1 thread and at all cores; keep the faster. Returns {threads: tok/s}."""
    candidates = sorted({1, _threads()})
    rates = {}
    for n in candidates:
        engine.set_threads(n)
        engine.run([ids], 2, 0.0, 0)  # warm-up at this setting
        r = engine.run([ids], tokens, 0.0, 0)
        rates[n] = len(r.token_ids[0]) / r.wall_s
    best = max(rates, key=rates.get)
    engine.set_threads(best)
    engine.calibration = {str(k): v for k, v in rates.items()}
    log(f"{engine.name}: threads {best} (calibration tok/s {', '.join(f'{k}: {v:.1f}' for k, v in rates.items())})")
    return rates



def build_peers(gguf_path: str, eos_ids, *, which=("transformers", "transformers-pld", "llama.cpp"),
                n_ctx: int = 2048, log=print) -> tuple[dict, dict]:
    """Peer engines by name, and a status record (what ran, what could not and why).

    `n_ctx`: llama.cpp context (prompt + new tokens); keep it small, since with a
    draft model llama-cpp-python keeps logits for every position (n_ctx x vocab floats).
    """
    engines: dict = {}
    status: dict = {}
    if "transformers" in which or "transformers-pld" in which:
        try:
            t0 = time.perf_counter()
            model = load_transformers_model(gguf_path)
            status["transformers"] = {"available": True, "load_s": time.perf_counter() - t0}
            if "transformers" in which:
                engines["transformers"] = TransformersEngine("transformers", model, eos_ids)
            if "transformers-pld" in which:
                engines["transformers-pld"] = TransformersEngine("transformers-pld", model, eos_ids,
                                                                 prompt_lookup=PLD_TOKENS)
        except Exception as e:
            status["transformers"] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
            log(f"transformers peer unavailable: {e}")
    if "llama.cpp" in which:
        st = llama_cpp_status()
        status["llama.cpp"] = st
        if st["available"]:
            try:
                t0 = time.perf_counter()
                copies = {p: requantized_gguf(gguf_path, p) for p in ("F32", "F16")}
                st["requantized_gguf"] = copies
                st["convert_or_lookup_s"] = time.perf_counter() - t0
                for precision, path in (*copies.items(), ("Q4_1", gguf_path)):
                    for pld in (None, PLD_TOKENS):
                        name = f"llama.cpp-{precision.lower()}" + ("-pld" if pld else "")
                        engines[name] = LlamaCppEngine(name, path, eos_ids, precision=precision,
                                                       prompt_lookup=pld, n_ctx=n_ctx)
            except Exception as e:
                st.update(available=False, reason=f"{type(e).__name__}: {e}")
                log(f"llama.cpp peer unavailable: {e}")
        else:
            log(f"llama.cpp peer unavailable: {st['reason']}")
    return engines, status
