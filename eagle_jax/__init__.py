"""eagle-jax: EAGLE-3 / EAGLE 3.1 speculative decoding in JAX."""

import importlib.util
from pathlib import Path

__version__ = "0.1.0"


def _refuse_shadowed_kernels() -> None:
    """Refuse to run with the checkout's root on `sys.path`.

    The checkout keeps this package's kernels in a top-level `kernels/` folder
    (installed as `eagle_jax.kernels`). With the root on `sys.path` (`python -m`
    from the checkout adds the working directory) that folder also answers to
    the name `kernels`, which is Hugging Face's kernel package that
    transformers imports, and transformers then fails deep inside its imports.
    """
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is not None and (origin.parent / "fused_norm_matmul.py").exists():
        raise ImportError(f"the eagle-jax checkout's {origin.parent} shadows the `kernels` package transformers "
                          "needs (the checkout's root is on sys.path): run the `eagle-jax` command, or set "
                          "PYTHONSAFEPATH=1 (or pass -P) when you run `python -m` from the checkout")


_refuse_shadowed_kernels()
