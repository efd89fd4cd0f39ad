"""The engine (eagle_jax/engine/) on SmolLM2-135M (fp32), plain and with its bundled drafter (chain, tree).

Requests join and leave a fixed set of rows between steps; every greedy
answer must equal what `Generator.generate` gives for the prompt alone,
whatever ran beside it, and nothing may compile after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import urllib.request

import jax
import numpy as np
import openai
import pytest

import eagle_jax.generate
from eagle_jax.config import SpecConfig
from eagle_jax.convert.bundled import load_drafter_by_name
from eagle_jax.generate import Generator
from eagle_jax.engine import Delta, DraftPolicy, Engine, EngineError, Sampling, draft_depths, fitting_max_len
from eagle_jax.serve.app import make_server
from eagle_jax.serve.cli import add_arguments
from eagle_jax.spec_decode import loop

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time",
           "The largest planet is", "Water boils at", "My favourite colour is"]
ROWS = 3
CHUNK = 16  # prompt tokens prefilled a call


def _engine(gen):
    # Drafting at every step (adaptive=False): the tests below check the drafts' statistics;
    # test_steps_that_change_the_draft_depth checks an adaptive engine's switching.
    return Engine(gen, max_rows=ROWS, max_len=256, speculative=gen.speculative, adaptive=False,
                      prefill_chunk=CHUNK, prefill_budget=CHUNK)


@pytest.fixture(scope="module")
def plain(smollm2_target):
    t = smollm2_target
    gen = Generator(t.cfg, t.params, t.tokenizer)
    engine = _engine(gen)
    yield gen, engine
    engine.close()


def _speculative(t, spec: SpecConfig):
    """A Generator with the bundled drafter and its engine, then the engine closed."""
    drafter = load_drafter_by_name("default", t.cfg, "smollm2-135m-instruct", dtype="float32")
    gen = Generator(t.cfg, t.params, t.tokenizer, drafter=drafter, spec=spec)
    engine = _engine(gen)
    yield gen, engine
    engine.close()


@pytest.fixture(scope="module")
def chain(smollm2_target):
    yield from _speculative(smollm2_target, SpecConfig())


@pytest.fixture(scope="module")
def tree(smollm2_target):
    yield from _speculative(smollm2_target, SpecConfig(method="tree"))


@pytest.fixture(params=["plain", "chain"])
def served(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=["plain", "chain", "tree"])
def any_method(request):
    return request.getfixturevalue(request.param)


def _ids(gen, prompt: str) -> list[int]:
    return gen.tokenizer.encode(prompt)


def _alone(gen, prompt: str, max_tokens: int, **kw):
    return gen.generate([_ids(gen, prompt)], max_new_tokens=max_tokens, chat=False, **kw)


async def _collect(req, started: asyncio.Event | None = None):
    """(text, Done) of a request; `started` is set at its first event."""
    text = ""
    async for event in req.events():
        if started is not None:
            started.set()
        if isinstance(event, Delta):
            text += event.text
        else:
            return text, event


def _check_alone(gen, prompt, max_tokens, text, done, **kw):
    ref = _alone(gen, prompt, max_tokens, **kw)
    assert text == ref.texts[0], prompt
    assert done.completion_tokens == len(ref.token_ids[0]), prompt
    assert done.prompt_tokens == ref.prompt_tokens[0]
    assert done.finish_reason == ref.finish_reasons[0], prompt  # one vocabulary: eos, stop, length, context


def test_warm_up_is_reported(served):
    gen, engine = served
    info = engine.info()
    assert info["engine"] == "continuous" and info["max_rows"] == ROWS and info["prefill_chunk"] == CHUNK
    assert info["row_buckets"] == [1, 2, 3]
    assert info["warmup_s"] > 0
    assert info["method"] == (gen.spec.method if gen.speculative else "plain")


def test_staggered_greedy_requests_match_each_alone(any_method):
    """Each request joins while the one before it is mid-generation."""
    gen, engine = any_method
    prompts = PROMPTS[:4]

    async def scenario():
        tasks = []
        for p in prompts:
            started = asyncio.Event()
            tasks.append(asyncio.create_task(_collect(engine.submit(_ids(gen, p), Sampling(max_new_tokens=16)), started)))
            await started.wait()
        return await asyncio.gather(*tasks)

    outs = asyncio.run(scenario())
    for p, (text, done) in zip(prompts, outs):
        _check_alone(gen, p, 16, text, done)
        assert done.ttft_s is not None and done.ttft_s <= done.wall_s
    assert all(done.extra["batch_size"] >= 2 for _, done in outs[1:])  # they did share steps
    if gen.speculative:
        for _, done in outs:
            s = done.spec
            assert s.verify_steps >= 1 and 0 <= s.accepted <= s.draft_tokens == s.verify_steps * gen.spec.depth
            assert s.per_position[0] <= s.verify_steps and sorted(s.per_position, reverse=True) == s.per_position


def test_a_lone_request_steps_one_row(plain, monkeypatch):
    """A request alone runs in row 0 and each step covers that row only, not every row."""
    gen, engine = plain
    rows, step = [], engine._programs.step_rows

    def spy(*args, rows_=rows, **kwargs):
        rows_.append(kwargs["rows"])
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=spy))
    async def alone():
        return await _collect(engine.submit(_ids(gen, PROMPTS[2]), Sampling(max_new_tokens=8)))

    text, done = asyncio.run(alone())
    _check_alone(gen, PROMPTS[2], 8, text, done)
    assert done.extra["row"] == 0 and rows and set(rows) == {1}


def test_a_long_prompt_is_prefilled_between_the_running_rows_steps(any_method, monkeypatch):
    """A newcomer's prompt of several chunks goes in one chunk (the budget) between two steps of the
    row that runs; both answers equal each prompt alone."""
    gen, engine = any_method
    calls, chunk, step = [], loop.prompt_chunk_jit, engine._programs.step_rows

    def spy(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(loop, "prompt_chunk_jit", spy("chunk", chunk))
    monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=spy("step", step)))
    running, newcomer = PROMPTS[3], " ".join(PROMPTS[:6])
    n_chunks = -(-len(_ids(gen, newcomer)) // CHUNK)
    assert n_chunks >= 3

    async def scenario():
        started = asyncio.Event()
        first = asyncio.create_task(_collect(engine.submit(_ids(gen, running), Sampling(max_new_tokens=40)),
                                             started))
        await started.wait()
        second = await _collect(engine.submit(_ids(gen, newcomer), Sampling(max_new_tokens=8)))
        return await first, second

    (text, done), (text2, done2) = asyncio.run(scenario())
    _check_alone(gen, running, 40, text, done)
    _check_alone(gen, newcomer, 8, text2, done2)
    where = [i for i, c in enumerate(calls) if c == "chunk"][-n_chunks:]  # the newcomer's chunks
    assert all("step" in calls[a:b] for a, b in zip(where, where[1:]))


def test_cancel_mid_way_leaves_the_others_and_frees_the_row(chain):
    gen, engine = chain
    long, other, later = PROMPTS[3], PROMPTS[0], PROMPTS[1]

    async def scenario():
        started = asyncio.Event()
        victim = engine.submit(_ids(gen, long), Sampling(max_new_tokens=200))
        victim_task = asyncio.create_task(_collect(victim, started))
        await started.wait()
        other_started = asyncio.Event()
        rest = asyncio.create_task(_collect(engine.submit(_ids(gen, other), Sampling(max_new_tokens=16)),
                                            other_started))
        await other_started.wait()  # both requests hold rows now
        victim.cancel()
        cancelled = await victim_task
        after = await _collect(engine.submit(_ids(gen, later), Sampling(max_new_tokens=16)))
        return cancelled, await rest, after

    (_, aborted), (text, done), (text2, done2) = asyncio.run(scenario())
    assert aborted.finish_reason == "abort" and aborted.completion_tokens < 200
    _check_alone(gen, other, 16, text, done)
    assert done2.extra["row"] == aborted.extra["row"]  # the freed row, reused
    _check_alone(gen, later, 16, text2, done2)


def test_stop_string_ends_the_row_at_its_step(chain):
    gen, engine = chain
    prompt = PROMPTS[1]  # " 5, 6, 7, ..."
    stop = [" 7"]

    async def scenario():
        return await _collect(engine.submit(_ids(gen, prompt), Sampling(max_new_tokens=200, stop=tuple(stop))))

    text, done = asyncio.run(scenario())
    ref = _alone(gen, prompt, 24, stop=stop)
    assert ref.finish_reasons[0] == "stop"  # the prompt does reach the stop string
    assert done.finish_reason == "stop" and text == ref.texts[0] and " 7" not in text
    assert done.completion_tokens == len(ref.token_ids[0])
    # The row stopped on the device at that step: one step or so per token shown, not 200 tokens' worth.
    assert done.spec.verify_steps <= done.completion_tokens + 1


def test_new_sampling_settings_compile_nothing(served):
    gen, engine = served
    compiles = []

    def listen(event, _secs, **_):
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            compiles.append(event)

    jitted = (loop.prompt_chunk_jit, loop.start_row_jit, loop.step_rows_jit, loop.insert_jit)
    sizes = [f._cache_size() for f in jitted]
    settings = [Sampling(max_new_tokens=12, temperature=0.73, top_p=0.91, top_k=17, seed=5),
                Sampling(max_new_tokens=12, temperature=1.3, seed=11, seed_stream=2), Sampling(max_new_tokens=12)]

    async def scenario():
        return await asyncio.gather(*(_collect(engine.submit(_ids(gen, PROMPTS[i]), s))
                                      for i, s in enumerate(settings)))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        outs = asyncio.run(scenario())
        after = len(compiles)
        jax.jit(lambda x: x + 1)(0.0)  # the listener does hear a compile
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert after == 0 and len(compiles) == 2 and [f._cache_size() for f in jitted] == sizes
    for i, ((text, done), s) in enumerate(zip(outs, settings)):
        # A row samples from its own key: what it would sample alone.
        _check_alone(gen, PROMPTS[i], 12, text, done, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                     seed=[(s.seed, s.seed_stream)])
    # The rows, free again, ask for no filter: a free row makes no later step run top-k / top-p.
    free = jax.tree.map(np.asarray, engine._state.sampling)
    assert (free.temperature == 0).all() and (free.top_k == 0).all() and (free.top_p == 1).all()


def test_more_requests_than_rows_queue_and_complete(plain):
    gen, engine = plain

    async def scenario():
        reqs = [engine.submit(_ids(gen, p), Sampling(max_new_tokens=8)) for p in PROMPTS]
        waiting = engine.load()[1]
        return waiting, await asyncio.gather(*(_collect(r) for r in reqs))

    waiting, outs = asyncio.run(scenario())
    assert waiting >= 1 and engine.load() == (0, 0)
    for p, (text, done) in zip(PROMPTS, outs):
        _check_alone(gen, p, 8, text, done)
        assert done.extra["batch_size"] <= ROWS
    assert max(done.extra["queue_s"] for _, done in outs) > 0


def test_served_through_the_openai_client(chain):
    """`eagle-jax serve --max-batch N`: make_server builds an N-row engine; answers equal the Generator's alone."""
    gen, _ = chain
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-batch", str(ROWS), "--max-len", "256", "--fixed-draft-depth"])
    assert (args.max_batch, args.max_len, args.fixed_draft_depth) == (ROWS, 256, True)
    server = make_server(gen, "127.0.0.1", 0, model_name="smollm2", draft_name="default",
                         max_batch=args.max_batch, max_len=args.max_len, adaptive=not args.fixed_draft_depth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        health = json.loads(urllib.request.urlopen(url + "/health").read())
        assert health["engine"] == "continuous" and health["draft"] == "default" and health["warmup_s"] > 0
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        questions = ["Name three primary colours.", "What is 2 + 2?", "Say hello in French."]
        answers = [None] * len(questions)

        def ask(i):
            messages = [{"role": "user", "content": questions[i]}]
            if i == 0:  # streamed, with usage
                chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12,
                                                             stream=True, stream_options={"include_usage": True}))
                answers[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                              chunks[-1].usage.completion_tokens)
            else:
                out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12)
                answers[i] = out.choices[0].message.content, out.usage.completion_tokens

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for q, (text, tokens) in zip(questions, answers):
            ref = gen.generate([gen.tokenizer.apply_chat(q)], max_new_tokens=12, chat=False)
            assert text == ref.texts[0] and tokens == len(ref.token_ids[0]), q
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(plain, monkeypatch):
    gen, engine = plain

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    async def ask(prompt):
        return await _collect(engine.submit(_ids(gen, prompt), Sampling(max_new_tokens=8)))

    monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=broken))
    with pytest.raises(EngineError, match="device lost"):
        asyncio.run(ask(PROMPTS[0]))
    monkeypatch.undo()
    assert engine.load() == (0, 0)
    text, done = asyncio.run(ask(PROMPTS[2]))
    _check_alone(gen, PROMPTS[2], 8, text, done)


