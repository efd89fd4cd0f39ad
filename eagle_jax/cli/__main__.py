"""`python -m eagle_jax.cli`: the `eagle-jax` command."""

import sys

from eagle_jax.cli import main

sys.exit(main())
