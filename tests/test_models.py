"""The models as Flax NNX modules: their state is the docs/PARAMS.md layout, every
parameter carries its logical axes, and the split / merge idiom runs them under jit."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "spec_decode"))
import spec_helpers as H  # noqa: E402

from eagle_jax.models import drafter, target  # noqa: E402
from eagle_jax.sharding import logical_axes  # noqa: E402

TCFG, TPARAMS = H.tiny_target(vocab=16, qwen3=True)
DCFG, DPARAMS, _ = H.tiny_drafter(TCFG, "eagle3.1")


def _same_tree(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a is b


@pytest.mark.parametrize("model", ["target", "target_unrolled", "target_packed", "drafter"])
def test_module_state_is_the_parameter_layout(model):
    """`nnx.state` of a module built from a PARAMS.md dict is that dict, the same arrays,
    and a module built from that state is the same module: stacked or per-layer target
    layers, plain or packed projections."""
    params = {"target": TPARAMS, "target_unrolled": target.unstack_layers(TPARAMS), "drafter": DPARAMS,
              "target_packed": target.pack_for_cpu(target.unstack_layers(TPARAMS), TCFG)}[model]
    build = (lambda p: drafter.Drafter(DCFG, p)) if model == "drafter" else (lambda p: target.Target(TCFG, p))
    state = nnx.to_pure_dict(nnx.state(build(params), nnx.Param))
    _same_tree(state, params)
    graphdef, _ = nnx.split(build(params))
    assert nnx.split(build(state))[0] == graphdef


def test_parameters_carry_their_logical_axes():
    """Each parameter's axes as declared (the unrolled layers' without the `layers` axis),
    as `logical_axes` gives them (tuples, in the parameters' layout) and as Flax's own
    `nnx.get_partition_spec` gives them (PartitionSpecs of logical names)."""
    stacked = target.Target(TCFG, TPARAMS)
    axes = logical_axes(stacked)
    assert axes["embed"] == ("vocab", "embed")
    assert axes["lm_head"] == ("embed", "vocab")
    assert axes["layers"]["wqkv"] == ("layers", "embed", "qkv")
    assert axes["layers"]["q_norm"] == ("layers", "head_dim")
    specs = nnx.get_partition_spec(nnx.state(stacked, nnx.Param))
    assert specs["layers"]["w_down"].get_value() == PartitionSpec("layers", "ffw", "embed")
    for name, leaf in TPARAMS["layers"].items():
        assert len(axes["layers"][name]) == leaf.ndim, name

    unrolled = logical_axes(target.Target(TCFG, target.unstack_layers(TPARAMS)))
    assert sorted(unrolled["layers"]) == list(range(TCFG.num_layers))
    assert unrolled["layers"][2]["w_gate_up"] == ("embed", "ffw2")

    daxes = logical_axes(drafter.Drafter(DCFG, DPARAMS))
    assert daxes["fc_norm"] == ("aux_states", "target_embed")
    assert daxes["layer"]["wqkv"] == ("embed2", "qkv")
    assert jax.tree.structure(daxes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(DPARAMS)


def test_split_once_then_merge_under_jit():
    """`nnx.split` once, the pure state through `jit`, `nnx.merge` inside: the same
    logits and cache as the module called eagerly."""
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)[None]
    cache = target.create_cache(TCFG, 1, 8)
    graphdef, state = nnx.split(target.Target(TCFG, TPARAMS))

    @jax.jit
    def run(state, cache):
        model = nnx.merge(graphdef, state)
        h, cache, aux = model(tokens, positions, cache, aux_layers=(1, 3), impl="xla")
        return model.logits(h, impl="xla"), cache, aux

    got = run(state, cache)
    model = target.Target(TCFG, TPARAMS)
    h, want_cache, want_aux = model(tokens, positions, cache, aux_layers=(1, 3), impl="xla")
    np.testing.assert_allclose(got[0], model.logits(h, impl="xla"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1].k, want_cache.k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want_aux, rtol=1e-5, atol=1e-5)


def test_unknown_or_misplaced_parameter_is_refused():
    with pytest.raises(ValueError, match="Target has no parameter 'lm_bias'"):
        target.Target(TCFG, {**TPARAMS, "lm_bias": jnp.zeros(3)})
    with pytest.raises(ValueError, match="TargetLayer has no parameter 'final_norm'"):
        target.Target(TCFG, {**TPARAMS, "layers": {**TPARAMS["layers"], "final_norm": jnp.zeros(3)}})
    with pytest.raises(ValueError, match="Drafter has no parameter 'wqkv'"):
        drafter.Drafter(DCFG, {**DPARAMS, "wqkv": DPARAMS["layer"]["wqkv"]})
    with pytest.raises(ValueError, match="DrafterLayer has no parameter 'q_proj'"):
        drafter.Drafter(DCFG, {**DPARAMS, "layer": {**DPARAMS["layer"], "q_proj": jnp.zeros(3)}})
    with pytest.raises(ValueError, match=r"per-layer params hold layers \[0, 1\], the config 0 .. 3"):
        target.Target(TCFG, {**TPARAMS, "layers": {i: target.unstack_layers(TPARAMS)["layers"][i] for i in (0, 1)}})