class _Cycle:
    """A draft policy that cycles through the deepest depth, plain and depth 1, recording what it was told."""

    def __init__(self, deepest):
        self.order, self.n, self.seen = [deepest, 0, 1], 0, []

    def choose(self, rows, catch_up_calls, horizon, filtered):
        self.n += 1
        return self.order[self.n % 3]

    def observe(self, rows, depth, seconds, counts, filtered):
        self.seen.append((rows, depth, counts))


@pytest.fixture(scope="module")
def adaptive(chain):
    """An adaptive engine (its plain steps leave the drafter behind) on the chain fixture's Generator."""
    gen, _ = chain
    engine = Engine(gen, max_rows=2, max_len=256, prefill_chunk=CHUNK, speculative=True)
    yield gen, engine
    engine.close()


def test_steps_that_change_the_draft_depth(adaptive, monkeypatch):
    """Plain steps leave the drafter behind and it catches up before the next drafting step; with
    shallower steps between, the answers still equal each prompt alone, and the drafting steps after
    plain ones are still accepted."""
    gen, engine = adaptive
    assert engine.lc.catch_up_width and engine.info()["adaptive"]
    # The warm-up's step times, as the policy weighs them: every row bucket at every depth, and its catch-up.
    depths = [0, *draft_depths(gen.spec.depth)]
    kinds = [*depths, "catch_up", *(f"{d}+filter" for d in depths)]  # with top-k / top-p rows too
    assert engine.info()["step_ms"].keys() == {f"{r}x{k}" for r in engine.row_buckets for k in kinds}
    assert all(ms > 0 for ms in engine.info()["step_ms"].values())
    policy = _Cycle(gen.spec.depth)
    monkeypatch.setattr(engine, "_policy", policy)
    before, catch_ups = dict(engine.info()["steps"]), engine.info()["catch_ups"]

    async def both():
        return await asyncio.gather(*[_collect(engine.submit(_ids(gen, p), Sampling(max_new_tokens=24)))
                                      for p in PROMPTS[:2]])

    outs = asyncio.run(both())
    for p, (text, done) in zip(PROMPTS[:2], outs):
        _check_alone(gen, p, 24, text, done)
    after = engine.info()["steps"]
    assert all(after.get(str(d), 0) > before.get(str(d), 0) for d in policy.order)
    assert engine.info()["catch_ups"] > catch_ups  # the plain steps left the drafter behind
    assert sum(done.spec.accepted for _, done in outs) > 0
    assert {d for _, d, _ in policy.seen} == set(policy.order)
    assert all(1 <= c <= d + 1 for _, d, counts in policy.seen for c in counts)
    assert all(c == 1 for _, d, counts in policy.seen if d == 0 for c in counts)
    # Each request's draft tokens are the sum of its steps' depths: more than one a step, fewer than the deepest.
    for _, done in outs:
        assert done.spec.verify_steps < done.spec.draft_tokens < done.spec.verify_steps * gen.spec.depth


