"""The decoding loop on a jax Mesh of simulated CPU devices.

tests/mesh/run_on_mesh.py runs in a subprocess (the device count is fixed
before jax starts): a tiny target whose 8 query and 8 KV heads divide every
axis, greedy plain, chain and tree decoding unsharded and on each mesh.
Sums over the model axis change the reduction order; on this target the
tokens agree exactly (no near-ties at these scales), which is what is asserted.
Multi-host: two processes on 127.0.0.1 joined into one JAX runtime
(`eagle_jax.runtime.initialize_distributed`, gloo collectives on CPU), 4
simulated devices each, decode on one 2x4 mesh across both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from eagle_jax.config import ConfigError, TargetConfig
from eagle_jax.generate import Generator
from eagle_jax.models import target
from eagle_jax.sharding import MeshShape, fused_layout, make_mesh

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_on_mesh.py")
TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_on_mesh.py")
FEATURES_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "features_on_mesh.py")
HEAD_DIM = 8  # of run_on_mesh.py's target


def _run(*meshes: str, engine: str = "plain,chain,tree") -> dict:
    proc = subprocess.run([sys.executable, SCRIPT, "--engine", engine, *meshes], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(result: dict, mesh: str) -> None:
    ref, got = result["reference"], result["meshes"][mesh]
    assert ref["chain"]["tokens"] == ref["tree"]["tokens"] == ref["plain"]["tokens"]  # greedy: lossless
    for method in ("plain", "chain", "tree"):
        assert got[method]["tokens"] == ref[method]["tokens"], (mesh, method)
        assert got[method]["accepted"] == ref[method]["accepted"], (mesh, method)
    assert got["chain"]["accepted"] > 0 and got["tree"]["accepted"] > 0  # drafts were verified on the mesh
    weights = {tuple(s) for s in result["weight_shapes"]} | {tuple(got["cache"])}
    # The Pallas kernels under shard_map (interpreted): the same tokens, and no weight moved either.
    assert got["pallas"]["tokens"] == ref["chain"]["tokens"] and got["pallas"]["accepted"] == ref["chain"]["accepted"]
    assert got["kernels"] == {"shard_map": 0, "pallas_call": 0}, got["kernels"]
    assert got["pallas"]["kernels"]["pallas_call"] >= got["pallas"]["kernels"]["shard_map"] > 0, got["pallas"]
    pallas_moved = {tuple(s) for shapes in got["pallas"]["collectives"].values() for s in shapes}
    assert not pallas_moved & weights, pallas_moved & weights
    # Target and drafter read from their checkpoints straight into their shards: the same layout and values.
    assert got["loaded"]["same_shardings"] and got["loaded"]["same_values"], got["loaded"]
    assert got["loaded"]["fused_groups"] == [[int(mesh.split("x")[1])] * 2] * 2
    if mesh.split("x")[1] != "1":  # a model axis splits some leaves of each
        assert all(n > 0 for n in got["loaded"]["sharded_leaves"]), got["loaded"]
    assert got["loaded"]["tokens"] == ref["chain"]["tokens"]
    # The engine on the mesh: concurrent requests, a stream, the single-device text; nothing compiled
    # after its warm-up; row buckets of whole rows per data shard; its step over every row and over
    # its smallest bucket moves no weight and no whole cache.
    data = int(mesh.split("x")[0])
    for method in [m for m in ("plain", "chain", "tree") if "engine" in got[m]]:
        eng, one = got[method]["engine"], ref[method]["engine"]
        if "followed" in eng:  # a process that followed process 0's engine until it closed
            assert eng["followed"], (mesh, method)
            continue
        assert one["texts"] == one["want"] and eng["texts"] == one["texts"], (mesh, method)
        assert eng.get("stream", one["texts"][0]) == one["texts"][0] and eng["compiles"] == 0, (mesh, method)
        assert all(b % data == 0 for b in eng["buckets"]), eng["buckets"]
        for key in [k for k in eng if k.startswith("collectives_")]:
            moved = {tuple(s) for shapes in eng[key].values() for s in shapes}
            assert not moved & (weights | {tuple(eng["cache"])}), (mesh, method, key, eng[key])
    # The step moves activations between shards, never a whole weight or the whole KV cache.
    moved = {tuple(s) for shapes in got["collectives"].values() for s in shapes}
    assert not moved & weights, moved & weights
    # q|k|v and gate|up come in one group per model shard (`fused_layout`): slicing them moves no
    # head between shards (with a data axis, a few per-row scalars and indices still move).
    heads = [s for s in got["collectives"].get("collective-permute", []) if s and max(s) >= HEAD_DIM]
    assert not heads, got["collectives"]


def test_greedy_output_on_a_1x8_mesh_equals_the_unsharded_run():
    _check(_run("1x8", engine="chain"), "1x8")  # the engine: chain here, every method on the slow meshes


@pytest.mark.slow
def test_greedy_output_on_2x4_and_8x1_meshes_equals_the_unsharded_run():
    result = _run("2x4", "8x1")
    _check(result, "2x4")
    _check(result, "8x1")


@pytest.mark.slow
def test_training_on_meshes_follows_the_single_device_curve(tmp_path):
    """A drafter trained 4 steps (float32) on 2x4, 4x2 and 8x1 meshes, and with its state split
    over the data axis (FSDP), has the single-device run's losses and gradient norms; a run
    checkpointed after 2 steps on 2x4 and resumed on 4x2 continues the same curve. A mesh
    changes only the order of float32 sums (the gradients' reduction over the data axis, the
    partial products over the model axis): measured within 1.5e-7 relative; rtol 1e-5 leaves
    room for that to grow over steps, while a lost or doubled shard of the batch's gradient
    changes the second step's loss by far more (the loss moves by ~3% a step here)."""
    proc = subprocess.run([sys.executable, TRAIN_SCRIPT, str(tmp_path), "2x4", "4x2", "8x1", "2x4:fsdp"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = result["reference"]
    assert len(ref["loss"]) == 4 and ref["loss"][-1] < ref["loss"][0]
    for mesh, got in result["meshes"].items():
        np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5, err_msg=mesh)
        np.testing.assert_allclose(got["grad_norm"], ref["grad_norm"], rtol=1e-5, err_msg=mesh)
        assert got["devices"] == 8, mesh
    # The compiled feature pass and train step move no target weight (with a replicated drafter,
    # whose own weights' shapes differ from the target's; FSDP gathers the drafter's by design).
    weights = {tuple(w) for w in result["weight_shapes"]}
    for mesh in ("2x4", "4x2", "8x1"):
        moved = {tuple(s) for shapes in result["meshes"][mesh]["collectives"].values() for s in shapes}
        assert not moved & weights, (mesh, moved & weights)
    assert result["meshes"]["2x4"]["param_specs"] == ["P()"]  # replicated
    assert "P()" not in result["meshes"]["2x4:fsdp"]["param_specs"]  # every drafter weight split
    resumed = result["resumed"]
    assert resumed["resumes"] == [2] and (resumed["from"], resumed["on"]) == ("2x4", "4x2")
    np.testing.assert_allclose(resumed["loss"], ref["loss"], rtol=1e-5)


@pytest.mark.slow
def test_training_in_two_processes_follows_the_one_process_curve(tmp_path):
    """Two processes of 4 CPU devices train on one 2x4 mesh (and with FSDP), each building only its
    rows of every batch: the single-process run's losses; checkpointed by both processes after 2
    steps on 2x4 and resumed on 4x2 in two processes, the same curve."""
    one = subprocess.run([sys.executable, TRAIN_SCRIPT, str(tmp_path / "one")], capture_output=True, text=True,
                         timeout=1200)
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads(one.stdout.strip().splitlines()[-1])["reference"]
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, TRAIN_SCRIPT, str(tmp_path / "two"), "--join", address, "2", str(i),
                               "2x4", "4x2", "2x4:fsdp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = {r["process"]: r for r in (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)}
    lead = results[0]
    for mesh in ("2x4", "4x2", "2x4:fsdp"):
        np.testing.assert_allclose(lead["meshes"][mesh]["loss"], ref["loss"], rtol=1e-5, err_msg=mesh)
        np.testing.assert_allclose(lead["meshes"][mesh]["grad_norm"], ref["grad_norm"], rtol=1e-5, err_msg=mesh)
    assert lead["resumed"]["resumes"] == [2]
    np.testing.assert_allclose(lead["resumed"]["loss"], ref["loss"], rtol=1e-5)
    assert results[1]["meshes"]["2x4"]["loss"] == []  # process 0 alone writes the log


def _check_features(tmp_path, *meshes: str) -> None:
    """The trainer's feature pass over a vocabulary of four chunks (features_on_mesh.py) on each mesh:
    the unsharded run's features, and the head stays split. The mesh changes only the order of
    float32 sums (measured within 8e-6 of each array's largest magnitude; 2e-5 allowed), the flags
    exactly. Its collectives move no target weight nor as much as one device's part of the head
    (a chunk layout that cuts across the model shards' ranges gathered half of it), and its temp
    bytes stay under that part (chunks of the head transposed or padded whole before the loop made
    two copies of it: 4 to 8 times the part at these shapes, where the pass's own arrays take
    a tenth to a half of it)."""
    proc = subprocess.run([sys.executable, FEATURES_SCRIPT, str(tmp_path), *meshes], capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = result["reference"]
    assert 0 < np.mean(ref["in_vocab"]) < 1  # the greedy token is in the draft vocabulary at some positions only
    weights = {tuple(w) for w in result["weight_shapes"]}
    for mesh, got in result["meshes"].items():
        assert got["in_vocab"] == ref["in_vocab"], mesh
        for key in ("aux", "logits"):
            want = np.asarray(ref[key])
            np.testing.assert_allclose(got[key], want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"{mesh} {key}")
        moved = {tuple(s) for shapes in got["collectives"].values() for s in shapes}
        assert not moved & weights, (mesh, moved & weights)
        assert 4 * max(math.prod(s) for s in moved) < got["head_shard_bytes"], (mesh, got["collectives"])
    for name, got in [("one device", ref), *result["meshes"].items()]:
        assert got["temp_bytes"] < got["head_shard_bytes"], (name, got["temp_bytes"], got["head_shard_bytes"])


def test_the_feature_pass_on_a_2x4_mesh_keeps_the_head_split(tmp_path):
    _check_features(tmp_path, "2x4")


@pytest.mark.slow
def test_the_feature_pass_on_1x8_and_8x1_meshes_keeps_the_head_split(tmp_path):
    _check_features(tmp_path, "1x8", "8x1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_processes_on_one_2x4_mesh_generate_and_serve_what_one_process_does():
    """Generate, and the engine: process 0 schedules, process 1 makes its calls in lockstep."""
    reference = _run(engine="chain")["reference"]  # one process, unsharded
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, SCRIPT, "--engine", "chain", "--join", address, "2", str(i), "2x4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=1200) for p in procs]
    finally:
        for p in procs:
            p.kill()
    processes = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        _check(dict(result, reference=reference), "2x4")
        processes.append(result["process"])
    assert sorted(processes) == [0, 1]


def test_grouped_fused_columns_decode_as_the_checkpoint_layout():
    """One device: the q|k|v and gate|up columns reordered by `fused_layout` for a model axis of 2,
    read under `fused_groups=2`, give the tokens of the checkpoint's layout."""
    cfg = TargetConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    params = target.init_params(cfg, jax.random.PRNGKey(1), scale=0.5)
    groups, columns = fused_layout(cfg, 2)
    assert groups == 2 and sorted(columns) == ["bqkv", "w_gate_up", "wqkv"]
    assert fused_layout(cfg, 4) == (1, {})  # 4 does not divide the 2 KV heads: the checkpoint layout
    grouped = dict(params, layers={k: v[..., columns[k]] if k in columns else v for k, v in params["layers"].items()})
    assert not bool((grouped["layers"]["wqkv"] == params["layers"]["wqkv"]).all())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    want = Generator(cfg, params, impl="xla").generate(prompts, max_new_tokens=8, chat=False).token_ids
    got = Generator(dataclasses.replace(cfg, fused_groups=2), grouped, impl="xla").generate(
        prompts, max_new_tokens=8, chat=False).token_ids
    assert got == want
    with pytest.raises(ConfigError, match="fused_groups"):
        dataclasses.replace(cfg, fused_groups=3)


def test_a_mesh_needs_its_devices_and_no_native_kernels():
    cfg = TargetConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    params = target.init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(ConfigError, match=r"mesh 2x4 needs 8 devices; this cpu backend has 1 .*device_count=8"):
        Generator(cfg, params, mesh=MeshShape(2, 4))
    with pytest.raises(ConfigError, match="impl 'native' runs on one device"):
        Generator(cfg, params, impl="native", mesh=MeshShape(1, 2))
    assert len(jax.devices()) == 1
    g = Generator(cfg, params, mesh=MeshShape(1, 1))  # one device: the usual path
    assert g.mesh is None and isinstance(g.target_params["embed"], jax.Array)


def test_a_mesh_that_leaves_out_a_process_is_refused(monkeypatch):
    """Two processes of 4 devices each: a mesh of the first 4 would leave process 1 with no shard
    of anything, and every process must run the same program on the same mesh."""
    class Device:
        platform = "cpu"

        def __init__(self, i):
            self.id, self.process_index = i, i // 4

    monkeypatch.setattr(jax, "devices", lambda: [Device(i) for i in range(8)])
    with pytest.raises(ConfigError, match=r"mesh 1x4 uses the first 4 of 8 devices, none of process 1's"):
        make_mesh(MeshShape(1, 4))


MOE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_moe_on_mesh.py")


def _run_moe(kinds: str, *meshes: str, methods: str = "plain,chain,tree") -> dict:
    proc = subprocess.run([sys.executable, MOE_SCRIPT, "--methods", methods, kinds, *meshes], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_moe(result: dict, kind: str, mesh: str) -> None:
    """A MoE target on `mesh` (run_moe_on_mesh.py) decodes the unsharded tokens, with the routed
    experts split whole over the model axis, run under shard_map, and no weight (whole, or one
    device's experts) nor the whole cache moved by a step."""
    ref, got = result[kind]["reference"], result[kind]["meshes"][mesh]
    assert len({str(r["tokens"]) for r in ref.values()}) == 1  # greedy: lossless
    for method in ref:
        assert got[method]["tokens"] == ref[method]["tokens"], (kind, mesh, method)
        assert got[method]["accepted"] == ref[method]["accepted"], (kind, mesh, method)
        assert method == "plain" or got[method]["accepted"] > 0  # drafts were verified on the mesh
    model = int(mesh.split("x")[1])
    experts, specs, shards = result[kind]["experts"], got["specs"], got["shards"]
    if model > 1:  # (every model axis up to 8 divides the experts and the heads)
        assert specs["experts_gate_up"] == specs["experts_down"] == "P('model', None, None)", specs
        assert shards["experts_gate_up"][0] == experts[0] // model and specs["router"] == "P(None, None)"
        assert got["kernels"]["shard_map"] > 0, got["kernels"]  # the experts ran on each device's share
        if kind == "deepseek":  # MLA: heads on the model axis, the latent down-projection replicated
            assert specs["wq_b"] == specs["wkv_b"] == "P(None, 'model')" and specs["wqkv_a"] == "P(None, None)"
            assert specs["wo"] == "P('model', None)" and specs["shared_gate_up"] == "P(None, 'model')", specs
    if kind == "deepseek":  # the latent cache [L, B, 1, S, R]: no head axis to split, rows on data
        assert got["cache"][2] == 1 and "model" not in got["cache_spec"], got["cache_spec"]
    moved = {tuple(s) for shapes in got["collectives"].values() for s in shapes}
    weights = {tuple(s) for s in result[kind]["weight_shapes"]} | {tuple(s) for s in shards.values()}
    assert not moved & (weights | {tuple(got["cache"])}), moved & (weights | {tuple(got["cache"])})


@pytest.mark.slow
def test_mla_moe_target_on_a_2x4_mesh_equals_the_unsharded_run():
    """DeepSeek-V3's layout (MLA, shared and routed experts): chain speculative decoding. Slow (2.5 min
    loaded): the default tier keeps the dense 1x8 mesh case and the expert-share checks below."""
    _check_moe(_run_moe("deepseek", "2x4", methods="chain"), "deepseek", "2x4")


@pytest.mark.slow
def test_moe_targets_on_1x8_2x4_and_2x2_meshes_equal_the_unsharded_run():
    result = _run_moe("qwen3_moe,deepseek", "1x8", "2x4", "2x2")
    for kind in ("qwen3_moe", "deepseek"):
        for mesh in ("1x8", "2x4", "2x2"):
            _check_moe(result, kind, mesh)


def test_experts_split_into_shares_sum_to_all_the_experts():
    """`experts_mlp` of each device's share of the experts (`first`: its first expert), summed as
    `routed_experts` sums them over the model axis, is the output of all the experts; pairs routed
    to other shares take no rows of a share's grouped matmul (they add exactly zero)."""
    from eagle_jax.models.moe import experts_mlp

    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    e, h, i, n, k = 8, 16, 8, 12, 3
    x = jax.random.normal(keys[0], (n, h))
    w_gate_up, w_down = jax.random.normal(keys[1], (e, h, 2 * i)), jax.random.normal(keys[2], (e, i, h))
    experts = jax.random.randint(keys[3], (n, k), 0, e)
    weights = jax.random.uniform(keys[4], (n, k))
    whole = experts_mlp(x, w_gate_up, w_down, weights, experts)
    for shares in (2, 4, 8):
        size = e // shares
        parts = [experts_mlp(x, w_gate_up[s * size:(s + 1) * size], w_down[s * size:(s + 1) * size], weights,
                             experts, first=s * size) for s in range(shares)]
        np.testing.assert_allclose(sum(parts), whole, rtol=1e-6, atol=1e-5)
    # a token none of whose experts a share holds gets exactly nothing from it
    mine = experts_mlp(x, w_gate_up[:2], w_down[:2], weights, experts, first=0)
    assert bool((mine[~(experts < 2).any(-1)] == 0).all())


def test_grouped_shared_experts_compute_the_checkpoint_layout():
    """A MoE layer whose shared experts' [gate | up] columns are grouped for a model axis of 2
    (`fused_layout`), read under `fused_groups=2`, computes what the checkpoint layout does."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "spec_decode"))
    from spec_helpers import tiny_moe_target

    from eagle_jax.models.moe import moe_mlp

    cfg, params = tiny_moe_target("deepseek")
    groups, columns = fused_layout(cfg, 2)
    assert groups == 2 and "shared_gate_up" in columns
    assert fused_layout(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=15)), 2) == (1, {})
    layer = params["layers"][1]
    grouped = dict(layer, shared_gate_up=layer["shared_gate_up"][:, columns["shared_gate_up"]])
    h = jax.random.normal(jax.random.PRNGKey(2), (2, 3, cfg.hidden_size))
    want = moe_mlp(layer, cfg, h, impl="xla")
    got = moe_mlp(grouped, dataclasses.replace(cfg, fused_groups=2), h, impl="xla")
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _line_with(proc: subprocess.Popen, text: str) -> str:
    """The first line of `proc`'s stdout that holds `text` (gloo prints its own lines there)."""
    for line in proc.stdout:
        if text in line:
            return line
    pytest.fail(f"no line with {text!r}: {proc.stderr.read()[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_two_processes_serve_the_openai_client_what_one_device_answers(smollm2_target):
    """`eagle-jax serve` in two processes of 4 CPU devices, one 8x1 mesh: process 0 answers the openai
    client (concurrent greedy requests, speculating: the single-device text), process 1 serves no
    HTTP and makes process 0's engine calls; SIGTERM to process 0 ends both, exit 0."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    flags = ["--target", "smollm2-135m-instruct", "--dtype", "float32", "--mesh", "8x1", "--max-batch", "8",
             "--max-len", "256", "--prefill-chunk", "32", "--disable-by-batch-size", "none", "--fixed-draft-depth",
             "--num-processes", "2", "--coordinator-address", address]
    procs = [subprocess.Popen([sys.executable, "-m", "eagle_jax.cli", "serve", "--port", "0", *flags,
                               "--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in range(2)]
    try:
        lines = [_line_with(p, text) for p, text in ((procs[0], "http://127.0.0.1:"),
                                                        (procs[1], "follows process 0's engine"))]
        url = lines[0].split()[2]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        prompts = ["Name three colours.", "def add(a, b):", "What is the capital of Italy?"]

        def ask(p):
            reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=16,
                                                   temperature=0, messages=[{"role": "user", "content": p}])
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(ask, prompts))
        t = smollm2_target
        gen = Generator(t.cfg, t.params, t.tokenizer)
        want = [t.tokenizer.decode(gen.generate([p], max_new_tokens=16).token_ids[0], skip_special_tokens=True)
                for p in prompts]
        assert got == want
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=300) for p in procs] == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    finally:
        for p in procs:
            p.kill()
