"""The `eagle-jax` command line: generate (JSON output, --repeat, --prompts-file),
convert round trips (drafter native -> speculators, HF target -> converted format),
and bad input (exit status 2 with a one-line message naming the problem).

Two `generate` runs go through a real subprocess (the embedded default target,
plain decoding, 8 new tokens); error cases call `eagle_jax.cli.main` in-process,
which is the same code path without the interpreter start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from eagle_jax.cli import main

GEN_KEYS = {"text", "token_ids", "num_generated", "wall_s", "tokens_per_s", "prompt_tokens"}


def _run_cli(*argv, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    return subprocess.run([sys.executable, "-m", "eagle_jax.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _one_json_object(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got {stdout!r}"
    out = json.loads(lines[0])
    assert isinstance(out, dict)
    return out


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected a one-line error, got {captured.err!r}"
    assert captured.out == ""
    return lines[0]


# ----------------------------------------------------------------------------- generate


def test_generate_json(smollm2_target):
    prompt = "What is 2+2?"
    proc = _run_cli("generate", "--prompt", prompt, "--draft", "none", "--max-new-tokens", "8",
                    "--json")
    assert proc.returncode == 0, proc.stderr
    out = _one_json_object(proc.stdout)
    assert GEN_KEYS <= set(out)
    assert "compile_s" not in out
    ids = out["token_ids"]
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    assert 1 <= len(ids) <= 8 and out["num_generated"] == len(ids)
    assert out["prompt_tokens"] == len(smollm2_target.tokenizer.apply_chat(prompt))
    assert out["text"] == smollm2_target.tokenizer.decode(ids, skip_special_tokens=True)
    assert out["wall_s"] > 0 and out["tokens_per_s"] == pytest.approx(len(ids) / out["wall_s"])
    assert out["draft"] == "none" and out["method"] == "plain"
    # --stream: the same text piece by piece, and a clean exit (the engine's thread stops first)
    streamed = _run_cli("generate", "--prompt", prompt, "--draft", "none", "--max-new-tokens", "8", "--stream")
    assert streamed.returncode == 0 and "terminate called" not in streamed.stderr, streamed.stderr[-2000:]
    assert streamed.stdout.rstrip("\n") == out["text"]


def test_generate_prompts_file_with_repeat(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Name a fruit."}) + "\n\n" + json.dumps("Name a colour.") + "\n")
    proc = _run_cli("generate", "--prompts-file", str(path), "--draft", "none", "--max-new-tokens",
                    "8", "--repeat", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = _one_json_object(proc.stdout)
    assert GEN_KEYS | {"compile_s", "first_run_wall_s"} <= set(out)
    assert isinstance(out["compile_s"], float)
    assert isinstance(out["text"], list) and len(out["text"]) == 2
    assert len(out["token_ids"]) == 2 and all(1 <= len(r) <= 8 for r in out["token_ids"])
    assert len(out["prompt_tokens"]) == 2
    assert out["num_generated"] == sum(len(r) for r in out["token_ids"])
    assert out["wall_s"] > 0 and out["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- bad input


def test_unknown_target_exits_2_in_a_subprocess(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = _run_cli("generate", "--prompt", "hi", "--target", str(missing), "--draft", "none")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("eagle-jax generate: error: ")
    assert str(missing) in lines[-1] and "does not exist" in lines[-1]
    assert proc.stdout == ""


@pytest.mark.parametrize("extra, match", [
    (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--top-k", "-2"], "top_k must be a non-negative integer, got -2"),
    (["--max-new-tokens", "0"], "max_new_tokens must be a positive int"),
    (["--method", "tree", "--tree-top-k", "2", "--tree-depth", "2", "--tree-total-tokens", "50"],
     "tree_total_tokens must be in [2, 7]"),
    (["--num-processes", "2", "--mesh", "2x4"], "--num-processes > 1 needs --coordinator-address and a --mesh"),
    (["--num-processes", "2", "--coordinator-address", "127.0.0.1:1"], "needs --coordinator-address and a --mesh"),
    (["--num-processes", "2", "--coordinator-address", "127.0.0.1:1", "--mesh", "2x4", "--process-id", "2"],
     "process id 2 is not in 0..1 (--num-processes 2)"),
    (["--num-processes", "2", "--coordinator-address", "localhost", "--mesh", "2x4"],
     "coordinator address 'localhost' is not HOST:PORT"),
])
def test_bad_generate_options(smollm2_target, capsys, extra, match):
    rc = main(["generate", "--prompt", "hi", "--draft", "none", *extra])
    assert rc == 2
    line = _error_line(capsys)
    assert line.startswith("eagle-jax generate: error: ") and match in line


def test_prompt_longer_than_the_context(smollm2_target, tmp_path, capsys):
    ctx = smollm2_target.cfg.max_position_embeddings
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps("short prompt") + "\n" + json.dumps("hello " * (ctx + 100)) + "\n")
    rc = main(["generate", "--prompts-file", str(path), "--draft", "none", "--max-new-tokens", "4"])
    assert rc == 2
    line = _error_line(capsys)
    assert "prompt 1 has" in line and f"the context holds {ctx}" in line


@pytest.mark.parametrize("content, match", [
    ("", "no prompts"),
    ('{"text": "hi"}\n', "object has no 'prompt' key"),
    ("[1, 2]\n", "expected a string prompt"),
])
def test_bad_prompts_file(tmp_path, capsys, content, match):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    assert main(["generate", "--prompts-file", str(path), "--draft", "none"]) == 2
    assert match in _error_line(capsys)


@pytest.mark.parametrize("content, match", [
    ('"one"\n{"prompt": "two"\n', ":2: not a JSON value (Expecting ',' delimiter, column 17)"),
    ('"one"\n\n"two"\n"three\n', ":4: not a JSON value (Unterminated string"),
    ('"one"\n' + '"caf\xe9"\n', ":2: not UTF-8 text"),
])
def test_a_bad_prompts_line_names_the_file_and_line(tmp_path, capsys, content, match):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content.encode("latin-1"))
    assert main(["generate", "--prompts-file", str(path), "--draft", "none"]) == 2
    line = _error_line(capsys)
    assert f"{path}{match}" in line, line


def test_a_prompts_file_that_is_a_directory(tmp_path, capsys):
    assert main(["generate", "--prompts-file", str(tmp_path), "--draft", "none"]) == 2
    assert f"--prompts-file {tmp_path} is a directory" in _error_line(capsys)


def test_missing_prompts_file(tmp_path, capsys):
    assert main(["generate", "--prompts-file", str(tmp_path / "absent.jsonl"), "--draft", "none"]) == 2
    assert "absent.jsonl" in _error_line(capsys)


def test_unknown_drafter(smollm2_target, tmp_path, capsys):
    assert main(["generate", "--prompt", "hi", "--draft", str(tmp_path / "nodrafter")]) == 2
    line = _error_line(capsys)
    assert "nodrafter" in line and "neither a bundled name" in line


# ----------------------------------------------------------------------------- convert: drafter


def _tiny_drafter_for_smollm2(target_cfg):
    from eagle_jax.config import DrafterConfig
    from eagle_jax.models.drafter import DraftVocab, init_params

    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                        head_dim=16, vocab_size=target_cfg.vocab_size, draft_vocab_size=512,
                        target_hidden_size=target_cfg.hidden_size, aux_layer_ids=(2, 15, 27),
                        rope=target_cfg.rope, fc_norm=True, norm_output=True,
                        norm_before_residual=True)
    params = init_params(cfg, jax.random.PRNGKey(7))
    ids = np.sort(np.random.default_rng(0).choice(target_cfg.vocab_size, 512, replace=False))
    return cfg, params, DraftVocab.from_target_ids(ids, target_cfg.vocab_size)


def _leaves(tree, prefix=""):
    for k, v in sorted(tree.items()):
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", np.asarray(v)


def _assert_trees_equal(a, b):
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys()
    for k in la:
        assert la[k].dtype == lb[k].dtype and la[k].shape == lb[k].shape, k
        assert np.array_equal(la[k], lb[k]), f"{k} differs"


def test_convert_drafter_native_to_speculators(smollm2_target, tmp_path, capsys):
    from eagle_jax.convert.drafter_formats import checkpoint_format, load_drafter, save_drafter

    tcfg = smollm2_target.cfg
    cfg, params, vocab = _tiny_drafter_for_smollm2(tcfg)
    native = save_drafter(tmp_path / "native", cfg, params, vocab, format="native")
    assert checkpoint_format(native) == "native"

    out_dir = tmp_path / "spec"
    assert main(["convert", str(native), str(out_dir), "--target", "smollm2-135m-instruct"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "drafter" and summary["format"] == "speculators"  # both autodetected
    assert summary["source_format"] == "native"
    assert summary["output"] == str(out_dir.absolute())
    assert summary["bytes"] == sum(summary["files"].values()) > 0
    assert set(summary["files"]) == {"config.json", "model.safetensors"}
    assert checkpoint_format(out_dir) == "speculators"
    config = json.loads((out_dir / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"

    c1, p1, v1 = load_drafter(native, dtype=None)
    c2, p2, v2 = load_drafter(out_dir, dtype=None)
    _assert_trees_equal(p1, params)
    _assert_trees_equal(p2, p1)
    assert np.array_equal(np.asarray(v2.d2t), np.asarray(v1.d2t))
    assert np.array_equal(np.asarray(v2.t2d), np.asarray(v1.t2d))
    assert c2.replace(verifier_name_or_path="") == c1
    assert c2.aux_layer_ids == cfg.aux_layer_ids and c2.is_eagle31

    # and back to the native format, byte-identical tensors again
    back = tmp_path / "back"
    assert main(["convert", str(out_dir), str(back), "--format", "native"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "native"
    _c3, p3, _v3 = load_drafter(back, dtype=None)
    _assert_trees_equal(p3, params)


def test_convert_errors(smollm2_target, tmp_path, capsys):
    from eagle_jax.convert.drafter_formats import save_drafter

    cfg, params, vocab = _tiny_drafter_for_smollm2(smollm2_target.cfg)
    src = save_drafter(tmp_path / "d", cfg, params, vocab, format="native")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    cases = [
        (["convert", str(tmp_path / "missing"), str(tmp_path / "o1"), "--kind", "drafter"],
         ["missing", "does not exist"]),
        (["convert", str(tmp_path / "missing"), str(tmp_path / "o1")], ["missing", "does not exist"]),
        (["convert", str(src), str(tmp_path / "o2"), "--format", "eagle-jax"],
         ["--format eagle-jax is not a drafter format"]),
        (["convert", str(src), str(busy)], ["busy", "not empty"]),
        (["convert", str(src), str(tmp_path / "o3"), "--kind", "target"],
         ["drafter config, not a target", "--kind drafter"]),
    ]
    for argv, needles in cases:
        assert main(argv) == 2, argv
        line = _error_line(capsys)
        assert line.startswith("eagle-jax convert: error: ")
        for n in needles:
            assert n in line, (argv, line)
    assert os.listdir(busy) == ["keep.txt"]
    assert not any(p.name.startswith(("o1", "o2", "o3")) for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------- convert: target


@pytest.fixture(scope="module")
def tiny_hf_target(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("tiny") / "hf"
    model.save_pretrained(path)
    return path


def test_convert_hf_target(tiny_hf_target, tmp_path, capsys):
    from eagle_jax.convert.hf import load_hf_directory
    from eagle_jax.convert.registry import is_converted_dir, load_converted

    out_dir = tmp_path / "converted"
    assert main(["convert", str(tiny_hf_target), str(out_dir)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == "target" and summary["format"] == "eagle-jax"
    assert summary["dtype"] == "float32" and summary["has_tokenizer"] is False
    assert summary["num_layers"] == 2 and summary["vocab_size"] == 96
    assert summary["bytes"] == sum(summary["files"].values()) > 0
    assert is_converted_dir(out_dir)

    ref_cfg, ref_params = load_hf_directory(tiny_hf_target, "float32")
    got = load_converted(out_dir)
    assert got.cfg == ref_cfg
    assert got.tokenizer is None
    _assert_trees_equal(got.params, ref_params)
    assert summary["num_params"] == sum(a.size for _, a in _leaves(ref_params))

    # the converted copy loads as a target by path, and bf16 casting works
    bf16 = tmp_path / "bf16"
    assert main(["convert", str(out_dir), str(bf16), "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    half = load_converted(bf16)
    for k, a in _leaves(half.params):
        assert a.dtype.name == "bfloat16", k
    np.testing.assert_array_equal(np.asarray(half.params["embed"]).astype(np.float32),
                                  np.asarray(ref_params["embed"]).astype("bfloat16").astype(np.float32))


def test_convert_target_errors(tiny_hf_target, tmp_path, capsys):
    assert main(["convert", str(tiny_hf_target), str(tmp_path / "o"), "--format", "speculators"]) == 2
    assert "--format speculators is a drafter format" in _error_line(capsys)
    assert main(["convert", str(tmp_path / "nothing.gguf"), str(tmp_path / "o")]) == 2
    assert "nothing.gguf" in _error_line(capsys)
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- silent choices

@pytest.mark.parametrize("extra, match", [
    (["--method", "tree", "--num-speculative-tokens", "0"], "--num-speculative-tokens sizes a chain"),
    (["--num-speculative-tokens", "100"], "--num-speculative-tokens must be in [1, 16], got 100"),
    (["--num-speculative-tokens", "0"], "(--draft none decodes without speculation)"),
    (["--aux-layer-semantics", "sideways"], "aux layer semantics must be one of"),
])
def test_speculation_flags_are_not_silently_ignored(capsys, extra, match):
    """Refused before anything loads: one line naming the flag."""
    assert main(["generate", "--prompt", "hi", *extra]) == 2
    line = _error_line(capsys)
    assert line.startswith("eagle-jax generate: error: ") and match in line


def test_draft_default_says_what_it_chose(caplog):
    from eagle_jax.config import TargetConfig
    from eagle_jax.convert.bundled import bundled_path, resolve_drafter

    tc = TargetConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=4, num_heads=2,
                      num_kv_heads=2, head_dim=4, max_position_embeddings=64,
                      name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    with caplog.at_level("INFO", logger="eagle_jax.convert"):
        # a local copy of the default target (a path) still gets its bundled drafter
        assert resolve_drafter("default", "/models/smollm2", tc) == bundled_path("smollm2-135m-eagle3.1")
        assert "smollm2-135m-eagle3.1 (registered for 'HuggingFaceTB/SmolLM2-135M-Instruct'" in caplog.text
        caplog.clear()
        other = tc.__class__(**{**tc.__dict__, "name_or_path": "Qwen/Qwen3-0.6B"})
        assert resolve_drafter("default", "/models/qwen3", other) is None
    assert "no bundled drafter is registered for target '/models/qwen3' (Qwen/Qwen3-0.6B)" in caplog.text
    assert "decoding without speculation" in caplog.text


def test_batch_over_disable_by_batch_size_decodes_plainly(smollm2_target, tmp_path, capsys):
    path = tmp_path / "two.jsonl"
    path.write_text(json.dumps("What is 2+2?") + "\n" + json.dumps("Name a colour.") + "\n")
    common = ["generate", "--prompts-file", str(path), "--max-new-tokens", "6", "--json", "--dtype", "float32"]
    assert main([*common, "--draft", "none"]) == 0
    plain = _one_json_object(capsys.readouterr().out)
    assert main([*common, "--disable-by-batch-size", "1"]) == 0
    captured = capsys.readouterr()
    out = _one_json_object(captured.out)
    assert "over --disable-by-batch-size (1): decoding without speculation" in captured.err
    assert out["method"] == "plain" and "acceptance_length" not in out
    assert out["token_ids"] == plain["token_ids"]


def test_python_m_runs_from_the_checkout_root():
    """`python -m` from the checkout puts its root on sys.path: nothing there may shadow an
    installed package (a top-level kernels/ once shadowed the `kernels` package transformers
    imports), so the CLI runs without -P."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    r = subprocess.run([sys.executable, "-m", "eagle_jax.cli", "convert", "--help"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
    for name in ("kernels", "train", "serve", "benchmarks"):  # our subpackages' names, from the root
        r = subprocess.run([sys.executable, "-c", f"import importlib.util as u; s = u.find_spec({name!r}); "
                            "print(s.origin if s and s.origin else '-')"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and not r.stdout.strip().startswith(os.path.join(root, name, "")), r.stdout