class _Deepest(_Cycle):
    """A draft policy that always drafts at the deepest depth, counting its calls."""

    def choose(self, rows, catch_up_calls, horizon, filtered):
        self.n += 1
        return self.order[0]


def test_no_drafting_starts_while_a_prompt_is_joining(adaptive, monkeypatch):
    """Two requests at once: the first runs while the second's long prompt goes in a chunk a step.
    Its drafter lags (its own prompt), so those steps are plain, with no catch-up and no policy call;
    once both run, the drafter catches up over both together and drafts; answers equal each alone."""
    gen, engine = adaptive
    policy = _Deepest(gen.spec.depth)
    monkeypatch.setattr(engine, "_policy", policy)
    monkeypatch.setattr(engine, "prefill_budget", CHUNK)  # one chunk of the newcomer between two steps
    seen, step = [], engine._programs.step_rows

    def spy(*args, **kwargs):
        seen.append((bool(engine._filling), kwargs["depth"], engine.catch_ups, policy.n))
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=spy))
    long = " ".join(PROMPTS) + " " + " ".join(reversed(PROMPTS))
    assert len(_ids(gen, long)) > 3 * CHUNK

    async def both():
        with engine._wake:  # both queued before the loop thread admits either: they arrive together
            reqs = [engine.submit(_ids(gen, PROMPTS[0]), Sampling(max_new_tokens=16)),
                    engine.submit(_ids(gen, long), Sampling(max_new_tokens=8))]
        return await asyncio.gather(*map(_collect, reqs))

    before = engine.catch_ups
    outs = asyncio.run(both())
    for p, m, (text, done) in zip([PROMPTS[0], long], (16, 8), outs):
        _check_alone(gen, p, m, text, done)
    joining = [s for s in seen if s[0]]
    assert len(joining) >= 3 and all(d == 0 for _, d, _, _ in joining)
    assert all(c == before and n == 0 for _, _, c, n in joining)  # no catch-up, no policy call
    assert any(d == gen.spec.depth for f, d, _, _ in seen if not f)
    assert outs[0][1].spec.accepted + outs[1][1].spec.accepted > 0


