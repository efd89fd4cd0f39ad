"""`eagle-jax serve` through the official `openai` client and raw sockets.

One Generator (SmolLM2 + its bundled drafter, fp32) behind the engine
serves every test. Answers are compared with the Generator's own, bad input
with OpenAI-style JSON errors, and a load of concurrent clients (some
streaming, some leaving early) with the same requests sent alone.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eagle_jax.config import SpecConfig
from eagle_jax.convert.bundled import bundled_path, load_drafter_by_name
from eagle_jax.generate import Generator
from eagle_jax.serve.app import make_server
from eagle_jax.serve.limits import Limits, PortInUse, bind

CHAT = [{"role": "user", "content": "Name three primary colours."}]
QUESTIONS = ["Name three primary colours.", "What is 2 + 2?", "Say hello in French.", "Name a large animal.",
             "What colour is the sky?", "Count to five.", "Name a fruit.", "What is the capital of Italy?"]
MODEL = "smollm2"
ROWS = 4


@pytest.fixture(scope="module")
def gen(smollm2_target):
    t = smollm2_target
    drafter = load_drafter_by_name("default", t.cfg, "smollm2-135m-instruct", dtype="float32")
    # Speculating at every batch size (the CPU's default may turn it off): the tests read its counters.
    return Generator(t.cfg, t.params, t.tokenizer, drafter=drafter, spec=SpecConfig(disable_by_batch_size=None))


ENGINES = {}  # URL -> the engine of the server started there


def _start(gen, **kw):
    """A server on its own engine (drafting at every step: the counters below are then certain)."""
    settings = {"max_batch": ROWS, "max_len": 256, "prefill_chunk": 32, "adaptive": False, **kw}
    server = make_server(gen, "127.0.0.1", 0, model_name=MODEL, draft_name="default", **settings)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ENGINES[url] = server.engine
    return server, url


@pytest.fixture(scope="module")
def served(gen):
    server, url = _start(gen, limits=Limits(body_timeout_s=2.0, max_tokens=256))
    yield gen, url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=600)


def _alone(gen, messages, **kw):
    return gen.generate([gen.tokenizer.apply_chat(messages)], chat=False, **kw)


def _ask(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# ---------------------------------------------------------------------------- answers


def test_chat_completion_equals_generator(served, client):
    gen, _ = served
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12)
    ref = _alone(gen, CHAT, max_new_tokens=12)
    assert out.choices[0].message.content == ref.texts[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == ("length" if ref.finish_reasons[0] == "length" else "stop")
    assert out.usage.completion_tokens == len(ref.token_ids[0])
    assert out.usage.prompt_tokens == ref.prompt_tokens[0]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    eagle = out.model_extra["eagle"]
    assert eagle["acceptance_length"] >= 1.0 and eagle["batch_size"] == 1


def test_list_content_is_the_joined_text(served, client):
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "primary colours."}]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=6)
    joined = _ask(client, "Name three\nprimary colours.", max_tokens=6)
    assert out.choices[0].message.content == joined.choices[0].message.content


def test_null_fields_take_their_defaults(served, client):
    """JSON null for an optional field means its default, as in the OpenAI API."""
    _, url = served
    common = {k: None for k in ("model", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
                                "stream_options", "user", "frequency_penalty", "presence_penalty", "logit_bias",
                                "logprobs")}
    chat = [{"role": "user", "content": CHAT[0]["content"], "name": None}]
    status, text, _ = _post(url + "/v1/chat/completions", {
        "messages": chat, "max_tokens": 6, "max_completion_tokens": None, "top_logprobs": None, **common})
    assert status == 200, text
    plain = _ask(client, CHAT[0]["content"], max_tokens=6).choices[0].message.content
    assert json.loads(text)["choices"][0]["message"]["content"] == plain
    nulled = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=None, top_p=None,
                                            n=None, seed=None, stop=None)
    assert nulled.choices[0].message.content == plain
    prompt = "The capital of France is"
    status, text, _ = _post(url + "/v1/completions", {"prompt": prompt, "max_tokens": 6, "echo": None,
                                                      "suffix": None, "best_of": None, **common})
    assert status == 200, text
    assert json.loads(text)["choices"][0]["text"] == client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6).choices[0].text


TOOL_TURNS = [{"role": "user", "content": "What is 6 * 7?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function", "function": {"name": "multiply", "arguments": "[6, 7]"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
TOOLS = [{"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}]


def test_tool_calls_are_refused_where_the_template_cannot_render_them(served, client):
    """SmolLM2's template ignores tool calls: they are refused, not silently dropped."""
    _, url = served
    for body, param in [({"messages": TOOL_TURNS[:2]}, "messages.1.tool_calls"),
                        ({"messages": [TOOL_TURNS[0], TOOL_TURNS[2]]}, "messages.1.tool_call_id"),
                        ({"messages": CHAT, "tools": TOOLS}, "tools")]:
        status, text, _ = _post(url + "/v1/chat/completions", {**body, "max_tokens": 4})
        err = json.loads(text)["error"]
        assert status == 400 and err["param"] == param and "tools are not supported" in err["message"], text
    with pytest.raises(openai.BadRequestError, match="tools are not supported"):
        client.chat.completions.create(model=MODEL, messages=TOOL_TURNS, max_tokens=4)


