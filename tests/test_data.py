import json
import os

import pytest

import data
from conftest import GSM8K
from rewards import gsm8k_accuracy, gsm8k_format


@pytest.fixture(scope="module")
def tokenizer():
    return data.build_tiny_tokenizer()


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
    train, test = data.synthetic_dataset("train"), data.synthetic_dataset("test")
    assert train == data.synthetic_dataset("train")
    assert train[:50] != test[:50]
    for row in train[:500]:
        gold = data.parse_gsm8k_answer(row["answer"])
        assert gold is not None and gsm8k_accuracy(row["answer"], gold) == 1.0 and gsm8k_format(row["answer"]) == 1.0
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
    assert [r["gold"] for r in kept] == ["1", "6"]
    out = capsys.readouterr().out
    assert "skipped 4 bad rows" in out
    for cause in ["1 missing question or answer field", "1 empty question", "1 answer without", "1 not a JSON object"]:
        assert cause in out


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
        assert [p["gold"] for p in prompts] == ["1", "2", "3", "4", "5"]
        text = tokenizer.decode(prompts[0]["prompt_ids"])
        assert data.SYSTEM_PROMPT in text and "What is 0+1?" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(SystemExit, match="no such file"):
        data.read_rows(str(tmp_path / "missing.jsonl"), "train")
    (tmp_path / "wrong.jsonl").write_text(json.dumps({"prompt": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(SystemExit, match="wrong.jsonl.*'question' is missing"):
        data.load_prompts(str(tmp_path / "wrong.jsonl"), "train", tokenizer, 512)


def test_long_prompts_dropped_and_counted(tokenizer, capsys):
    records = [{"question": "short", "gold": "1"}, {"question": "long " * 200, "gold": "2"}]
    kept = data.build_prompts(records, tokenizer, 200, "src")
    assert [r["gold"] for r in kept] == ["1"]
    assert "dropped 1 prompts longer than 200" in capsys.readouterr().out
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
    shards = [data.shard(batch, r, 4) for r in range(4)]
    assert sum(shards, []) == batch
    group_size = 3
    completions = [p for p in batch for _ in range(group_size)]
    for r in range(2):
        prompts = data.shard(batch, r, 2)
        mine = [p for p in prompts for _ in range(group_size)]
        assert mine == completions[r * 12 : (r + 1) * 12]


def test_real_gsm8k_loads(tokenizer):
    path = os.path.join(GSM8K, "train.jsonl")
    if not os.path.exists(path):
        pytest.skip("the shared GSM8K copy is not here")
    prompts = data.load_prompts(path, "train", tokenizer, 4096)
    assert len(prompts) == 7473
    assert all(p["gold"] is not None for p in prompts)
