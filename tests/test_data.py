import json
import os

import pytest
from task_rewards import write_task

import data
import tiny
from rewards import parse_reward_spec
from tasks.gsm8k import SYSTEM_PROMPT, gsm8k_accuracy, gsm8k_format, parse_gsm8k_answer
from tasks.synthetic import synthetic_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tiny_tokenizer()


def test_tiny_tokenizer_round_trips_and_survives_save(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    text = "Ann has 3 pens.\n#### 3  é€ {\\boxed{1}}"
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert len(ids) == len(text.encode())  # one token per byte
    assert loaded.decode(ids) == text
    prompt = loaded.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_synthetic_task_is_gsm8k_shaped_and_deterministic():
    train, test = synthetic_dataset("train"), synthetic_dataset("test")
    assert train == synthetic_dataset("train")
    assert train[:50] != test[:50]
    for row in train[:500]:
        gold = parse_gsm8k_answer(row["answer"])
        assert gold is not None and gsm8k_accuracy(row["answer"], row) == 1.0 and gsm8k_format(row["answer"]) == 1.0
        a, op, b = row["answer"][0], row["answer"][1], row["answer"][2]
        assert int(gold) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_bad_rows_are_counted_per_cause(capsys):
    rows = [
        {"question": "q1", "answer": "x #### 1"},
        {"question": "q2"},
        {"question": "  ", "answer": "#### 2"},
        {"question": "q4", "answer": "no number"},
        "not a dict",
        {"question": "q6", "answer": "#### 6"},
    ]
    kept = data.clean_rows(rows, "mine")
    assert kept == [rows[0], rows[5]]  # whole rows, every column
    out = capsys.readouterr().err
    assert "skipped 4 bad rows" in out
    causes = [
        "1 missing 'answer' field (reward accuracy)",
        "1 empty or malformed 'question'",
        "1 answer without",
        "1 not a JSON object",
    ]
    assert all(cause in out for cause in causes)
    # the '#### <number>' check is the accuracy reward's: without it, row 4 is usable
    assert data.clean_rows(rows, "mine", parse_reward_spec("format")) == [rows[0], rows[1], rows[3], rows[5]]


def test_no_usable_rows_is_one_clear_error():
    with pytest.raises(SystemExit, match="'answer' is missing"):
        data.clean_rows([{"question": "q"}, {"question": "r"}], "f.jsonl")
    with pytest.raises(SystemExit, match="no usable rows"):
        data.clean_rows([], "f.jsonl")


def test_local_files_every_format(tmp_path, tokenizer):
    import datasets

    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken json\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    for name in ["d.jsonl", "d.json", "d.parquet"]:
        prompts = data.load_prompts(str(tmp_path / name), "train", tokenizer, 512)
        assert [parse_gsm8k_answer(p["answer"]) for p in prompts] == ["1", "2", "3", "4", "5"]
        assert prompts[0]["prompt"] == "What is 0+1?" and prompts[0]["question"] == "What is 0+1?"
        text = tokenizer.decode(prompts[0]["prompt_ids"])
        assert SYSTEM_PROMPT in text and "What is 0+1?" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(SystemExit, match="no such file"):
        data.read_rows(str(tmp_path / "missing.jsonl"), "train")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"prompt": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(SystemExit, match="wrong.jsonl.*'question' is missing"):
        data.load_prompts(str(tmp_path / "wrong.jsonl"), "train", tokenizer, 512)


def test_any_dataset_its_own_columns_and_rows_checked_for_its_rewards(tmp_path, tokenizer, capsys):
    """A task that is not GSM8K: 300 rows with their own prompt and answer columns, and a
    few bad ones. The rows reach the records whole; only what its reward needs is checked."""
    path = write_task(str(tmp_path / "task.jsonl"))
    rows = [json.loads(line) for line in open(path)]
    with open(path, "a") as f:
        f.write(json.dumps({"id": 300, "problem": "Write f.", "entry_point": "f"}) + "\n")  # no tests
        f.write(json.dumps({"id": 301, "problem": " ", "entry_point": "f", "tests": []}) + "\n")
        f.write(json.dumps({"id": 302, "task": "Write f.", "entry_point": "f", "tests": []}) + "\n")
        f.write("[1, 2]\n{broken json\n")
    fns = parse_reward_spec("tests.plugins.task_rewards:passes_tests")
    records = data.load_prompts(path, "train", tokenizer, 512, fns, prompt_field="problem")
    assert [{k: r[k] for k in rows[0]} for r in records] == rows  # every column of every good row
    assert all(r["prompt"] == r["problem"] for r in records)
    text = tokenizer.decode(records[0]["prompt_ids"])
    assert text == f"<|im_start|>user\n{rows[0]['problem']}<|im_end|>\n<|im_start|>assistant\n"  # no GSM8K instruction
    out = capsys.readouterr().err
    assert "skipped 5 bad rows" in out
    causes = [
        "1 missing 'tests' field (reward tests.plugins.task_rewards:passes_tests)",
        "1 empty or malformed 'problem'",
        "1 missing 'problem' field",
        "2 not a JSON object",
    ]
    assert all(cause in out for cause in causes)
    # the same rows under the GSM8K accuracy reward, or with the wrong prompt field: one clear error
    with pytest.raises(SystemExit, match="task.jsonl.*field 'answer' is missing"):
        data.load_prompts(path, "train", tokenizer, 512, parse_reward_spec("accuracy"), prompt_field="problem")
    with pytest.raises(SystemExit, match="field 'question' is missing"):
        data.load_prompts(path, "train", tokenizer, 512, fns)


def test_chat_messages_build_the_prompt(tmp_path, tokenizer, capsys):
    rows = [
        {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}],
            "answer": "#### 5",
        },
        {"messages": [{"role": "user", "content": "Add 1 and 1."}], "question": "ignored", "answer": "#### 2"},
        {"messages": [{"role": "user"}], "answer": "#### 2"},
        {"messages": "not a list", "answer": "#### 2"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    records = data.load_prompts(str(path), "train", tokenizer, 512)
    assert [r["prompt"] for r in records] == ["Add 2 and 3.", "Add 1 and 1."]
    first, second = (tokenizer.decode(r["prompt_ids"]) for r in records)
    assert first.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the row's own system message
    assert SYSTEM_PROMPT not in first
    assert second.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nAdd 1 and 1.")
    assert "2 empty or malformed 'messages'" in capsys.readouterr().err
    # a prompt field may itself hold the messages (TRL's conversational "prompt"), and the field may be renamed
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Hi"}], "answer": "#### 1"}))
    assert data.load_prompts(str(path), "train", tokenizer, 512, prompt_field="prompt")[0]["prompt"] == "Hi"
    path.write_text(json.dumps({"chat": [{"role": "user", "content": "Yo"}], "answer": "#### 1"}))
    assert data.load_prompts(str(path), "train", tokenizer, 512, messages_field="chat")[0]["prompt"] == "Yo"


def test_hub_datasets_by_name(monkeypatch, tmp_path):
    """A name that is no file goes to datasets.load_dataset (no network here: it is faked)."""
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None, **kwargs):
        calls.append((name, config, split))
        if name == "nobody/missing":
            raise FileNotFoundError("Dataset 'nobody/missing' doesn't exist on the Hub")
        return [{"question": "q", "answer": "#### 1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert data.read_rows("someone/math-task", "test") == [{"question": "q", "answer": "#### 1"}]
    data.read_rows("gsm8k", "train")
    assert calls == [("someone/math-task", None, "test"), ("openai/gsm8k", "main", "train")]
    with pytest.raises(SystemExit, match="cannot load 'nobody/missing' \\[train\\]: FileNotFoundError"):
        data.read_rows("nobody/missing", "train")
    (tmp_path / "notes.txt").write_text("x")
    assert data.dataset_error("someone/math-task") is None and data.dataset_error("synthetic") is None
    assert data.dataset_error(str(tmp_path)) is None  # a local dataset folder, for load_dataset
    assert data.dataset_error(str(tmp_path / "d.parquet")) == f"no such file: {tmp_path / 'd.parquet'}"
    assert data.dataset_error("./mine") == "no such file: ./mine"
    assert "is not .jsonl, .json or .parquet" in data.dataset_error(str(tmp_path / "notes.txt"))


def test_long_prompts_dropped_and_counted(tokenizer, capsys):
    records = [{"question": "short", "gold": "1"}, {"question": "long " * 200, "gold": "2"}]
    kept = data.build_prompts(records, tokenizer, 200, "src")
    assert [r["gold"] for r in kept] == ["1"]
    assert "dropped 1 prompts longer than 200" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="every prompt is longer"):
        data.build_prompts(records, tokenizer, 10, "src")


def test_step_order_depends_only_on_seed_and_step():
    n, per = 10, 4
    first = [data.step_indices(n, s, per, seed=3) for s in range(10)]
    assert first == [data.step_indices(n, s, per, seed=3) for s in range(10)]
    assert data.step_indices(n, 7, per, seed=3) == first[7]  # a resumed run sees the same batch
    assert first != [data.step_indices(n, s, per, seed=4) for s in range(10)]
    flat = [i for step in first for i in step]
    epochs = [flat[i : i + n] for i in range(0, 40, n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # each epoch visits every record once
    assert len({tuple(e) for e in epochs}) == 4  # and epochs reshuffle


def test_shards_are_disjoint_and_keep_groups_together():
    batch = list(range(8))
    assert [data.shard(batch, r, 4) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [data.shard(batch, r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a group's completions (3 per prompt, laid out prompt by prompt) never straddle two learners
    completions = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert data.shard(completions, 0, 2) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert data.shard(completions, 1, 4) == [2, 2, 2, 3, 3, 3]


def test_real_gsm8k_loads(tokenizer, gsm8k):
    path = os.path.join(gsm8k, "test.jsonl")
    prompts = data.load_prompts(path, "test", tokenizer, 4096)
    assert len(prompts) == 1319
    assert all(parse_gsm8k_answer(p["answer"]) is not None for p in prompts)
