"""`python -m eagle_jax.kernels.cpu`: build the native CPU kernels now and say where (or why not)."""

from eagle_jax.kernels.cpu import NativeKernelError, build

try:
    print(f"native CPU kernels: {build()}")
except NativeKernelError as e:
    print(f"native CPU kernels not built ({e}); the XLA path will be used")
