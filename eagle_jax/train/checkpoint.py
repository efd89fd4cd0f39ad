"""A run's checkpoints: orbax, synchronous, one step directory per save.

Checkpoints (orbax ``CheckpointManager`` under ``output_dir/checkpoints``,
synchronous, every ``save_every`` steps and at the end, ``max_to_keep``):
item ``state`` = {step, params, opt_state, key} and item ``meta`` (JSON) =
{step, cursor (index of the next batch), elapsed_s, token_positions (batch
rows x padded length, summed over the run's steps), config}. A step
directory appears by rename only when complete, so a process killed at any
moment resumes from the last complete checkpoint; the data order is a pure
function of (seed, cursor), so a resumed run sees exactly the batches the
uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path

import jax

__all__ = ["manager", "save", "restore"]


def manager(directory: Path, max_to_keep: int):
    """An orbax CheckpointManager over `directory` (items "state" and "meta"; saves finish before
    they return; half-written step directories of a killed run are cleaned up)."""
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
                                             cleanup_tmp_directories=True),
        item_names=("state", "meta"))


def save(mngr, state, meta: dict) -> None:
    """Save `state` (a pytree) and `meta` (JSON) as step meta["step"]; nothing when that step exists."""
    import orbax.checkpoint as ocp

    step = int(meta["step"])
    if step in mngr.all_steps():
        return
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
              force=True)
    mngr.wait_until_finished()


def restore(mngr, template) -> tuple[dict, dict] | None:
    """(state, meta) of the latest step, `state` shaped as `template`; None when there is none."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
    return got["state"], dict(got["meta"])
