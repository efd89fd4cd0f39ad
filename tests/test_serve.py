"""`eagle-jax serve`: OpenAI-style endpoints return what the Generator returns."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from eagle_jax.convert.bundled import load_drafter_by_name
from eagle_jax.generate import Generator
from eagle_jax.serve.server import make_server

CHAT = [{"role": "user", "content": "Name three primary colours."}]


@pytest.fixture(scope="module")
def served(smollm2_target):
    t = smollm2_target
    drafter = load_drafter_by_name("default", t.cfg, "smollm2-135m-instruct", dtype="float32")
    gen = Generator(t.cfg, t.params, t.tokenizer, drafter=drafter)
    server = make_server(gen, "127.0.0.1", 0, model_name="smollm2", draft_name="default")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield gen, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _call(url, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_chat_completion_equals_generator(served):
    gen, url = served
    status, text = _call(url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "model": "x"})
    assert status == 200, text
    out = json.loads(text)
    ref = gen.generate([gen.tokenizer.apply_chat(CHAT)], max_new_tokens=12, chat=False)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.texts[0]}
    assert out["choices"][0]["finish_reason"] == ("length" if ref.finish_reasons[0] == "length" else "stop")
    assert out["usage"]["completion_tokens"] == len(ref.token_ids[0])
    assert out["usage"]["prompt_tokens"] == ref.prompt_tokens[0]
    assert out["eagle"]["draft"] == "default" and out["eagle"]["acceptance_length"] >= 1.0


def test_completions_batch_and_stop(served):
    gen, url = served
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    status, text = _call(url + "/v1/completions", {"prompt": prompts, "max_tokens": 10, "stop": [","]})
    assert status == 200, text
    out = json.loads(text)
    ref = gen.generate(prompts, max_new_tokens=10, chat=False, stop=[","])
    assert [c["text"] for c in out["choices"]] == ref.texts
    assert all("," not in c["text"] for c in out["choices"])


def test_stream_concatenates_to_the_full_answer(served):
    gen, url = served
    status, text = _call(url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "stream": True})
    assert status == 200, text
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    ref = gen.generate([gen.tokenizer.apply_chat(CHAT)], max_new_tokens=12, chat=False)
    assert streamed == ref.texts[0]
    assert ref.finish_reasons == ["length"]  # 12 tokens do not finish this answer
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_stop_string_finishes_with_stop(served):
    gen, url = served
    ref = gen.generate([gen.tokenizer.apply_chat(CHAT)], max_new_tokens=12, chat=False)
    stop = ref.texts[0].split()[1]
    status, text = _call(url + "/v1/chat/completions",
                         {"messages": CHAT, "max_tokens": 12, "stream": True, "stop": stop})
    assert status == 200, text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert stop not in streamed and ref.texts[0].startswith(streamed)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_failure_mid_stream_is_an_error_event(served, monkeypatch):
    gen, url = served

    def broken(*args, **kwargs):
        yield "Red"
        raise RuntimeError("device lost")

    monkeypatch.setattr(gen, "_stream_pieces", broken)
    status, text = _call(url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "stream": True})
    assert status == 200  # the headers were already sent when it failed
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"] == {"content": "Red"}
    assert json.loads(events[1])["error"] == {"message": "RuntimeError: device lost", "type": "server_error",
                                              "code": 500}
    assert events[2:] == ["[DONE]"]


def _concurrently(url, bodies):
    """POST every body at once (one thread each); the parsed replies in order."""
    out = [None] * len(bodies)

    def send(i):
        status, text = _call(url + "/v1/chat/completions", bodies[i])
        assert status == 200, text
        out[i] = json.loads(text)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def batching(served):
    """A second server on the same Generator that gathers requests for 3 s."""
    gen, _ = served
    server = make_server(gen, "127.0.0.1", 0, draft_name="default", max_batch=4, batch_window_s=3.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield gen, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


QUESTIONS = ["Name three primary colours.", "What is 2 + 2?", "Say hello in French."]


def test_concurrent_requests_are_batched_and_answer_as_alone(batching):
    gen, url = batching
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": m}
              for q, m in zip(QUESTIONS, [12, 6, 9])]
    bodies[1]["top_k"] = 5  # greedy ignores it: still the same batch
    replies = _concurrently(url, bodies)
    for q, m, out in zip(QUESTIONS, [12, 6, 9], replies):
        assert out["eagle"]["batch_size"] == 3
        assert 0 <= out["eagle"]["queue_s"] < 60
        alone = gen.generate([gen.tokenizer.apply_chat([{"role": "user", "content": q}])], max_new_tokens=m,
                             chat=False)
        assert out["choices"][0]["message"]["content"] == alone.texts[0]
        assert out["usage"]["completion_tokens"] == len(alone.token_ids[0])
        assert out["eagle"]["acceptance_length"] >= 1.0


def test_sampled_requests_batch_by_sampling_and_keep_their_seeds(batching):
    gen, url = batching
    sampled = {"temperature": 0.8, "top_k": 20, "max_tokens": 8}
    bodies = [{"messages": [{"role": "user", "content": QUESTIONS[0]}], **sampled, "seed": 11},
              {"messages": [{"role": "user", "content": QUESTIONS[1]}], **sampled, "seed": 12},
              {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 8}]
    replies = _concurrently(url, bodies)
    assert [r["eagle"]["batch_size"] for r in replies] == [2, 2, 1]  # greedy does not join the sampled batch
    for body, out in zip(bodies[:2], replies):
        alone = gen.generate([gen.tokenizer.apply_chat(body["messages"])], max_new_tokens=8, chat=False,
                             temperature=0.8, top_k=20, seed=body["seed"])
        assert out["choices"][0]["message"]["content"] == alone.texts[0]


def test_a_failing_batch_is_retried_request_by_request(batching, monkeypatch):
    gen, url = batching
    real = gen.generate

    def no_batches(prompts, **kw):  # e.g. out of memory for the combined shape only
        if len(prompts) > 1:
            raise RuntimeError("simulated failure of the combined batch")
        return real(prompts, **kw)

    monkeypatch.setattr(gen, "generate", no_batches)
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": 5} for q in QUESTIONS[:2]]
    replies = _concurrently(url, bodies)
    assert [r["eagle"]["batch_size"] for r in replies] == [1, 1]
    for body, out in zip(bodies, replies):
        alone = real([gen.tokenizer.apply_chat(body["messages"])], max_new_tokens=5, chat=False)
        assert out["choices"][0]["message"]["content"] == alone.texts[0]


@pytest.mark.parametrize("body, match", [
    ({"max_tokens": 5}, "missing field 'messages'"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"messages": CHAT, "temprature": 0.5}, "unknown field.*temprature"),
    ({"messages": [], "max_tokens": 5}, "messages must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]"),
    ({"messages": CHAT, "n": 2}, "n must be 1"),
    ({"messages": CHAT, "top_p": 1.5}, "top_p"),
    ({"messages": CHAT, "seed": -3}, r"seed must be in \[0, 2\*\*31\)"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "context"),
])
def test_bad_requests_get_400_naming_the_problem(served, body, match):
    import re

    _, url = served
    status, text = _call(url + "/v1/chat/completions", body)
    assert status == 400, text
    assert re.search(match, json.loads(text)["error"]["message"]), text


def test_invalid_json_routes_and_health(served):
    _, url = served
    status, text = _call(url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in text
    assert _call(url + "/v1/nothing", {})[0] == 404
    status, text = _call(url + "/health")
    assert status == 200 and json.loads(text)["draft"] == "default"
    status, text = _call(url + "/v1/models")
    assert json.loads(text)["data"][0]["id"] == "smollm2"


def test_health_names_the_batch_policy(served):
    gen, url = served
    with urllib.request.urlopen(url + "/health", timeout=60) as r:
        info = json.loads(r.read().decode())
    assert info["method"] == gen.spec.method
    assert "disable_by_batch_size" in info and info["disable_by_batch_size"] == gen.disable_by_batch_size