def test_seeded_requests_sample_the_same_alone_under_load_and_plain(adaptive, plain, monkeypatch):
    """A seeded sampled request (the coupled sampler, spec_decode/sampling.py) gives the same text
    alone and in a burst of requests that share its steps, whatever depths the draft policy picks
    (forced to cycle through the deepest, plain and 1: each run meets them at other positions),
    and that text is plain decoding's (the engine without a drafter: --draft none) and the
    static batch's (`Generator.generate`), where plain and speculative agree token for token."""
    gen, engine = adaptive
    pgen, pengine = plain
    policy = _Cycle(gen.spec.depth)
    monkeypatch.setattr(engine, "_policy", policy)
    seeded = [(PROMPTS[0], Sampling(max_new_tokens=24, temperature=0.7, seed=3)),
              (PROMPTS[3], Sampling(max_new_tokens=24, temperature=1.0, top_p=0.9, top_k=40, seed=8, seed_stream=1))]
    others = [(PROMPTS[i], Sampling(max_new_tokens=8 + 4 * i, temperature=0.9, seed=i)) for i in (1, 4, 5)]

    def texts(eng, reqs):
        async def run():
            return await asyncio.gather(*(_collect(eng.submit(_ids(gen, p), s)) for p, s in reqs))
        return [text for text, _ in asyncio.run(run())]

    alone = [texts(engine, [r])[0] for r in seeded]
    burst = texts(engine, [others[0], seeded[0], others[1], seeded[1], others[2]])
    assert [burst[1], burst[3]] == alone
    assert {d for _, d, _ in policy.seen} == set(policy.order)  # every depth ran, plain included
    assert max(len(counts) for _, _, counts in policy.seen) == 2  # steps shared by two rows
    assert texts(pengine, seeded) == alone
    for (p, s), text in zip(seeded, alone):
        kw = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=[(s.seed, s.seed_stream)])
        spec, ref = _alone(gen, p, 24, **kw), _alone(pgen, p, 24, **kw)
        assert spec.token_ids == ref.token_ids and spec.texts == ref.texts == [text]
        assert spec.stats["accepted_tokens"] > 0


