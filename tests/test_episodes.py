"""Episodes of several turns (episodes.py): the environment's message is rendered alone
and tokenized once, every turn's ids are the sampler's own, only the model's tokens
learn, and a failing environment ends its episode, counted, never the run."""

import json
import os
import subprocess
import sys
import types

import pytest

from conftest import FAST, ROOT, refusal, rows, torchrun
from episodes import _ids, env_message, message_ids


def test_the_environment_message_is_the_templates_rendering_of_it_alone():
    import tiny

    tokenizer = tiny.build_tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = message_ids(tokenizer, {"role": "user", "content": "Check: 2+3?"}, end)
    # what follows the assistant's <|im_end|>: the newline the template puts between turns,
    # the message in its role's delimiters, and the assistant's header
    want = "\n<|im_start|>user\nCheck: 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == want and ids == tokenizer.encode(want)
    with pytest.raises(ValueError, match="does not end an assistant turn"):
        message_ids(tokenizer, {"role": "user", "content": "x"}, tokenizer.convert_tokens_to_ids("#"))


def test_an_environment_reply_becomes_a_message_or_ends_the_episode():
    fn = types.SimpleNamespace(role="tool")
    assert env_message(fn, None) is None
    assert env_message(fn, "42") == {"role": "tool", "content": "42"}
    assert env_message(object(), "hi") == {"role": "user", "content": "hi"}  # the default role
    assert env_message(fn, {"role": "user", "content": "x", "extra": 1}) == {"role": "user", "content": "x"}
    for bad in (42, {"role": "user"}, ["x"]):
        with pytest.raises(ValueError):
            env_message(fn, bad)


