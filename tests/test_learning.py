"""It learns: a short GRPO run of the CPU default lifts held-out greedy accuracy far
beyond what chance could; eval-only and the plot work from what a run leaves."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from config import parse_config, resolve
from conftest import FAST, ROOT, rows, torchrun


def test_grpo_improves_accuracy(tiny_model, tmp_path):
    out = tmp_path / "run"
    steps = 150  # the default run's accuracy stays near chance for about 100 steps, then climbs
    # --dtype auto, as the CPU default runs: bf16 where the CPU multiplies in bf16
    # natively, float32 elsewhere. Pinning bf16 would emulate it on a CPU without
    # AVX512-BF16 or AMX: a 10.6 s step instead of 1.4 s, 25 minutes for this test alone.
    args = ["--learners", 2, "--steps", steps, "--eval-every", steps, "--eval-size", 128]
    result = torchrun(3, *args, "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    metrics = rows(out)
    train = [r["accuracy"] for r in metrics if "accuracy" in r]
    first, last = sum(train[:10]) / 10, sum(train[-10:]) / 10
    evals = [r for r in metrics if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, steps]
    before, after = evals[0]["eval_accuracy"], evals[-1]["eval_accuracy"]
    print(
        f"train accuracy {first:.3f} (steps 0-9) -> {last:.3f} (steps {steps - 10}-{steps - 1}); held-out greedy {before:.3f} -> {after:.3f}"
    )
    # The warm-up leaves the model at chance (10 possible answers). Each 10-step window
    # holds 2560 sampled answers, so a chance-level mean has a standard error of 0.006:
    # a gain of 0.08 is over 13 of them. The held-out set is smaller and noisier.
    assert before <= 0.25 and first <= 0.2
    assert last >= first + 0.08
    assert after > before
    assert evals[-1]["eval_format"] >= 0.9
    assert (out / "curves.png").exists()


def test_eval_only_on_a_saved_policy_with_pass_at_k(tiny_model, tmp_path):
    """--eval-only with 4 samples per prompt over 2 samplers: the row's pass@1, pass@k and
    maj@4 are those recomputed here, with the binomials, from evals/step_0.jsonl."""
    out, prompts, n = tmp_path / "eval", 16, 4
    result = torchrun(
        3,
        *("--learners", 1, "--eval-only", "--model", tiny_model, "--dataset", "synthetic"),
        *("--eval-size", prompts, "--eval-samples", n, "--eval-temperature", 1.0, "--out-dir", out),
    )
    assert result.returncode == 0, result.stdout[-5000:]
    (row,) = rows(out)
    assert row["step"] == 0 and row["eval_format"] > 0.5
    assert not (out / "final").exists()  # nothing trained, nothing saved
    samples = [json.loads(line) for line in (out / "evals" / "step_0.jsonl").read_text().splitlines()]
    assert [(s["index"], s["sample"]) for s in samples] == [(p, j) for p in range(prompts) for j in range(n)]
    by_prompt = [samples[p * n : (p + 1) * n] for p in range(prompts)]
    right = [sum(s["accuracy"] == 1.0 for s in group) for group in by_prompt]
    assert row["eval_accuracy"] == pytest.approx(sum(right) / (prompts * n))
    assert row["eval_pass_at_1"] == pytest.approx(sum(right) / (prompts * n))
    for k in (2, 4):
        want = sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in right) / prompts
        assert row[f"eval_pass_at_{k}"] == pytest.approx(want)
    majority = 0
    for group in by_prompt:
        answers = [s["answer"] for s in group if s["answer"] is not None]
        top = max(answers, key=answers.count) if answers else None  # max keeps the first of a tie
        majority += any(s["answer"] == top and s["accuracy"] == 1.0 for s in group if top is not None)
    assert row["eval_maj_at_4"] == pytest.approx(majority / prompts)
    # sampled at temperature 1, the samples of a prompt differ: not one greedy answer 4 times
    assert any(len({s["completion"] for s in group}) > 1 for group in by_prompt)
    assert 0 < row["eval_pass_at_1"] <= row["eval_pass_at_2"] <= row["eval_pass_at_4"]


def test_a_teacher_scores_the_policys_own_tokens(tiny_model, tmp_path, capsys):
    """--teacher: the policy's own start as its teacher gives a teacher_kl of 0 at the first
    step (the same weights score the same tokens) and not after the policy has moved; a
    teacher with another vocabulary is refused in one line before any model loads."""
    out = tmp_path / "run"
    args = [*FAST, "--steps", 3, "--teacher", tiny_model, "--distill-coef", 0.5, "--out-dir", out]
    result = torchrun(2, "--learners", 1, *args)
    assert result.returncode == 0, result.stdout[-5000:]
    kl = [r["teacher_kl"] for r in rows(out) if "teacher_kl" in r]
    assert len(kl) == 3 and abs(kl[0]) < 1e-6 and abs(kl[2]) > 1e-4, kl
    other = tmp_path / "other"  # the same model with two token ids swapped
    shutil.copytree(tiny_model, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    argv = ["--model", tiny_model, "--teacher", str(other), "--out-dir", str(tmp_path / "refused")]
    with pytest.raises(SystemExit):
        resolve(parse_config(argv), world_size=2, has_gpu=False)
    assert capsys.readouterr().err.count("its tokenizer is not the policy's") == 1


def test_plot_from_metrics(tmp_path):
    lines = [
        {
            "step": s,
            "reward_mean": s / 10,
            "accuracy": s / 20,
            "sync_s": 0.1,
            "sample_s": 0.5,
            "reward_s": 0.01,
            "wait_s": 0.5,
            "train_s": 1.0,
        }
        for s in range(5)
    ]
    lines[0]["eval_accuracy"] = 0.1
    lines.append({"step": 5, "eval_accuracy": 0.4, "eval_format": 1.0, "eval_length": 10})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "job.py"), "plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