def test_steps_over_more_rows_than_disable_by_batch_size_are_plain(smollm2_target, monkeypatch):
    """By default the generator's disable_by_batch_size caps, step by step, the running rows that
    speculate (vLLM's rule): a lone request drafts, two together step plainly, and the answers stay
    each prompt's alone."""
    t = smollm2_target
    drafter = load_drafter_by_name("default", t.cfg, "smollm2-135m-instruct", dtype="float32")
    gen = Generator(t.cfg, t.params, t.tokenizer, drafter=drafter, spec=SpecConfig(disable_by_batch_size=1))
    engine = Engine(gen, max_rows=2, max_len=256, adaptive=False, prefill_chunk=CHUNK)
    try:
        assert engine.lc.speculative and engine.info()["disable_by_batch_size"] == 1
        seen, step = [], engine._programs.step_rows

        def spy(*args, **kwargs):
            seen.append((len(engine._jobs), kwargs["depth"]))
            return step(*args, **kwargs)

        monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=spy))

        async def scenario():
            started = asyncio.Event()
            first = asyncio.create_task(_collect(engine.submit(_ids(gen, PROMPTS[0]), Sampling(max_new_tokens=32)), started))
            await started.wait()
            second = await _collect(engine.submit(_ids(gen, PROMPTS[1]), Sampling(max_new_tokens=6)))
            return [await first, second]

        outs = asyncio.run(scenario())

        async def together_then_alone():
            pair = await asyncio.gather(*(_collect(engine.submit(_ids(gen, p), Sampling(max_new_tokens=24)))
                                          for p in PROMPTS[2:4]))
            before = engine.catch_ups
            alone = await _collect(engine.submit(_ids(gen, PROMPTS[4]), Sampling(max_new_tokens=4)))
            return pair, engine.catch_ups - before, alone

        pair, catch_ups, alone = asyncio.run(together_then_alone())
    finally:
        engine.close()
    for p, m, (text, done) in zip(PROMPTS[:5], (32, 6, 24, 24, 4), outs + pair + [alone]):
        _check_alone(gen, p, m, text, done)
    assert any(n == 2 for n, _ in seen) and all(d == 0 for n, d in seen if n == 2)
    assert any(d == gen.spec.depth for n, d in seen if n == 1)
    # Every step the pair shared was plain (above); one of them may still draft in a step it ran alone,
    # before the other's prefill joined (scheduling order). The lone request after them catches its
    # drafter up over its own prompt only, not over the pair's plain steps as well.
    assert pair[0][1].spec.verify_steps + pair[1][1].spec.verify_steps <= sum(1 for n, d in seen if n == 1 and d > 0)
    assert catch_ups == -(-len(_ids(gen, PROMPTS[4])) // engine.lc.catch_up_width)


def test_disable_by_batch_size_auto_leaves_an_adaptive_engine_uncapped(chain, monkeypatch):
    """Where "auto" caps speculation at 1 row (AVX-512), the adaptive engine drafts at any row count
    its policy finds paying; a fixed-depth engine keeps the cap."""
    gen, _ = chain
    monkeypatch.setattr(eagle_jax.generate, "default_disable_by_batch_size", lambda: 1)
    assert gen.spec.disable_by_batch_size == "auto" and gen.disable_by_batch_size == 1
    for adaptive, cap in ((True, None), (False, 1)):
        engine = Engine(gen, max_rows=2, max_len=256, prefill_chunk=CHUNK, adaptive=adaptive)
        try:
            assert engine.lc.speculative and engine.info()["disable_by_batch_size"] == cap
            assert engine.info()["adaptive"] == adaptive
        finally:
            engine.close()


def test_fitting_max_len_is_the_least_that_holds_prompt_and_answer(chain):
    """The chain engine (max_len 256) holds exactly context_limit tokens a row: fitting_max_len
    gives 256 for a prompt and answer of that length, and more for one token more."""
    gen, engine = chain
    prompt = 40
    answer = engine.context_limit - prompt
    assert fitting_max_len(gen, prompt, answer) == engine.max_len == 256
    assert fitting_max_len(gen, prompt, answer + 1) == 320


def test_fitting_max_len_holds_the_last_prefill_chunk_whole(plain):
    gen, _ = plain
    assert fitting_max_len(gen, 130, 1, prefill_chunk=64) == 192  # chunks up to 192 > 130 + 1 + 2
    assert fitting_max_len(gen, 130, 1, prefill_chunk=128) == 256


def test_draft_policy_picks_the_depth_with_the_most_tokens_per_second():
    costs = {(1, 0, False): 0.020, (1, 1, False): 0.025, (1, 2, False): 0.032,
             (4, 0, False): 0.030, (4, 1, False): 0.060, (4, 2, False): 0.085}
    policy = DraftPolicy(costs, deepest=2, probe=4)
    assert policy.accept == [0.5, 0.5]  # nothing measured: Laplace's prior
    policy.observe(4, 2, 0.090, [3, 2, 1, 2])  # 3 of 4 rows accepted past position 0, 1 of 4 past position 1
    assert policy.accept == pytest.approx([4 / 6, 2 / 6])
    # 4 rows: 1 / 30 ms, 1.67 / 60 ms, 2 / 85 ms (3 / 85 ms if all were accepted); 1 row: 1 / 20, 1.67 / 25, 2 / 32.
    assert [policy.choose(4) for _ in range(12)] == [0, 0, 0, 2] + [0] * 7 + [2]  # probes after 4, then 8
    assert policy.choose(1) == 1
    slow = DraftPolicy({(16, 0, False): 0.060, (16, 2, False): 0.200}, deepest=2, probe=4)  # 3/200 ms < 1/60 ms
    assert [slow.choose(16) for _ in range(12)] == [0] * 12  # no probe can pay: none is made
    policy.observe(4, 0, 0.200, [1, 1])  # a plain step runs slow (the machine is busy): every depth slows
    assert policy.load == pytest.approx(0.8 * (0.8 + 0.2 * 0.090 / 0.085) + 0.2 * 0.200 / 0.030)
    assert policy.seconds(4, 2) / policy.seconds(4, 0) == pytest.approx(0.085 / 0.030)
    assert policy.accept == pytest.approx([(3 * .95 + 1) / (4 * .95 + 2), (.95 + 1) / (4 * .95 + 2)])  # it ages
    assert [policy.choose(4) for _ in range(8)] == [0] * 8  # so drafting does not look cheaper than it did
    for _ in range(10):
        policy.observe(4, 2, 0.060, [3, 3, 3, 3])  # the rows now accept every draft
    assert policy.choose(4) == 2
    assert policy.accept[1] > 0.85


def test_draft_policy_weighs_the_step_times_of_filtering_rows_apart():
    """Top-k / top-p filters run only in steps where some row asks for them, and cost a drafting
    step (more positions) more than a plain one: the policy weighs the times that apply."""
    costs = {(4, 0, False): 0.053, (4, 2, False): 0.075, (4, 0, True): 0.060, (4, 2, True): 0.110}
    policy = DraftPolicy(costs, deepest=2, probe=1000)
    for _ in range(10):
        policy.observe(4, 2, 0.075, [2, 2, 1, 2])  # 1.75 tokens a step
    assert policy.choose(4) == 2  # 75 ms / 1.75 beats 53 ms
    assert policy.choose(4, filtered=True) == 0  # 110 ms / 1.75 loses to 60 ms
    policy.observe(4, 2, 0.220, [2, 2, 1, 2], filtered=True)  # twice its filtered time: the machine is busy
    assert policy.load == pytest.approx(0.8 + 0.2 * 2)


def test_draft_policy_probes_only_where_a_probe_with_its_catch_up_could_win():
    costs = {(4, 0, False): 0.044, (4, 1, False): 0.072, (4, 3, False): 0.122, (4, "catch_up"): 0.0125}
    policy = DraftPolicy(costs, deepest=3, probe=2)
    for _ in range(10):
        policy.observe(4, 1, 0.072, [2, 1, 1, 2])  # half the first drafts accepted: plain wins
    # 4 tokens a row for 122 ms + 10 catch-up calls (4 new prompts) lose to 44 ms a token: no probe
    assert [policy.choose(4, catch_up_calls=10, horizon=64) for _ in range(8)] == [0] * 8
    # 1 call behind (16 plain steps since the last draft): the probe could win, so it is made
    assert 3 in [policy.choose(4, catch_up_calls=1, horizon=64) for _ in range(8)]


def test_draft_policy_tries_drafting_again_after_a_plain_spell():
    """Rows that accepted nothing make one row plain; the counts age over the plain steps that
    follow, back towards the prior, until drafting wins again (new rows may accept more)."""
    policy = DraftPolicy({(1, 0, False): 0.020, (1, 1, False): 0.026}, deepest=1, probe=1000)
    for _ in range(20):
        policy.observe(1, 1, 0.026, [1])  # no draft accepted: 1 token / 26 ms
    assert policy.choose(1) == 0
    plain = 0
    while policy.choose(1) == 0:
        policy.observe(1, 0, 0.020, [1])
        plain += 1
    assert 5 < plain < 60 and policy.accept[0] > 0.3  # 1.3 tokens / 26 ms beat 1 / 20 ms


def test_draft_policy_spreads_a_catch_up_over_the_tokens_left():
    policy = DraftPolicy({(1, 0, False): 0.020, (1, 1, False): 0.025, (1, "catch_up"): 0.010}, deepest=1,
                          probe=1000)
    for _ in range(20):
        policy.observe(1, 1, 0.025, [2])  # every draft accepted: about 1.95 tokens a step
    assert policy.choose(1) == 1  # level: 1.95 tokens / 25 ms beats 1 / 20 ms
    # 13 catch-up calls behind (a 200-token prompt): 130 ms spread over 8 tokens left loses, over 200 wins
    assert policy.choose(1, catch_up_calls=13, horizon=8) == 0
    assert policy.choose(1, catch_up_calls=13, horizon=200) == 1


def test_a_thread_iterates_its_request(plain):
    """Outside an event loop a request's events are iterated (regenerate's and scripts' way),
    and the text equals the Generator's alone."""
    gen, engine = plain
    req = engine.submit(_ids(gen, PROMPTS[1]), Sampling(max_new_tokens=8))
    events = list(req)
    text = "".join(e.text for e in events if isinstance(e, Delta))
    _check_alone(gen, PROMPTS[1], 8, text, events[-1])
    with pytest.raises(RuntimeError, match="outside an event loop"):
        asyncio.run(anext(req.events()))


def test_bad_sampling_is_refused_when_made():
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)
    with pytest.raises(ValueError, match="seed"):
        Sampling(max_new_tokens=4, seed=-1)
    with pytest.raises(ValueError, match="stop"):
        Sampling(max_new_tokens=4, stop="END")
    with pytest.raises(ValueError, match="temperature"):
        Sampling(max_new_tokens=4, temperature=-1.0)
