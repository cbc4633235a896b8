"""Tasks (tasks/): a task file is found by its name for --dataset, --rewards and --tools,
names resolve as tasks/__init__.py says, README's example task is tasks/reverse.py as it
stands and trains through the real loading and scoring, and the metrics name each
reward's part as before (accuracy, format; reward_code_tests, reward_module:fn) without
inventing the parts of rewards a run does not have."""

import json
import os
import re
import sys
import types

import pytest

import data
import tasks
import tiny
from conftest import ROOT
from rewards import parse_reward_spec, score_batch
from tasks.gsm8k import SYSTEM_PROMPT, gsm8k_accuracy, gsm8k_format


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tiny_tokenizer()


def test_the_readme_shows_the_example_task_as_it_is():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme[readme.index("**A task**") :]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == open(os.path.join(ROOT, "tasks", "reverse.py")).read()


def test_a_task_file_is_found_by_name_for_dataset_and_rewards(tokenizer):
    """README's example, by name alone, through what the trainer calls: the flag check, the
    loader (its rows, its reward's columns and instruction) and the scoring, in a worker
    (`python rewards.py reversed`), which must find the task as the trainer does."""
    from tasks import reverse

    assert data.dataset_error("reverse") is None
    fns = parse_reward_spec("reversed")
    assert fns == [("reversed", reverse.reversed_word, 1.0)]
    prompts = data.load_prompts("reverse", "test", tokenizer, 512, fns)
    assert len(prompts) == 50 and all(p["prompt"] == f"Spell {p['word']} backwards." for p in prompts)
    assert prompts[0]["prompt_messages"][0] == {"role": "system", "content": reverse.reversed_word.system_prompt}
    assert [p["word"] for p in prompts] == [r["word"] for r in reverse.rows("test")]  # deterministic
    word = prompts[0]["word"]
    totals, parts, counts = score_batch([word[::-1] + "\n", word], prompts[:2], fns, timeout=30)
    assert parts == [{"reversed": 1.0}, {"reversed": 0.0}] and totals == [1.0, 0.0]
    assert counts["reward_errors"] == counts["reward_timeouts"] == 0


