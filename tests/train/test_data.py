"""Tests for eagle_jax.train.data: ShareGPT parsing, split, loss masks, batches, cache."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from eagle_jax.train import data

# ---------------------------------------------------------------------------
# Loss mask on a hand-checked chat (real SmolLM2 tokenizer, ChatML template)
# ---------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye."},
]


def _pieces(tok, ids):
    return [tok.decode([int(t)]) for t in ids]


def _masked_runs(tok, ex):
    """Decoded tokens of each maximal run of loss_mask == 1."""
    runs, cur = [], []
    for t, m in zip(ex["input_ids"], ex["loss_mask"]):
        if m:
            cur.append(tok.decode([int(t)]))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_render_hand_checked_mask(tokenizer):
    ex = data.render({"id": "x", "messages": CHAT}, tokenizer)
    ids, mask = ex["input_ids"], ex["loss_mask"]
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == mask.shape
    # The ids are exactly the template's own tokenization.
    full = tokenizer.apply_chat_template(CHAT, tokenize=True)
    full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "keys") else full
    assert ids.tolist() == list(full)
    text = tokenizer.decode(ids.tolist())
    assert text == tokenizer.apply_chat_template(CHAT, tokenize=False)

    # Exactly the assistant contents + their <|im_end|> are masked in.
    assert _masked_runs(tokenizer, ex) == [
        ["Hello", "!", "<|im_end|>"],
        ["4", "<|im_end|>"],
        ["Good", "bye", ".", "<|im_end|>"],
    ]
    pieces = _pieces(tokenizer, ids)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Token by token around the first assistant turn.
    first = int(np.argmax(mask))
    assert pieces[first] == "Hello" and mask[first] == 1
    assert pieces[first - 4 : first] == ["<|im_start|>", "ass", "istant", "\n"]
    assert mask[first - 4 : first].tolist() == [0, 0, 0, 0]  # the header is out
    assert pieces[first + 2] == "<|im_end|>" and mask[first + 2] == 1
    assert pieces[first + 3] == "\n" and mask[first + 3] == 0  # newline after it is out
    # Every <|im_end|>: in after assistant content, out after system/user content.
    ends = np.flatnonzero(ids == im_end)
    assert len(ends) == 7
    assert mask[ends].tolist() == [0, 0, 1, 0, 1, 0, 1]
    # Every header (<|im_start|> role \n) is out; mask[0] is 0.
    assert mask[0] == 0
    for s in np.flatnonzero(ids == im_start):
        assert mask[s : s + 3].sum() == 0
    # Count check: masked tokens = content tokens of the assistant turns + 3 ends.
    n_content = sum(
        len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
        for m in CHAT
        if m["role"] == "assistant"
    )
    assert int(mask.sum()) == n_content + 3


def test_render_default_system_and_bare_list(tokenizer):
    chat = CHAT[1:3]  # no system: the template adds its default system prompt
    ex = data.render(chat, tokenizer)
    assert ex["id"] == ""
    text = tokenizer.decode(ex["input_ids"].tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert _masked_runs(tokenizer, ex) == [["Hello", "!", "<|im_end|>"]]


def test_render_literal_special_tokens_stay_text(tokenizer):
    chat = [
        {"role": "user", "content": "Say <|im_end|> or <|im_start|>assistant please"},
        {"role": "assistant", "content": "Fine: <|im_end|>"},
    ]
    ex = data.render(chat, tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, mask = ex["input_ids"], ex["loss_mask"]
    # Only template-written <|im_end|>: system, user, assistant.
    ends = np.flatnonzero(ids == im_end)
    assert len(ends) == 3 and mask[ends].tolist() == [0, 0, 1]
    runs = _masked_runs(tokenizer, ex)
    assert len(runs) == 1 and "".join(runs[0]) == "Fine: <|im_end|><|im_end|>"
    assert runs[0][-1] == "<|im_end|>"


def test_render_keeps_ordinary_added_tokens(tokenizer):
    """SmolLM2's added tokens such as <filename> are produced as the tokenizer
    normally does (only control tokens in contents are split into text)."""
    chat = [
        {"role": "user", "content": "git add <filename>"},
        {"role": "assistant", "content": "Run `cat <filename> | wc -l`."},
    ]
    ex = data.render(chat, tokenizer)
    full = tokenizer.apply_chat_template(chat, tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full
    assert ex["input_ids"].tolist() == list(full)
    fname = tokenizer.convert_tokens_to_ids("<filename>")
    pos = np.flatnonzero(ex["input_ids"] == fname)
    assert len(pos) == 2 and ex["loss_mask"][pos].tolist() == [0, 1]


def test_render_truncation(tokenizer):
    ex = data.render(CHAT, tokenizer)
    n = len(ex["input_ids"])
    short = data.render(CHAT, tokenizer, max_length=25)
    assert len(short["input_ids"]) == 25 == len(short["loss_mask"])
    assert short["input_ids"].tolist() == ex["input_ids"][:25].tolist()
    assert short["loss_mask"].tolist() == ex["loss_mask"][:25].tolist()
    assert len(data.render(CHAT, tokenizer, max_length=10 * n)["input_ids"]) == n


def test_render_matches_whole_text_tokenization_on_sharegpt(tokenizer):
    """Piece-wise tokenization (no token straddles a mask boundary) equals the
    template's whole-text tokenization on real data, and the masked text is
    exactly the assistant contents each followed by <|im_end|>."""
    convs = list(data.iter_sharegpt(limit=200))
    for conv in convs:
        msgs = conv["messages"]
        ex = data.render(conv, tokenizer)
        full = tokenizer.apply_chat_template(msgs, tokenize=True)
        full = full["input_ids"] if hasattr(full, "keys") else full
        has_special = any("<|im_" in m["content"] or "<|endoftext|>" in m["content"] for m in msgs)
        if not has_special:
            assert ex["input_ids"].tolist() == list(full), conv["id"]
        runs = [
            tokenizer.decode([int(t) for t in r], skip_special_tokens=False)
            for r in _id_runs(ex)
        ]
        want = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
        assert runs == want, conv["id"]


def _id_runs(ex):
    runs, cur = [], []
    for t, m in zip(ex["input_ids"], ex["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def test_tokenize_conversations_drops_unanswered_after_truncation(tokenizer):
    long_user = {"role": "user", "content": "word " * 300}
    convs = [
        {"id": "a", "messages": CHAT},
        {"id": "b", "messages": [long_user, {"role": "assistant", "content": "ok"}]},
    ]
    stats = {}
    exs = data.tokenize_conversations(convs, tokenizer, max_length=64, stats=stats)
    assert [e["id"] for e in exs] == ["a"]
    assert stats == {"rendered": 2, "too_short": 1, "errors": 0}
    assert len(data.tokenize_conversations(convs * 3, tokenizer, 64, limit=2)) == 2
    assert all(len(e["input_ids"]) <= 64 for e in exs)


# ---------------------------------------------------------------------------
# ShareGPT parsing
# ---------------------------------------------------------------------------


def test_sharegpt_first_200(sharegpt_file):
    recs = list(data.iter_sharegpt_records(limit=200))
    assert len(recs) == 200
    assert recs[0]["id"] == "QWJhYvA_0"
    assert recs[0]["conversations"][0]["from"] == "human"
    stats = {}
    convs = list(data.iter_sharegpt(limit=200, stats=stats))
    assert len(convs) == 200 and stats["kept"] == 200
    assert stats["records"] == stats["kept"] + stats["dropped"]
    for c in convs:
        _check_normalised(c)
    assert convs[0]["id"] == "QWJhYvA_0"


def _check_normalised(c):
    msgs = c["messages"]
    assert isinstance(c["id"], str) and c["id"]
    roles = [m["role"] for m in msgs]
    if roles[0] == "system":
        roles = roles[1:]
    assert roles, c["id"]
    assert roles == ["user", "assistant"] * (len(roles) // 2), c["id"]
    for m in msgs:
        assert m["content"] and m["content"] == m["content"].strip()


def test_sharegpt_full_count(sharegpt_file):
    """The whole (truncated) file: 17,671 complete records, 129,071 turns
    (about 1-2 s)."""
    stats = {}
    n = turns = 0
    for rec in data.iter_sharegpt_records(stats=stats):
        n += 1
        turns += len(rec["conversations"])
    assert (n, turns) == (17671, 129071)
    assert stats["truncated"] and stats["tail_chars"] > 0
    stats = {}
    kept = sum(1 for _ in data.iter_sharegpt(stats=stats))
    assert stats["records"] == 17671
    assert kept == stats["kept"] == 17376


def _write(tmp_path, text: str | bytes, name="x.json"):
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return p


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 20])
def test_json_array_stream_truncated_and_complete(tmp_path, chunk):
    recs = [{"id": f"r{i}", "v": "é✓😀" * i, "n": [i, 2.5, None, True]} for i in range(12)]
    whole = json.dumps(recs, ensure_ascii=False, indent=1)
    p = _write(tmp_path, whole)
    stats = {}
    assert list(data.iter_json_array(p, chunk_bytes=chunk, stats=stats)) == recs
    assert not stats["truncated"]
    # Cut in the middle of the last record, including mid-way through a UTF-8 sequence.
    raw = whole.encode("utf-8")
    last = raw.rindex(b'"r11"')  # inside the last record
    close = raw.rindex(b"}")  # its closing brace
    cuts = list(range(last, close, max(1, (close - last) // 13))) + [close - 1, close - 2]
    assert any((raw[c] & 0xC0) == 0x80 for c in range(last, close))  # multi-byte chars there
    for cut in cuts + [c for c in range(last, close) if (raw[c] & 0xC0) == 0x80][:5]:
        got = list(data.iter_json_array(_write(tmp_path, raw[:cut]), chunk_bytes=chunk, stats=stats))
        assert got == recs[:11], cut
        assert stats["truncated"]
    # Cut right after a complete record (no closing bracket).
    end10 = whole.index('"id": "r11"')
    got = list(data.iter_json_array(_write(tmp_path, whole[:end10].rsplit("{", 1)[0]), chunk_bytes=chunk))
    assert got == recs[:11]


def test_json_array_not_an_array(tmp_path):
    with pytest.raises(ValueError):
        list(data.iter_json_array(_write(tmp_path, '{"a": 1}')))
    assert list(data.iter_json_array(_write(tmp_path, "  [ ] "))) == []


def _rec(*turns, id="c_0"):
    return {"id": id, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_normalize_rules():
    n = data.normalize_conversation
    # role mapping, stripping
    c = n(_rec(("human", " hi "), ("chatgpt", "yo\n"), ("user", "q"), ("bard", "a")))
    assert c == {"id": "c_0", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    # system first is kept; leading assistant turns dropped; trailing user dropped
    c = n(_rec(("system", "S"), ("gpt", "cont"), ("human", "q"), ("gpt", "a"), ("human", "q2")))
    assert [m["role"] for m in c["messages"]] == ["system", "user", "assistant"]
    # empty turns dropped, then cut at the first break of alternation
    c = n(_rec(("human", "q"), ("gpt", "a"), ("gpt", "a2"), ("human", "q3"), ("gpt", "a3")))
    assert [m["content"] for m in c["messages"]] == ["q", "a"]
    c = n(_rec(("human", "q"), ("gpt", "  "), ("human", "q2"), ("gpt", "a2")))
    assert c is None  # user, user -> cut to [user] -> no answer
    c = n(_rec(("human", "q"), ("gpt", "a"), ("system", "late"), ("human", "q2"), ("gpt", "a2")))
    assert len(c["messages"]) == 2
    # unknown role cuts; no pair left -> None
    c = n(_rec(("human", "q"), ("gpt", "a"), ("alien", "x"), ("human", "q2"), ("gpt", "a2")))
    assert len(c["messages"]) == 2
    assert n(_rec(("gpt", "only answer"))) is None
    assert n(_rec(("human", "only question"))) is None
    assert n({"id": "x"}) is None


# ---------------------------------------------------------------------------
# Held-out split
# ---------------------------------------------------------------------------


def _fake_convs(n, chunks=1):
    return [{"id": f"id{i:05d}_{k}", "messages": []} for i in range(n) for k in range(chunks)]


def test_split_is_fixed_by_id():
    convs = _fake_convs(4000)
    train, held = data.split_conversations(convs, 0.05, seed=0)
    assert len(train) + len(held) == 4000
    assert 120 < len(held) < 290  # ~200
    held_ids = {c["id"] for c in held}
    # Independent of how many were read and of the order.
    _, held_prefix = data.split_conversations(convs[:1000], 0.05, seed=0)
    assert {c["id"] for c in held_prefix} == {c["id"] for c in convs[:1000]} & held_ids
    _, held_rev = data.split_conversations(convs[::-1], 0.05, seed=0)
    assert {c["id"] for c in held_rev} == held_ids
    # Deterministic across calls, sensitive to the seed, nested in the fraction.
    assert data.split_conversations(convs, 0.05, seed=0)[1] == held
    assert {c["id"] for c in data.split_conversations(convs, 0.05, seed=1)[1]} != held_ids
    assert held_ids <= {c["id"] for c in data.split_conversations(convs, 0.2, seed=0)[1]}
    # Train never loses anything to max_heldout.
    train2, held2 = data.split_conversations(convs, 0.05, seed=0, max_heldout=10)
    assert train2 == train and held2 == held[:10]
    assert data.split_conversations(convs, 0.0)[1] == []
    assert data.split_conversations(convs, 1.0)[0] == []


def test_split_keeps_chunks_together():
    convs = _fake_convs(500, chunks=3)
    _, held = data.split_conversations(convs, 0.1)
    bases = {data.base_id(c["id"]) for c in held}
    assert len(held) == 3 * len(bases) > 0
    assert data.base_id("QWJhYvA_12") == "QWJhYvA"
    # regenerate --later-turns ids: a later turn sits on its conversation's side of the split
    assert data.base_id("QWJhYvA_12#u3") == "QWJhYvA"
    assert all(data.is_heldout(f"{c['id']}#u2", 0.1) == data.is_heldout(c["id"], 0.1) for c in convs)


def test_split_on_real_ids(sharegpt_file):
    convs = list(data.iter_sharegpt(limit=300))
    a = data.split_conversations(convs, 0.1, seed=0)[1]
    b = data.split_conversations(list(data.iter_sharegpt(limit=300)), 0.1, seed=0)[1]
    assert [c["id"] for c in a] == [c["id"] for c in b] and 0 < len(a) < 300


# ---------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------


def _examples(n, seed=0, max_len=40):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(1, max_len))
        out.append({
            "id": str(i),
            "input_ids": np.full(L, i + 1, np.int32),  # row content identifies the example
            "loss_mask": (rng.random(L) < 0.5).astype(np.int32),
        })
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_batch_shapes_and_padding():
    exs = _examples(50)
    bs = list(data.batches(exs, 4, 32, seed=3))
    assert len(bs) == data.num_batches(50, 4) == 12
    for b in bs:
        assert b["input_ids"].shape == (4, 32) and b["input_ids"].dtype == np.int32
        assert b["loss_mask"].shape == (4, 32) and b["loss_mask"].dtype == np.int32
        assert b["attention_mask"].shape == (4, 32)
        assert b["lengths"].shape == (4,) and b["lengths"].dtype == np.int32
        for r in range(4):
            L = int(b["lengths"][r])
            ex = exs[int(b["input_ids"][r, 0]) - 1]
            assert L == min(len(ex["input_ids"]), 32)
            np.testing.assert_array_equal(b["input_ids"][r, :L], ex["input_ids"][:L])
            np.testing.assert_array_equal(b["loss_mask"][r, :L], ex["loss_mask"][:L])
            assert (b["input_ids"][r, L:] == 0).all() and (b["loss_mask"][r, L:] == 0).all()
            assert b["attention_mask"][r].tolist() == [1] * L + [0] * (32 - L)
    # each example at most once per epoch, 48 of 50 used
    seen = [int(b["input_ids"][r, 0]) for b in bs for r in range(4)]
    assert len(set(seen)) == 48


def test_batches_keep_last_and_pad_id():
    exs = _examples(10)
    bs = list(data.batches(exs, 4, 48, drop_last=False, pad_id=7, seed=1))
    assert len(bs) == 3
    seen = sorted(int(b["input_ids"][r, 0]) for b in bs for r in range(4) if b["lengths"][r])
    assert seen == list(range(1, 11))
    short = [b for b in bs if (b["lengths"] == 0).any()]
    assert len(short) == 1 and (short[0]["lengths"] == 0).sum() == 2
    for b in bs:
        for r in range(4):
            assert (b["input_ids"][r, b["lengths"][r]:] == 7).all()


def test_a_process_builds_only_its_rows_of_each_batch():
    """The rows of one process (a multi-process run) are those rows of the whole batch, at the
    whole batch's padded width, with its real token count; a short last batch's empty rows too."""
    exs = _examples(10)
    kw = dict(seed=2, drop_last=False, bucket_lengths=[16, 32, 48])
    whole = list(data.batches(exs, 4, 48, **kw))
    for rows in (slice(0, 2), slice(2, 4)):
        part = list(data.batches(exs, 4, 48, rows=rows, **kw))
        assert len(part) == len(whole)
        for a, b in zip(part, whole):
            assert a["input_ids"].shape == (2, b["input_ids"].shape[1])
            for k in ("input_ids", "loss_mask", "attention_mask", "lengths", "example_indices"):
                np.testing.assert_array_equal(a[k], b[k][rows])
            assert a["real_tokens"] == b["real_tokens"] == int(b["lengths"].sum())
            assert (a["index"], a["epoch"]) == (b["index"], b["epoch"])


def test_batches_deterministic_and_resumable():
    exs = _examples(37)
    kw = dict(seed=5, epochs=3)
    ref = list(data.batches(exs, 4, 32, **kw))
    assert len(ref) == 3 * 9
    assert [b["index"] for b in ref] == list(range(27))
    assert [b["epoch"] for b in ref] == [0] * 9 + [1] * 9 + [2] * 9
    again = list(data.batches(exs, 4, 32, **kw))
    for a, b in zip(ref, again):
        _same(a, b)
    for start in (0, 1, 8, 9, 10, 26, 27, 40):
        got = list(data.batches(exs, 4, 32, start=start, **kw))
        assert len(got) == len(ref[start:])
        for a, b in zip(got, ref[start:]):
            _same(a, b)
    # forever mode continues the same sequence
    it = data.batches(exs, 4, 32, seed=5, epochs=None, start=20)
    for k in range(7):
        _same(next(it), ref[20 + k])
    more = next(it)
    assert more["epoch"] == 3 and more["index"] == 27
    # epochs are reshuffled; another seed gives another order
    first = lambda bs: [tuple(b["input_ids"][:, 0]) for b in bs]  # noqa: E731
    assert first(ref[:9]) != first(ref[9:18])
    assert first(ref[:9]) != first(list(data.batches(exs, 4, 32, seed=6)))


def test_batches_bucketing_reduces_padding():
    exs = _examples(400, max_len=200)
    kw = dict(seed=0)
    pad = lambda bs: sum(int(b["lengths"].max() - b["lengths"].min()) for b in bs)  # noqa: E731
    bucketed = list(data.batches(exs, 8, 256, bucket_factor=16, **kw))
    plain = list(data.batches(exs, 8, 256, bucket_factor=1, **kw))
    assert pad(bucketed) * 4 < pad(plain)
    # the same examples are used either way
    ids = lambda bs: sorted(int(x) for b in bs for x in b["input_ids"][:, 0])  # noqa: E731
    assert ids(bucketed) == ids(plain)


def test_batches_bucket_lengths():
    exs = _examples(64, max_len=200)
    bs = list(data.batches(exs, 8, 256, bucket_lengths=(64, 128, 256)))
    for b in bs:
        T = b["input_ids"].shape[1]
        assert T in (64, 128, 256)
        assert b["lengths"].max() <= T
        assert T == min(x for x in (64, 128, 256) if x >= b["lengths"].max())
    with pytest.raises(ValueError):
        list(data.batches(exs, 8, 100, bucket_lengths=(64, 128)))


def test_batch_plan_no_shuffle():
    plan = data.batch_plan([5, 3, 9, 1, 2], 2, shuffle=False, drop_last=False)
    assert [p.tolist() for p in plan] == [[0, 1], [2, 3], [4]]


def test_batches_truncate_to_seq_len():
    exs = _examples(8, max_len=100)
    for b in data.batches(exs, 4, 16):
        assert b["input_ids"].shape == (4, 16) and b["lengths"].max() <= 16


# ---------------------------------------------------------------------------
# Tokenized cache
# ---------------------------------------------------------------------------


def test_save_load_examples_roundtrip(tmp_path):
    exs = _examples(9)
    p = tmp_path / "c" / "cache.npz"
    data.save_examples(p, exs, {"source": "unit"})
    got, meta = data.load_examples(p)
    assert meta["source"] == "unit" and meta["format"] == data.CACHE_FORMAT
    assert len(got) == 9
    for a, b in zip(exs, got):
        assert a["id"] == b["id"]
        assert b["input_ids"].dtype == np.int32 and b["loss_mask"].dtype == np.int32
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    data.save_examples(p, [], {})
    assert data.load_examples(p)[0] == []


def test_load_or_build_cache(tmp_path, tokenizer):
    convs = [{"id": "a_0", "messages": CHAT}, {"id": "b_0", "messages": CHAT[1:5]}]
    calls = []

    def source():
        calls.append(1)
        return iter(convs)

    p = tmp_path / "tok.npz"
    first = data.load_or_build_cache(p, source, tokenizer, 128, meta={"split": "train"})
    assert len(calls) == 1 and [e["id"] for e in first] == ["a_0", "b_0"]
    second = data.load_or_build_cache(p, source, tokenizer, 128, meta={"split": "train"})
    assert len(calls) == 1  # reused, nothing read
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["loss_mask"], b["loss_mask"])
    ref = data.render(convs[0], tokenizer, 128)
    np.testing.assert_array_equal(second[0]["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(second[0]["loss_mask"], ref["loss_mask"])
    data.load_or_build_cache(p, source, tokenizer, 64, meta={"split": "train"})
    assert len(calls) == 2  # max_length changed -> rebuilt
    data.load_or_build_cache(p, source, tokenizer, 64, meta={"split": "heldout"})
    assert len(calls) == 3  # caller meta changed -> rebuilt
    # The same vocabulary split otherwise (GPT-2's regex alone, digits not cut off first: how
    # transformers' GGUF loader built SmolLM2's tokenizer) tokenizes otherwise -> rebuilt.
    from tokenizers import pre_tokenizers

    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert other.get_vocab() == tokenizer.get_vocab()
    data.load_or_build_cache(p, source, other, 64, meta={"split": "heldout"})
    assert len(calls) == 4