def test_tool_calls_reach_a_template_that_renders_them(served, client, monkeypatch):
    gen, _ = served
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }}{{ c.function.arguments }}"
                "</call>{% endfor %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}<|im_end|>\n"
                "{% endfor %}{% for t in tools or [] %}tool: {{ t.function.name }}\n{% endfor %}"
                "<|im_start|>assistant\n")
    monkeypatch.setattr(gen.tokenizer.hf, "chat_template", template)
    out = client.chat.completions.create(model=MODEL, messages=TOOL_TURNS, tools=TOOLS, max_tokens=6)
    rendered = gen.tokenizer.render_chat([{**m, "content": m["content"] or ""} for m in TOOL_TURNS], tools=TOOLS)
    assert "<call id=call_1>multiply[6, 7]</call>" in rendered and "(for call_1)" in rendered
    assert "tool: multiply" in rendered
    ids = gen.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == gen.generate([ids], max_new_tokens=6, chat=False).texts[0]


def test_completions_prompts_and_stop(served, client):
    gen, _ = served
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, stop=[","])
    ref = gen.generate(prompts, max_new_tokens=10, chat=False, stop=[","])
    assert [c.text for c in out.choices] == ref.texts
    assert [c.index for c in out.choices] == [0, 1]
    assert all("," not in c.text for c in out.choices)
    assert out.usage.completion_tokens == sum(len(t) for t in ref.token_ids)


def test_token_id_prompt(served, client):
    gen, _ = served
    ids = gen.tokenizer.encode("The capital of France is")
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert out.choices[0].text == gen.generate([ids], max_new_tokens=6, chat=False).texts[0]