def test_every_turn_is_the_samplers_own_ids_on_a_real_chat_template(smollm2, tmp_path):
    """SmolLM2's byte-level BPE and ChatML template, the real engine, three turns: each
    turn's request is the previous request plus the ids drawn plus the environment's
    message rendered alone; the rollout is those ids, the mask marks exactly the drawn
    ones, their log-probs are the sampler's. Rendering the finished conversation again
    and tokenizing it gives other ids for some episode: what a re-tokenizing trainer
    would train on."""
    from transformers import AutoTokenizer

    out = tmp_path / "episodes.json"
    worker = os.path.join(ROOT, "tests", "plugins", "episodes_worker.py")
    result = subprocess.run([sys.executable, worker, smollm2, str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    run = json.loads(out.read_text())
    prompts, calls, episodes, counts = run["prompts"], run["calls"], run["episodes"], run["counts"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert counts["env_errors"] == counts["env_timeouts"] == 0
    assert len(calls) == 3  # one engine call per turn, for all live episodes
    # Each later call's requests are the live episodes', in episode order.
    drawn = {i: [c] for i, c in enumerate(calls[0])}
    for outs in calls[1:]:
        i = 0
        for out in outs:
            while (e := episodes[i])["prompt_ids"] + e["token_ids"][
                : len(out["prompt_ids"]) - len(e["prompt_ids"])
            ] != out["prompt_ids"]:
                i += 1
            drawn[i].append(out)
            i += 1
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, e in enumerate(episodes):
        ids, mask, logprobs = [], [], []
        for k, out in enumerate(drawn[i]):
            if k:  # the environment's message before answer k, rendered alone: ChatML's delimiters
                message = e["turns"][len(prompts[i // 2]["prompt_messages"]) + 2 * k - 1]
                bridge = tokenizer.encode(
                    f"\n<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n<|im_start|>assistant\n"
                )
                assert ids[-1] == end  # the answer before it ended on its own end-of-turn token
                ids, mask, logprobs = ids + bridge, mask + [0] * len(bridge), logprobs + [0.0] * len(bridge)
                assert out["prompt_ids"] == e["prompt_ids"] + ids  # what the engine was asked to continue
            ids, mask, logprobs = (
                ids + out["token_ids"],
                mask + [1] * len(out["token_ids"]),
                logprobs + out["sampler_logprobs"],
            )
        assert e["token_ids"] == ids and e["model_mask"] == mask and e["sampler_logprobs"] == logprobs
        assert sum(m["role"] == "assistant" for m in e["turns"]) == len(drawn[i])
    # Which episodes end early (a completion cut at max_new_tokens) depends on the processor's
    # bf16 kernels: 4 of 8 ran all three turns on an AMX Xeon, 3 on an AVX512-BF16 EPYC.
    assert sum(len(d) == 3 for d in drawn.values()) >= 3, "several episodes ran their three turns"
    # The conversation rendered again and tokenized: other ids for some episode.
    rerendered = [_ids(tokenizer, e["turns"], False) for e in episodes]
    differ = [
        r[: len(e["prompt_ids"]) + len(e["token_ids"])] != e["prompt_ids"] + e["token_ids"]
        for r, e in zip(rerendered, episodes)
    ]
    print(f"re-rendering gives other ids for {sum(differ)} of {len(episodes)} episodes")
    assert any(differ)


def test_a_run_trains_on_whole_episodes_and_evaluates_them(tiny_model, tmp_path):
    """Two learners, three turns: every step's episodes ran past one turn, the samples
    hold whole transcripts with the mask of the model's ids, the tokens sampled count
    the model's ids only, and the eval ran the same episodes."""
    out = tmp_path / "run"
    args = [*FAST, "--steps", 2, "--env", "tests.plugins.envs:follow_up", "--max-turns", 3, "--max-new-tokens", 120]
    args += ["--samples-every", 1, "--eval-every", 2, "--eval-size", 8, "--out-dir", out]
    result = torchrun(3, "--learners", 2, *args)
    assert result.returncode == 0, result.stdout[-5000:]
    train = [r for r in rows(out) if "loss" in r]
    assert len(train) == 2
    for r in train:
        assert r["turns_mean"] > 1.5 and r["turns_max"] == 3 and r["env_errors"] == r["env_timeouts"] == 0, r
        assert r["tokens_sampled"] < r["completion_len"] * 16  # the environment's ids are not the model's
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert len(s["model_mask"]) == len(s["token_ids"]) and s["turns"][-1]["role"] == "assistant"
        assert s["text"] == s["turns"][-1]["content"]  # rewards score the last answer
    assert any(0 in s["model_mask"] for s in samples)
    evals = [json.loads(line) for line in (out / "evals" / "step_2.jsonl").read_text().splitlines()]
    assert len(evals) == 8 and any(sum(m["role"] == "assistant" for m in e["turns"]) == 3 for e in evals)


def test_a_failing_environment_ends_its_episodes_counted_never_the_run(tiny_model, tmp_path):
    """An environment that raises, hangs past --reward-timeout or returns a number ends
    those episodes, each counted; the others go on; the run finishes."""
    out = tmp_path / "run"
    args = [*FAST, "--steps", 2, "--env", "tests.plugins.envs:flaky", "--max-turns", 3, "--max-new-tokens", 96]
    args += ["--reward-timeout", 1, "--max-reward-errors", 1.0, "--reward-workers", 2, "--out-dir", out]
    result = torchrun(2, "--learners", 1, *args)
    assert result.returncode == 0, result.stdout[-5000:]
    train = [r for r in rows(out) if "loss" in r]
    assert sum(r["env_errors"] for r in train) > 0 and sum(r["env_timeouts"] for r in train) > 0, train
    assert max(r["turns_max"] for r in train) == 2  # the healthy ones asked once more
    assert "environment tests.plugins.envs:flaky failed" in (out / "logs" / "rank_1.log").read_text()


def test_episodes_resume_exactly(tiny_model, tmp_path):
    """On-policy, a run resumed from its step-2 checkpoint samples the same episodes and
    ends on the same weights as the run that went straight through."""
    from safetensors.torch import load_file

    env = ["--env", "tests.plugins.envs:follow_up", "--max-turns", 3, "--max-new-tokens", 120, "--learners", 2]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = torchrun(3, *FAST, *env, "--steps", 4, "--save-every", 2, "--out-dir", straight)
    assert result.returncode == 0, result.stdout[-5000:]
    result = torchrun(
        3, *FAST, *env, "--steps", 4, "--resume", straight / "checkpoints" / "step_2", "--out-dir", resumed
    )
    assert result.returncode == 0, result.stdout[-5000:]
    a, b = [r for r in rows(straight) if "loss" in r], [r for r in rows(resumed) if "loss" in r]
    assert [r["step"] for r in b] == [2, 3]
    assert [(r["reward_mean"], r["turns_mean"], r["tokens_sampled"]) for r in a[2:]] == [
        (r["reward_mean"], r["turns_mean"], r["tokens_sampled"]) for r in b
    ]
    wa, wb = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_episodes_one_step_ahead_with_lora_in_bf16_on_two_samplers(tiny_model, tmp_path):
    out = tmp_path / "run"
    args = ["--env", "tests.plugins.envs:follow_up", "--max-turns", 3, "--max-new-tokens", 120, "--learners", 1]
    args += ["--steps", 3, "--prompts-per-step", 4, "--group-size", 4, "--eval-every", 0, "--max-staleness", 1]
    result = torchrun(3, *args, "--lora-rank", 4, "--dtype", "bfloat16", "--out-dir", out)
    assert result.returncode == 0, result.stdout[-5000:]
    train = [r for r in rows(out) if "loss" in r]
    assert len(train) == 3 and all(r["turns_max"] == 3 and r["samplers"] == 2 for r in train), train
    assert train[-1]["staleness"] == 1


def test_the_episode_flags_resolve_or_refuse_in_one_line(capsys):
    from config import TOOLS_ENV, parse_config, resolve

    def resolved(args):
        cfg = resolve(parse_config([*args.split(), "--out-dir", "/nonexistent/run"]), world_size=2, has_gpu=False)
        return cfg.env, cfg.max_turns

    assert resolved("") == ("", 1)  # one turn, as ever
    assert resolved("--tools calculator --max-turns 4") == (TOOLS_ENV, 4)
    for args, why in [
        ("--env tests.plugins.envs:follow_up", "go together"),
        ("--max-turns 3", "go together"),
        ("--tools calculator", "go together"),
        ("--tools calculator --env tests.plugins.envs:follow_up --max-turns 2", "give --tools or --env"),
        ("--env nowhere:fn --max-turns 2", "cannot load environment 'nowhere:fn'"),
        ("--tools abacus --max-turns 2", "tool 'abacus' is not of the form module:function"),
        ("--max-turns 0", "--max-turns must be at least 1"),
    ]:
        assert why in refusal(capsys, args, world_size=2), args


def test_the_steps_token_count_is_the_models_tokens_only():
    from grpo import Rollout, step_counts

    def rollout(n, model_mask=None):
        return Rollout(
            prompt_ids=[1, 2],
            token_ids=list(range(n)),
            sampler_logprobs=[0.0] * n,
            text="",
            truncated=False,
            model_mask=model_mask,
        )

    batch = [rollout(4, [1, 0, 0, 1]), rollout(3), rollout(5, [1, 1, 0, 0, 0])]
    assert step_counts(batch) == {"num_sequences": 3, "num_tokens": 2 + 3 + 2}


def test_the_real_model_runs_two_turn_episodes_end_to_end(smollm2, tmp_path):
    """launch.sh's loop on SmolLM2 in bf16 (1 learner + 1 sampler, 2 steps): every
    episode asked once more answers twice, the samples keep the template's delimiters
    around the environment's message, and the model's tokens stay within bf16's mismatch."""
    out, data = tmp_path / "run", tmp_path / "yes_no.jsonl"
    # Short questions, which the model answers well inside the budget, so it is asked again.
    questions = [f"Is {a} + {a} = {2 * a}? Reply with one word, yes or no." for a in range(2, 6)]
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in questions))
    flags = ["--model", smollm2, "--dataset", data, "--learners", 1, "--steps", 2]
    flags += ["--prompts-per-step", 2, "--group-size", 2, "--max-new-tokens", 96, "--max-prompt-len", 384]
    flags += ["--env", "tests.plugins.envs:follow_up", "--max-turns", 2, "--dtype", "bfloat16", "--eval-every", 0]
    flags += ["--samples-every", 1, "--max-staleness", 0, "--lr", 1e-5, "--out-dir", out]
    result = torchrun(2, *flags, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:]
    train = [r for r in rows(out) if "loss" in r]
    assert len(train) == 2 and all(r["turns_max"] == 2 and r["mismatch_mean"] < 0.1 for r in train), train
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    two = [s for s in samples if len(s["turns"]) > 3]
    assert two, samples
    for s in two:
        env_ids = [t for t, m in zip(s["token_ids"], s["model_mask"]) if not m]
        assert tokenizer.decode(env_ids) == "\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
