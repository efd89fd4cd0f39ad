"""train/datastore.py: the committed gzip JSONL, merged from regenerate's working file."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from eagle_jax.train import datastore
from eagle_jax.train.datastore import read_conversations
from eagle_jax.train.regenerate import regenerate


def _rec(cid, answer="an answer", turns=1):
    return {"id": cid, "messages": [{"role": "user", "content": f"question {cid}"},
                                    {"role": "assistant", "content": answer}],
            "regenerated_turns": turns, "truncated": False}


def _write(path, recs, tail=""):
    with open(path, "a", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.write(tail)


def _ids(path):
    return [r["id"] for r in datastore.iter_jsonl(path)]


def test_merge_round_trip_appends_new_ids_and_keeps_committed(tmp_path):
    work, gz = tmp_path / "work.jsonl", tmp_path / "data" / "regen.jsonl.gz"
    _write(work, [_rec("a_0"), _rec("b_0", "réponse ünïcode"), _rec("c_0", turns=0)],
           tail='{"id": "d_0", "mess')  # a job paused or killed mid-write
    res = datastore.merge(work, gz, info={"target": "t"}, count_tokens=lambda texts: 10 * len(texts))
    assert res["added"] == 3 and res["torn_tails_ignored"] == 1
    assert _ids(gz) == ["a_0", "b_0", "c_0"]
    first_bytes = gz.read_bytes()

    # the job goes on (its own resume cuts the torn line); a second working file repeats ids,
    # one of them with other content: the committed record wins, nothing is duplicated
    work.write_text(work.read_text()[: work.read_text().index('{"id": "d_0"')])
    _write(work, [_rec("d_0"), _rec("e_0")])
    other = tmp_path / "other.jsonl"
    _write(other, [_rec("a_0", "CHANGED"), _rec("f_0"), _rec("e_0")])
    res = datastore.merge([work, other], gz, count_tokens=lambda texts: 10 * len(texts))
    assert res["committed_before"] == 3 and res["added"] == 3 and res["already_committed"] == 5
    assert _ids(gz) == ["a_0", "b_0", "c_0", "d_0", "e_0", "f_0"]
    assert gz.read_bytes().startswith(first_bytes)  # appended as a new gzip member
    recs = {r["id"]: r for r in datastore.iter_jsonl(gz)}
    assert recs["a_0"]["messages"][1]["content"] == "an answer"
    assert recs["b_0"]["messages"][1]["content"] == "réponse ünïcode"

    # nothing new: the file is left byte for byte
    before = gz.read_bytes()
    assert datastore.merge(work, gz)["added"] == 0 and gz.read_bytes() == before

    prov = json.loads(datastore.provenance_path(gz).read_text())
    assert datastore.provenance_path(gz).name == "regen.provenance.json"
    assert prov["target"] == "t" and prov["counts"]["conversations"] == 6
    assert prov["counts"]["regenerated"] == 5 and prov["counts"]["copied_unchanged"] == 1
    assert prov["counts"]["answer_tokens"] == 50  # c_0 copied: no regenerated answer
    assert [m["added"] for m in prov["merges"]] == [3, 3]
    assert prov["ids"] == {"first": "a_0", "last": "f_0"}
    assert not list(tmp_path.glob("data/*.tmp"))


def test_merge_refuses_a_damaged_committed_file(tmp_path):
    work, gz = tmp_path / "w.jsonl", tmp_path / "c.jsonl.gz"
    _write(work, [_rec(f"x{i}_0", "text " * 50) for i in range(20)])
    datastore.merge(work, gz)
    gz.write_bytes(gz.read_bytes()[:-30])
    with pytest.raises(ValueError, match="damaged"):
        datastore.merge(work, gz)
    with pytest.raises(ValueError, match=r"\.jsonl\.gz"):
        datastore.merge(work, tmp_path / "plain.jsonl")


def test_readers_take_gzip_and_ignore_only_a_torn_tail(tmp_path):
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:  # two members, as merges write them
        f.write(json.dumps(_rec("a_0")) + "\n")
    with gzip.open(gz, "at", encoding="utf-8") as f:
        f.write(json.dumps({"id": "b_0", "conversations": [{"from": "human", "value": "q"},
                                                          {"from": "gpt", "value": "r"}]}) + "\n\n")
        f.write('{"id": "c_0"')  # torn: no newline
    got = read_conversations(str(gz), None)
    assert [c["id"] for c in got] == ["a_0", "b_0"]
    assert got[1]["messages"][1] == {"role": "assistant", "content": "r"}
    assert datastore.read_ids(f"{gz},{tmp_path / 'missing.jsonl'}") == {"a_0", "b_0"}

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_rec("a_0")) + "\n{not json\n" + json.dumps(_rec("b_0")) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_conversations(str(bad), None)


def test_regenerate_skips_committed_ids_and_refuses_gz_output(tmp_path):
    gz = tmp_path / "c.jsonl.gz"
    work = tmp_path / "w.jsonl"
    _write(work, [_rec("a_0"), _rec("b_0")])
    datastore.merge(work, gz)
    gen = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ x }}"),
                          generate=lambda *a, **k: pytest.fail("nothing should be generated"))
    convs = [_rec("a_0", "ORIGINAL"), _rec("b_0", "ORIGINAL")]
    out = tmp_path / "fresh.jsonl"
    stats = regenerate(convs, gen, out, progress=False, skip_ids=datastore.read_ids(gz))
    assert stats["skipped_already_done"] == 2 and stats["conversations"] == 0
    assert out.read_text() == ""
    with pytest.raises(ValueError, match="working file"):
        regenerate(convs, gen, gz, progress=False)


def test_cli_merge_and_stats(tmp_path, capsys):
    work, gz = tmp_path / "w.jsonl", tmp_path / "c.jsonl.gz"
    _write(work, [_rec("a_0"), _rec("b_0")])
    assert datastore.main(["merge", str(work), str(gz), "--no-tokens", "--info", '{"dtype": "float32"}']) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 2
    assert datastore.main(["merge", str(work), str(gz), "--no-tokens", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["added"] == 0
    assert datastore.main(["stats", str(gz)]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["conversations"] == 2 and st["duplicate_ids"] == 0 and not st["torn_tail"]
    assert json.loads((tmp_path / "c.provenance.json").read_text())["dtype"] == "float32"


def test_merge_info_makes_dtype_per_merge(tmp_path, capsys):
    """--merge-info lands in its merge's entry; a second dtype turns the top-level dtype into 'mixed'."""
    work, gz = tmp_path / "w.jsonl", tmp_path / "c.jsonl.gz"
    prov_path = tmp_path / "c.provenance.json"
    _write(work, [_rec("a_0"), _rec("b_0")])
    info = '{"dtype": "float32", "flags": {"dtype": "float32", "batch_size": 16}}'
    assert datastore.main(["merge", str(work), str(gz), "--no-tokens", "--info", info]) == 0
    legacy = json.loads(prov_path.read_text())
    legacy["merges"][0].pop("dtype")  # as written before per-merge dtypes existed
    legacy.pop("dtypes")
    prov_path.write_text(json.dumps(legacy))
    _write(work, [_rec("c_0"), _rec("d_0"), _rec("e_0")])
    cmd = "eagle-jax regenerate --dtype bfloat16"
    assert datastore.main(["merge", str(work), str(gz), "--no-tokens", "--merge-info",
                           json.dumps({"dtype": "bfloat16", "command": cmd})]) == 0
    prov = json.loads(prov_path.read_text())
    # the reference: what each merge added, written out by hand
    assert [(m["added"], m["dtype"]) for m in prov["merges"]] == [(2, "float32"), (3, "bfloat16")]
    assert prov["merges"][1]["command"] == cmd and "command" not in prov["merges"][0]
    assert prov["dtype"] == prov["flags"]["dtype"] == datastore.MIXED
    assert prov["dtypes"] == {"float32": 2, "bfloat16": 3}
    assert prov["flags"]["batch_size"] == 16 and prov["counts"]["conversations"] == 5
    capsys.readouterr()
    with pytest.raises(SystemExit):
        datastore.main(["merge", str(work), str(gz), "--no-tokens", "--merge-info", "[1]"])
    assert "--merge-info must be a JSON object" in capsys.readouterr().err