def test_stream_with_usage_equals_the_whole_answer(served, client):
    gen, _ = served
    ref = _alone(gen, CHAT, max_new_tokens=12)
    text, chunks = _streamed(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert text == ref.texts[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []  # the usage chunk
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids[0])
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens[0]
    _, plain = _streamed(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices  # no usage unless asked for


def test_stream_stop_string_finishes_with_stop(served, client):
    gen, _ = served
    ref = _alone(gen, CHAT, max_new_tokens=12)
    stop = ref.texts[0].split()[1]
    text, chunks = _streamed(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, stream=True, stop=stop, stream_options={"include_usage": True}))
    alone = _alone(gen, CHAT, max_new_tokens=12, stop=[stop])
    assert stop not in text and text == alone.texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(alone.token_ids[0])


def test_completion_stream(served, client):
    gen, _ = served
    stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == gen.generate(["The capital of France is"], max_new_tokens=8, chat=False).texts[0]


def test_seed_makes_sampling_repeatable(served, client):
    gen, _ = served
    body = dict(max_tokens=8, temperature=0.8, extra_body={"top_k": 20})
    first = _ask(client, QUESTIONS[0], seed=11, **body).choices[0].message.content
    again = _ask(client, QUESTIONS[0], seed=11, **body).choices[0].message.content
    ref = _alone(gen, [{"role": "user", "content": QUESTIONS[0]}], max_new_tokens=8, temperature=0.8, top_k=20,
                 seed=11)
    assert first == again == ref.texts[0]
    streamed, _ = _streamed(_ask(client, QUESTIONS[0], seed=11, stream=True, **body))
    assert streamed == first


def test_failure_mid_stream_is_an_error_event(served, monkeypatch):

    _, url = served

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    engine = ENGINES[url]
    monkeypatch.setattr(engine, "_programs", engine._programs._replace(step_rows=broken))
    status, text, _ = _post(url + "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "stream": True})
    assert status == 200  # the headers were already sent when it failed
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["message"] == "RuntimeError: device lost"
    assert json.loads(events[-2])["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"


def test_models_health_and_unknown_model(served, client):
    gen, url = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    status, text, _ = _get(url + "/health")
    info = json.loads(text)
    assert status == 200 and info["draft"] == "default" and info["method"] == gen.spec.method
    assert info["disable_by_batch_size"] == gen.disable_by_batch_size
    assert info["engine"] == "continuous" and info["max_rows"] == ROWS and info["warmup_s"] > 0
    assert _get(url + "/v1/nothing")[0] == 404


def test_metrics_use_vllm_names(served, client):
    _, url = served
    _ask(client, QUESTIONS[1], max_tokens=6)
    status, text, headers = _get(url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:generation_tokens", "vllm:prompt_tokens",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos",
                 "vllm:request_success", "vllm:e2e_request_latency_seconds"):
        assert name in fams, name
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    label = (("model_name", MODEL),)
    assert value[("vllm:generation_tokens_total", label)] >= 6
    assert value[("vllm:num_requests_running", label)] == 0
    drafts = value[("vllm:spec_decode_num_drafts_total", label)]
    accepted = value[("vllm:spec_decode_num_accepted_tokens_total", label)]
    assert drafts > 0 and 0 <= accepted <= value[("vllm:spec_decode_num_draft_tokens_total", label)]
    per_pos = [v for (n, lab), v in value.items() if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos and sum(per_pos) == accepted
    assert value[("vllm:time_to_first_token_seconds_count", label)] > 0


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, param, match", [
    ({"max_tokens": 5}, "messages", "missing field 'messages'"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": CHAT, "max_tokens": 10 ** 6}, "max_tokens", "over this server's limit of 256"),
    ({"messages": CHAT, "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"messages": CHAT, "temprature": 0.5}, "temprature", "unknown field 'temprature'"),
    ({"messages": [], "max_tokens": 5}, "messages", "at least 1"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "string or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "only text parts"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'system'"),
    ({"messages": CHAT, "n": 2}, "n", "n must be 1"),
    ({"messages": CHAT, "logprobs": True}, "logprobs", "logprobs are not supported"),
    ({"messages": CHAT, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"messages": CHAT, "seed": -3}, "seed", "greater than or equal to 0"),
    ({"messages": CHAT, "stop": [1]}, "stop", "stop must be a string"),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages", "context"),
])
def test_bad_chat_requests_get_400_naming_the_field(served, body, param, match):
    _, url = served
    status, text, _ = _post(url + "/v1/chat/completions", body)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert re.search(match, err["message"]), err


@pytest.mark.parametrize("body, match", [
    ({"prompt": ""}, "prompt must be"),
    ({"prompt": [[]]}, "prompt must be"),
    ({"prompt": [10 ** 9]}, "outside the vocabulary"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs are not supported"),
    ({"prompt": "hi", "echo": True}, "echo is not supported"),
    ({"prompt": ["a", "b"], "stream": True}, "stream takes a single prompt"),
])
def test_bad_completion_requests_get_400(served, body, match):
    _, url = served
    status, text, _ = _post(url + "/v1/completions", body)
    assert status == 400, text
    assert re.search(match, json.loads(text)["error"]["message"]), text


def test_openai_client_sees_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, max_tokens=2)


@pytest.mark.parametrize("raw, match", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature: .*finite number"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32"),
    (b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32"),
    (b"{not json", "not valid JSON"),
    (b'["a list"]', "must be a JSON object"),
])
def test_malformed_bodies_get_400(served, raw, match):
    _, url = served
    status, text, _ = _post(url + "/v1/chat/completions", raw=raw)
    assert status == 400, text
    assert re.search(match, json.loads(text)["error"]["message"]), text


def _raw_exchange(url: str, head: bytes, body: bytes = b"", wait_s: float = 30) -> tuple[int, dict, float]:
    """Send bytes on a fresh connection; the status, JSON error and seconds until the reply."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        t = time.perf_counter()
        s.sendall(head + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"], time.perf_counter() - t


def test_bad_content_length_gets_a_json_400(served):
    _, url = served
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
    status, err, _ = _raw_exchange(url, head, b"{}")
    assert status == 400 and err["message"] == "malformed HTTP request: bad Content-Length"  # more: test_http.py


def test_a_body_that_never_arrives_times_out(served):
    _, url = served
    status, err, seconds = _raw_exchange(url, _head("/v1/completions", b"x" * 100), b'{"prompt": ')
    assert status == 408 and "did not arrive within 2 s" in err["message"]
    assert seconds < 10


def test_a_5mb_body_is_refused_before_it_is_read(served):
    _, url = served
    body = b'{"prompt": "' + b"word " * 1_000_000 + b'"}'
    head = _head("/v1/completions", body)
    # Only the start is sent: unread bytes at the server's close would reset the connection.
    status, err, seconds = _raw_exchange(url, head, body[:1024])
    assert status == 413 and "at most 1048576" in err["message"]
    assert seconds < 2  # not tokenized (that takes ~10 s)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
        b"Transfer-Encoding: chunked\r\n\r\n"
    step = 65536
    chunks = b"".join(b"%x\r\n%s\r\n" % (step, body[i:i + step]) for i in range(0, (1 << 20) + step, step))
    status, err, _ = _raw_exchange(url, head, chunks)  # no length given: refused once past the limit
    assert status == 413 and "over 1048576 bytes" in err["message"]


def _head(path: str, body: bytes, content_type: str | None = "application/json") -> bytes:
    ctype = b"" if content_type is None else b"Content-Type: %s\r\n" % content_type.encode()
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n" % (path.encode(), ctype, len(body))


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_declared_json_gets_415(served, content_type):
    """A web page's simple cross-origin POST (no preflight) cannot reach the engine."""
    _, url = served
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status, err, _ = _raw_exchange(url, _head("/v1/completions", body, content_type), body)
    assert status == 415 and err["code"] == "unsupported_media_type", err
    assert "Content-Type must be application/json" in err["message"]


def test_json_with_a_charset_is_json(served, client):
    _, url = served
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode()
    reply = _exchange_to_eof(url, _head("/v1/completions", body, "Application/JSON; charset=utf-8") + body)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    text = json.loads(reply.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]
    assert text == client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4) \
        .choices[0].text  # the openai client sends application/json


def _exchange_to_eof(url: str, data: bytes, half_close: bool = False) -> bytes:
    """Send bytes with `Connection: close` semantics read to the end (shutting the sending side first
    when `half_close`); everything the server sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=300) as s:
        s.sendall(data.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n", 1))
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_gets_its_answer(served, client, stream):
    _, url = served
    body = json.dumps({"messages": CHAT, "max_tokens": 6, "stream": stream}).encode()
    reply = _exchange_to_eof(url, _head("/v1/chat/completions", body) + body, half_close=True)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    expected = _ask(client, CHAT[0]["content"], max_tokens=6).choices[0].message.content
    if stream:
        events = [json.loads(line[6:]) for line in reply.decode().splitlines()
                  if line.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected
        assert b"data: [DONE]" in reply
    else:
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == expected


def test_a_client_gone_mid_body_is_one_log_line(served, caplog):
    _, url = served
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(_head("/v1/completions", b"x" * 100) + b'{"prompt": ')
    deadline = time.monotonic() + 30
    while "before its request body arrived" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    gone = [r for r in caplog.records if "before its request body arrived" in r.getMessage()]
    assert len(gone) == 1 and gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # no traceback
    assert _get(url + "/health")[0] == 200


def test_api_key(gen):
    server, url = _start(gen, api_key="sekret")
    try:
        bare = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bare.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert _get(url + "/health")[0] == 200  # health and metrics stay open
    finally:
        server.shutdown()
        server.server_close()


def test_a_busy_port_is_one_line(served, capsys):
    from eagle_jax.cli import main

    port = int(served[1].rsplit(":", 1)[1])
    with pytest.raises(PortInUse, match=f"cannot listen on 127.0.0.1:{port}: address already in use"):
        bind("127.0.0.1", port)
    assert main(["serve", "--port", str(port)]) == 1  # before the model is loaded
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and "address already in use" in lines[0], lines


def test_a_batch_the_mesh_does_not_divide_is_one_line(capsys):
    from eagle_jax.cli import main

    assert main(["serve", "--mesh", "2x4", "--max-batch", "3"]) == 1  # before the model is loaded
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and "--max-batch must be a positive multiple of the mesh's data axis (2)" in lines[0]


@pytest.mark.parametrize("argv, env", [(["--api-key", ""], None), (["--api-key", "key "], None), ([], "")])
def test_an_empty_api_key_is_refused_at_start_up(capsys, monkeypatch, argv, env):
    from eagle_jax.cli import main

    if env is not None:
        monkeypatch.setenv("EAGLE_JAX_API_KEY", env)
    assert main(["serve", "--port", "0", *argv]) == 1  # before the model is loaded
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and "the API key (--api-key or $EAGLE_JAX_API_KEY) is empty" in lines[0], lines


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_bad_port_is_an_argument_error(capsys, port):
    from eagle_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --port: expected a port in 0..65535, got '{port}'" in err, err


# ---------------------------------------------------------------------------- a served process


def _serve_process(*flags: str) -> tuple[subprocess.Popen, str]:
    """`eagle-jax serve` in a subprocess on a free port (two rows, 256 slots): it and its URL,
    once it has warmed up."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.Popen([sys.executable, "-m", "eagle_jax.cli", "serve", "--port", "0", "--max-batch", "2",
                             "--max-len", "256", "--prefill-chunk", "32", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # the start-up line
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not found:
        proc.kill()
        pytest.fail(f"no start-up line: {line!r}\n{proc.communicate()[1][-3000:]}")
    return proc, found.group(0)


def _stream_lines(url: str, body: dict):
    """A streamed POST: the response's lines as they come."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return (line.decode().strip() for line in resp if line.strip())


def _events(lines) -> list:
    return [line.removeprefix("data: ") for line in lines]


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_lets_a_stream_finish_then_exits_0(smollm2_target):
    """SIGTERM mid-stream: no new connections, the stream runs to its end and [DONE], exit 0.
    The target and drafter are given as paths: /health and /v1/models name them, never the paths."""
    drafter = bundled_path("smollm2-135m-eagle3.1")
    proc, url = _serve_process("--target", smollm2_target.source, "--draft", drafter,
                               "--disable-by-batch-size", "none")  # speculating on any CPU
    try:
        health = _get(url + "/health")[1]
        info = json.loads(health)
        stem = os.path.basename(smollm2_target.source).removesuffix(".gguf")
        assert info["model"] == stem and info["draft"] == "smollm2-135m-eagle3.1", info
        assert os.path.dirname(smollm2_target.source) not in health and drafter not in health
        assert json.loads(_get(url + "/v1/models")[1])["data"][0]["id"] == stem
        lines = _stream_lines(url, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 48})
        first = next(lines)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not _refused(url):  # the listener closes while the stream still runs
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        events = _events([first, *lines])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
        assert proc.wait(timeout=120) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


def test_sigterm_past_the_shutdown_timeout_ends_requests_cleanly():
    """With --shutdown-timeout 0 a running stream ends with an "abort" chunk and [DONE], a running
    non-streamed request with a 503; the process exits 0."""
    proc, url = _serve_process("--draft", "none", "--shutdown-timeout", "0")
    try:
        lines = _stream_lines(url, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200})
        first = next(lines)
        whole = {}
        t = threading.Thread(target=lambda: whole.update(zip(("status", "text"), _post(
            url + "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 200})[:2])))
        t.start()
        deadline = time.monotonic() + 60
        while _running_and_waiting(url) != (2, 0):
            assert time.monotonic() < deadline, "the second request never ran"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        events = _events([first, *lines])
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        t.join(timeout=120)
        assert whole["status"] == 503, whole
        assert "shut down before this request finished" in json.loads(whole["text"])["error"]["message"]
        assert proc.wait(timeout=120) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()


# ---------------------------------------------------------------------------- load


def _together(jobs):
    """Run every callable at once (one thread each); their results in order."""
    out, errors = [None] * len(jobs), []

    def run(i):
        try:
            out[i] = jobs[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **{"timeout": 600, **kw})


def test_concurrent_requests_share_steps_and_answer_as_alone(served):
    gen, url = served
    c = _client(url)
    lengths = [12, 6, 9]
    replies = _together([lambda q=q, m=m: _ask(c, q, max_tokens=m, extra_body={"top_k": 5})
                         for q, m in zip(QUESTIONS, lengths)])  # greedy ignores top_k
    for q, m, out in zip(QUESTIONS, lengths, replies):
        alone = _alone(gen, [{"role": "user", "content": q}], max_new_tokens=m)
        assert out.choices[0].message.content == alone.texts[0]
        assert out.usage.completion_tokens == len(alone.token_ids[0])
    assert max(out.model_extra["eagle"]["batch_size"] for out in replies) >= 2  # they ran side by side


def _load(url, n_clients: int, caplog) -> None:
    """n_clients at once: greedy ones (half streaming, mixed lengths), sampled ones
    and ones that leave early; then every greedy answer against the same request
    sent alone, nothing compiled after the warm-up, and the server back to idle
    and answering."""
    c, impatient = _client(url), _client(url, timeout=0.3)
    greedy = [(QUESTIONS[i % len(QUESTIONS)], 4 + 3 * (i % 5), i % 2 == 1) for i in range(n_clients // 2)]

    def ask(q, m, stream):
        if stream:
            return _streamed(_ask(c, q, max_tokens=m, stream=True))[0]
        return _ask(c, q, max_tokens=m).choices[0].message.content

    def leave_stream(q):
        stream = _ask(c, q, max_tokens=40, stream=True)
        next(iter(stream))
        stream.close()

    def leave_whole(q):
        try:
            _ask(impatient, q, max_tokens=40)
        except openai.APITimeoutError:  # gone after 0.3 s, while its request waits or runs
            pass

    jobs = [lambda g=g: ask(*g) for g in greedy]
    rest = n_clients - len(jobs)
    for i in range(rest):
        q = QUESTIONS[i % len(QUESTIONS)]
        kind = i % 3
        if kind == 0:
            jobs.append(lambda q=q, i=i: _ask(c, q, max_tokens=8, temperature=0.8, seed=i, stream=True,
                                              extra_body={"top_k": 20}))
        else:
            jobs.append(lambda q=q, k=kind: leave_stream(q) if k == 1 else leave_whole(q))
    compiles = []

    def listen(event, _secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        answers = _together(jobs)[:len(greedy)]
        for (q, m, _), answer in zip(greedy, answers):
            assert answer == ask(q, m, False), (q, m)  # the same request alone
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert not compiles, f"{len(compiles)} compilations after the warm-up"
    deadline = time.monotonic() + 120
    while _running_and_waiting(url) != (0, 0):
        assert time.monotonic() < deadline, "requests left running after their clients left"
        time.sleep(0.2)
    assert _get(url + "/health")[0] == 200
    assert "client disconnected" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text  # no tracebacks
    text = _get(url + "/metrics")[1]
    aborts = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort"]
    assert aborts and aborts[0] >= 1


def _running_and_waiting(url):
    text = _get(url + "/metrics")[1]
    v = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return v["vllm:num_requests_running"], v["vllm:num_requests_waiting"]


def test_load_with_streams_and_clients_leaving(served, caplog):
    _load(served[1], 12, caplog)


@pytest.mark.slow
def test_heavy_load(gen, caplog):
    server, url = _start(gen, max_batch=8, adaptive=True)
    try:
        _load(url, 32, caplog)
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------- helpers


def _post(url, body=None, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    return _send(urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}))


def _get(url):
    return _send(urllib.request.Request(url))


def _send(req):
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers
