"""disable_by_batch_size: batches past the limit decode plainly, with the same output."""

import argparse

import pytest

import eagle_jax.generate
from eagle_jax import runtime
from eagle_jax.cli import args as cli_args
from eagle_jax.config import ConfigError, SpecConfig
from eagle_jax.generate import Generator

from spec_helpers import random_prompts, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def tiny():
    tcfg, tparams = tiny_target(vocab=8)
    return tcfg, tparams, tiny_drafter(tcfg, "eagle3", draft_vocab=6)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_batches_over_the_limit_decode_plainly(tiny, method):
    tcfg, tparams, d = tiny
    spec = SpecConfig(method, num_speculative_tokens=3, tree_top_k=2, tree_depth=2, tree_total_tokens=5,
                      disable_by_batch_size=2)
    gen = Generator(tcfg, tparams, drafter=d, spec=spec)
    prompts = random_prompts(8, [7, 12, 3])
    plain = Generator(tcfg, tparams).generate(prompts, max_new_tokens=20)
    over = gen.generate(prompts, max_new_tokens=20)
    assert not gen.speculates(3) and over.stats == {} and over.spec_stats is None
    assert over.token_ids == plain.token_ids
    within = gen.generate(prompts[:2], max_new_tokens=20)
    assert gen.speculates(2) and within.stats["num_verify_steps"] > 0
    assert within.token_ids == plain.token_ids[:2]


def test_none_always_speculates(tiny):
    tcfg, tparams, d = tiny
    gen = Generator(tcfg, tparams, drafter=d, spec=SpecConfig(disable_by_batch_size=None))
    assert gen.speculates(64) and not Generator(tcfg, tparams).speculates(1)


@pytest.mark.parametrize("native, wide, amx, limit", [(True, True, True, 4), (True, True, False, 1),
                                                      (True, False, False, 0), (False, True, True, 0)])
def test_auto_is_the_backend_default(tiny, monkeypatch, native, wide, amx, limit):
    """On CPU: batches up to 4 speculate with the native kernels on AMX tiles, batch 1 on AVX-512
    vectors; elsewhere nothing does."""
    from eagle_jax.kernels import cpu, ops

    monkeypatch.undo()  # the suite-wide fixture makes "auto" mean "always"; check the real default
    assert eagle_jax.generate.default_disable_by_batch_size is runtime.default_disable_by_batch_size
    monkeypatch.setattr(ops, "is_native", lambda impl: native)
    monkeypatch.setattr(cpu, "available", lambda: native)
    monkeypatch.setattr(cpu, "wide_vectors", lambda: wide)
    monkeypatch.setattr(cpu, "amx", lambda: amx)
    assert runtime.default_disable_by_batch_size() == limit  # the suite runs on CPU
    tcfg, tparams, d = tiny
    gen = Generator(tcfg, tparams, drafter=d)
    assert [gen.speculates(b) for b in (1, 2, 4, 5)] == [b <= limit for b in (1, 2, 4, 5)]


def test_wide_vectors_reads_the_cpu_flags(monkeypatch):
    from eagle_jax.kernels import cpu

    monkeypatch.setattr(cpu, "_cpu_id", lambda: "x86_64flags\t\t: fpu avx2 avx512f avx512bw")
    assert cpu.wide_vectors()
    monkeypatch.setattr(cpu, "_cpu_id", lambda: "x86_64flags\t\t: fpu avx2 fma avx512_bf16_like")
    assert not cpu.wide_vectors()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "never"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ConfigError, match="disable_by_batch_size"):
        SpecConfig(disable_by_batch_size=bad)


def test_cli_flag():
    p = argparse.ArgumentParser()
    cli_args.add_disable_by_batch_size(p)
    assert p.parse_args([]).disable_by_batch_size == "auto"
    assert p.parse_args(["--disable-by-batch-size", "none"]).disable_by_batch_size is None
    assert p.parse_args(["--disable-by-batch-size", "4"]).disable_by_batch_size == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--disable-by-batch-size", "0"])


def test_acceptance_tools_always_speculate():
    """Tools that measure acceptance must not fall back to plain decoding at batch > 1."""
    from eagle_jax.benchmarks import device_check, learning_curve

    assert all(s.disable_by_batch_size is None for s in learning_curve.ENGINES.values())
    assert device_check._spec(method="chain").disable_by_batch_size is None
