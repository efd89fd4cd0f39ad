"""Process-level settings: defaults per backend (dtype, when to speculate), persistent compilation cache,
joining several processes into one JAX runtime (multi-host), and what this machine is (`machine_info`)."""

from __future__ import annotations

import os
import platform
import socket

import jax


def default_dtype() -> str:
    """The decoding dtype: bfloat16 (f32 accumulation) on GPU and TPU, and on
    CPU when the native kernels run (`kernels/cpu`: 1.6x the tokens/s of fp32
    there, docs/benchmarks.md "Step cost"); float32 on CPU otherwise (XLA:CPU
    converts bf16 weights to f32 on every call)."""
    from eagle_jax.kernels import ops

    if jax.default_backend() != "cpu":
        return "bfloat16"
    return "bfloat16" if ops.is_native("auto") else "float32"


def default_disable_by_batch_size() -> int | None:
    """Above which batch size speculation is switched off by default (0: at
    every batch size). Never on GPU and TPU (reasoned, not measured: no
    accelerator has been lent). On CPU, 4 where the native kernels run bf16 on
    AMX tiles: there verifying costs little compute, and on a Xeon (one core)
    chain k=2-3 ran at 1.45-1.46x plain at batch 2 and 1.44-1.45x at batch 4
    (`speed-b4-amx-20261206-100538`); 16 rows are unmeasured with `generate`
    (the server's adaptive engine stayed plain there). 1 where they run on
    AVX-512 without tiles: there a verify step over k+1 tokens costs 1.3-1.5 plain steps and
    the shipped drafter ran at 1.2-1.3x plain at batch 1, while at batch 2 and
    4 every measured setting was slower than plain decoding (docs/benchmarks.md
    "Speculation by batch size"). 0 on other CPUs: on an AVX2-only Zen 2 EPYC
    a chain k=3 step cost 2.1x a plain step (about 5 ms of compute per extra
    row on two cores) and ran at 0.82x plain, the tree at 0.68x
    (`step_cost-quick-20261205-004528`); the XLA path's verify costs 1.4-1.9x
    a plain step, too much for the drafters' tau. The server's adaptive slot
    engine lifts the cap of 1 (eagle_jax/engine/): its draft policy, timing each
    depth per row bucket, picks plain where drafting loses."""
    if jax.default_backend() != "cpu":
        return None
    from eagle_jax.kernels import ops

    if not ops.is_native("auto"):
        return 0
    cpu = ops.cpu_features()
    if cpu["amx"]:
        return 4
    return 1 if cpu["wide_vectors"] else 0


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache (warm starts skip XLA compiles).

    Location: `path`, else $EAGLE_JAX_XLA_CACHE, else ~/.cache/eagle_jax/xla.
    $EAGLE_JAX_XLA_CACHE=off leaves the cache off and returns None: JAX writes
    entries in place, unlocked, and XLA:CPU crashed reading and writing them in
    long test processes here (tests/conftest.py turns it off).
    """
    path = path or os.environ.get("EAGLE_JAX_XLA_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "eagle_jax", "xla")
    if path == "off":
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join `num_processes` processes (one per host) into one JAX runtime through
    `jax.distributed.initialize`: `jax.devices()` then lists every process's devices and a
    mesh over them spans hosts. Every process runs the same program; process 0 also hosts
    the coordinator at `coordinator_address` (HOST:PORT). Call before anything touches
    JAX's backends. On CPU the processes' collectives go through gloo (TCP)."""
    from eagle_jax.config import ConfigError

    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ConfigError(f"process id {process_id} is not in 0..{num_processes - 1} "
                          f"(--num-processes {num_processes})")
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"coordinator address {coordinator_address!r} is not HOST:PORT")
    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    except RuntimeError as e:
        raise ConfigError(f"joining {num_processes} processes at {coordinator_address} failed: "
                          f"{str(e).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU model, core counts, accelerator, memory and library versions (what benchmark results,
    learning-curve points and model cards record of the machine that made them)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gb = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    devices = jax.devices()
    backend = jax.default_backend()
    info = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "memory_gb": mem_gb,
        "backend": backend,
        "devices": [getattr(d, "device_kind", str(d)) for d in devices],
        "device_count": len(devices),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    info["description"] = describe_machine(info)
    return info


def describe_machine(info: dict) -> str:
    if info.get("backend") not in (None, "cpu"):
        return f"{info['device_count']}x {info['devices'][0]} ({info['backend']}), host {info['cpu_model']}"
    cores = info.get("cpu_affinity") or info.get("cpu_count")
    return f"{info['cpu_model']}, {cores} cores, {info.get('memory_gb')} GB RAM (CPU backend)"