def test_the_tasks_datasets_by_name(tokenizer):
    from tasks import calculator, synthetic

    assert data.read_rows("synthetic", "test") == synthetic.synthetic_dataset("test")
    rows = data.read_rows("calculator", "test")
    assert len(rows) == 256 and rows == calculator.rows("test") and rows[0]["question"].startswith("What is ")
    assert data.dataset_error("code") == "task 'code' has no dataset"  # a task with rewards only
    # synthetic says SYSTEM_PROMPT = None: no system message, whatever its rewards declare
    (first, *_) = data.load_prompts("synthetic", "test", tokenizer, 512)
    assert first["prompt_messages"][0]["role"] == "user"
    (first, *_) = data.load_prompts("calculator", "test", tokenizer, 512)
    assert first["prompt_messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}


def test_names_resolve_qualified_shared_or_refused(tmp_path, monkeypatch):
    """gsm8k.py, synthetic.py and calculator.py all define `accuracy`, as one function:
    the plain name is that function. A task defining another `accuracy` makes the plain
    name ambiguous: refused, naming the qualified forms, which still resolve."""
    from tasks import calculator
    from tools import load_tools

    assert parse_reward_spec("accuracy,format=0.5,gsm8k.accuracy")[::2] == [
        ("accuracy", gsm8k_accuracy, 1.0),
        ("gsm8k.accuracy", gsm8k_accuracy, 1.0),
    ]
    assert parse_reward_spec("format")[0][1] is gsm8k_format
    assert load_tools("calculator") == [calculator.calculator] == load_tools("calculator.calculator")
    for spec, why in [
        ("nonsense", "unknown reward 'nonsense'"),
        ("nowhere.accuracy", "there is no task 'nowhere'"),
        ("gsm8k.nonsense", "task 'gsm8k' defines none by that name"),
    ]:
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_reward_spec(spec)

    (tmp_path / "other.py").write_text('REWARDS = {"accuracy": lambda completion, record: 1.0}\n')
    monkeypatch.setattr(tasks, "__path__", [*tasks.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "tasks.other", raising=False)
    try:
        with pytest.raises(
            ValueError, match=r"'accuracy' is defined differently .*'gsm8k\.accuracy'.*'other\.accuracy'"
        ):
            parse_reward_spec("accuracy")
        assert parse_reward_spec("gsm8k.accuracy")[0][1] is gsm8k_accuracy
        assert parse_reward_spec("other.accuracy")[0][1]("", {}) == 1.0
        assert parse_reward_spec("code_tests")  # the names no other task defines resolve as before
    finally:
        sys.modules.pop("tasks.other", None)


def rollout(reward, parts, n=4):
    return types.SimpleNamespace(
        reward=reward, token_ids=[0] * n, parts=parts, truncated=False, model_tokens=lambda: n, turns=[]
    )


def metrics_row(parts):
    import metrics

    counts = {"reward_errors": 0, "reward_timeouts": 0, "sandbox_errors": 0}
    report = {"reward_counts": counts, "weights_step": 0, "peak_memory_mb": 1.0, "sample_s": 1.0, "reward_s": 1.0}
    sums = {"tokens": 8, "loss": 0.1, "sequences_trained": 2, "groups_uniform": 0, "groups_dropped": 0}
    sums.update(padding=0, positions=8)
    rollouts = [rollout(sum(p.values()), p) for p in parts]
    row = metrics.step_metrics(
        0, rollouts, [report], sums, {}, {"mismatch": 0.0, "peak_memory_mb": 1.0}, 1.0, 1e-3, 0.0, 1.0
    )
    return {**row, "step_s": 2.0}


def test_each_reward_part_keeps_its_key_and_no_other_is_invented():
    import metrics

    row = metrics_row([{"accuracy": 1.0, "format": 1.0}, {"accuracy": 0.0, "format": 1.0}])
    assert (row["accuracy"], row["format"]) == (0.5, 1.0) and not any(k.startswith("reward_acc") for k in row)
    assert metrics.progress(row) == "reward 1.500, acc 0.50, 2.0 s/step"  # the bar as ever (test_console's)

    row = metrics_row([{"code_tests": 0.5}, {"code_tests": 1.0}])
    assert row["reward_code_tests"] == 0.75 and "accuracy" not in row and "format" not in row
    assert metrics.progress(row) == "reward 0.750, code_tests 0.75, 2.0 s/step"

    row = metrics_row([{"tests.plugins.task_rewards:passes_tests": 1.0, "accuracy": 0.0}] * 2)
    assert row["reward_tests.plugins.task_rewards:passes_tests"] == 1.0 and row["accuracy"] == 0.0
    assert metrics.progress(row) == "reward 1.000, acc 0.00, 2.0 s/step"  # a task's metric first

    row = metrics_row([{"reversed": 1.0}, {"reversed": 0.0}])  # README's task: METRICS = ("reversed",)
    assert row["reversed"] == 0.5 and "reward_reversed" not in row
    assert metrics.progress(row) == "reward 0.500, reversed 0.50, 2.0 s/step"


def test_the_report_and_the_plot_chart_the_parts_a_run_logged(tmp_path):
    import metrics
    import report

    rows = [{"step": s, "reward_mean": 0.5, "reward_s": 1.0, "reward_code_tests": 0.5, "reversed": 1.0} for s in (0, 1)]
    assert report.expand(report.CURVES[0][1], rows) == ["reward_mean", "reversed", "reward_code_tests"]
    default = [{"step": 0, "reward_mean": 1.0, "accuracy": 1.0, "format": 1.0, "reward_std": 0.0}]
    assert report.expand(report.CURVES[0][1], default) == ["reward_mean", "accuracy", "format"]
    phases = {k: 1.0 for k in ("sync_s", "sample_s", "reward_s", "wait_s", "train_s")}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**r, **phases}) + "\n" for r in rows))
    path = metrics.plot(str(tmp_path))  # no accuracy logged: no KeyError
    assert path is None or os.path.exists(path)
