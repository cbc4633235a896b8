"""A task the tiny model cannot do alone, learned with the calculator (issue 30's check).

    python benchmarks/tool_task.py [--steps 160] [--warmup-steps 1000] [job.py flags for both runs]

The task (tasks/calculator.py, its rows written to files): "What is 47 multiplied by 8?",
"What is 96 divided by 8?" (a 2-digit number plus, minus, multiplied by or divided by a
digit; results of up to three digits), scored by GSM8K's accuracy on the last answer. The
tiny model computes single-digit sums; these it cannot. A supervised warm-up (on the model's tokens only) teaches both formats at
chance, as the tiny model's own warm-up teaches the answer format: where the prompt
lists the tools, a call of the calculator on the question's two numbers with an operator
drawn at random, then the tool's result copied as '#### N'; where it does not, '#### N'
with N another problem's result. GRPO must then learn which operator each question
means, or, without the tool, the results. The same warm-up model is trained twice, the
same steps and seeds: with `--tools calculator --max-turns 2`, and without the tool (one
turn). Printed: held-out accuracy at each eval of both runs, and the wall times.

The model's chat template renders the tools as one short system line (its own template,
a copy of the tiny one with a tools clause), so prompts stay as short as the tiny task's.
Its figures, with date and processor: docs/results.md, Learning."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def call(expression):
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'


def tool_warmup(model, tokenizer, steps, seed, batch_size=24, lr=3e-3):
    """Two rows in three with the tools: the call with a random operator, the result
    copied; the third without: another problem's result as the answer."""
    from data import build_prompts
    from episodes import message_ids
    from tasks.calculator import SYSTEM_PROMPT, WORDS, calculator, problem
    from tiny import supervised

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [end]

    def row(rng):
        record = problem(rng)
        if rng.random() < 1 / 3:
            prompt = build_prompts([record], tokenizer, 10**6, "warm-up", SYSTEM_PROMPT)[0]["prompt_ids"]
            answer = ids(problem(rng)["answer"])
            return prompt + answer, [0] * len(prompt) + [1] * len(answer)
        prompt = build_prompts([record], tokenizer, 10**6, "warm-up", SYSTEM_PROMPT, tools=[calculator])[0]
        prompt = prompt["prompt_ids"]  # as the run renders it: GSM8K's instruction, the tools' line
        expression = f"{record['a']}{rng.choice(list(WORDS))}{record['b']}"
        result = calculator(expression)
        first = ids(call(expression))
        bridge = message_ids(tokenizer, {"role": "tool", "content": result}, end)
        second = ids(f"#### {result}")
        learn = [0] * len(prompt) + [1] * len(first) + [0] * len(bridge) + [1] * len(second)
        return prompt + first + bridge + second, learn

    losses = []
    supervised(model, row, steps, seed, batch_size, lr, tokenizer.pad_token_id, losses.append)
    for step in range(0, steps, 100):
        print(
            f"tool warm-up steps {step}-{min(step + 100, steps) - 1}: mean loss {sum(losses[step : step + 100]) / len(losses[step : step + 100]):.3f}"
        )


def build(work, warmup_steps):
    """The tiny model (built as the project builds it), warmed up on the tool's format."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tiny

    base = tiny.tiny_model_dir()
    if not os.path.exists(base):
        tiny.build_tiny_model(base)
    path = os.path.join(work, "tool-tiny")
    shutil.copytree(base, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tool_warmup(model, tokenizer, warmup_steps, seed=0)
    model.save_pretrained(path)
    return path


def run(name, work, model, data, steps, extra):
    out = os.path.join(work, name)
    cmd = ["bash", "launch.sh", "--model", model, "--dataset", data["train"], "--eval-dataset", data["test"]]
    cmd += ["--steps", str(steps), "--eval-every", str(max(1, steps // 6)), "--eval-size", "128", "--out-dir", out]
    # the tiny model's own defaults (config.MODEL_DEFAULTS), which a folder does not get
    cmd += ["--max-new-tokens", "160", "--group-size", "4", "--lr", "1e-3", "--beta", "0.1", "--prompts-per-step", "32"]
    cmd += extra
    start = time.time()
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode:
        print(result.stdout[-4000:])
        sys.exit(f"{name} failed")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    print(f"{name}: {time.time() - start:.0f} s; held-out accuracy " + ", ".join(f"{s}: {a:.3f}" for s, a in evals))
    return evals


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--warmup-steps", type=int, default=1000)
    parser.add_argument("--work", default="")
    parser.add_argument("--warm-model", default="", help="a warmed-up model folder from an earlier run: no warm-up")
    args, grpo_flags = parser.parse_known_args()  # the rest go to both runs
    work = os.path.abspath(args.work or os.path.join(ROOT, "runs", "tool_task"))
    if args.warm_model and os.path.abspath(args.warm_model).startswith(work + os.sep):
        sys.exit(f"--warm-model {args.warm_model} lies in --work {work}, which each run empties: copy it out first")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    from tasks.calculator import rows

    data = {}
    for split in ("train", "test"):  # the calculator task's (tasks/calculator.py), as files
        data[split] = os.path.join(work, f"{split}.jsonl")
        with open(data[split], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(split))
    start = time.time()
    model = args.warm_model or build(work, args.warmup_steps)
    print(f"tool warm-up: {time.time() - start:.0f} s")
    tool = ["--tools", "calculator", "--max-turns", "2"]
    with_tool = run("with_tool", work, model, data, args.steps, [*tool, *grpo_flags])
    without = run("without_tool", work, model, data, args.steps, grpo_flags)
    print(
        f"SUMMARY with the tool {with_tool[0][1]:.3f} -> {with_tool[-1][1]:.3f}; without {without[0][1]:.3f} -> {without[-1][1]:.3f}"
    )


if __name__ == "__main__":
    main()
