"""Which of the synthetic task's 48 facts a tiny-model checkpoint gets right, and how
sure it is: for each (a, op, b), the distribution of the result digit after the copied
`a op b =` scaffold. A run that stalls below the target shows here as facts answered
wrong with probability near 1 (mode collapse: no sample of the right digit is left, so
the group has no signal).

    python benchmarks/tiny_facts.py RUN_DIR/final
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import build_prompts  # noqa: E402
from tasks.synthetic import PAIRS, synthetic_fact  # noqa: E402


def main(path):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    facts = []
    for op, pairs in PAIRS.items():
        for a, b in pairs:
            record = synthetic_fact(a, op, b)
            true = int(record["answer"].rsplit("#### ", 1)[1])
            ids = build_prompts([record], tokenizer, 10**6, "facts", system_prompt=None)[0]["prompt_ids"]
            ids += tokenizer(f"{a}{op}{b}=", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)[digits]  # [10]
            facts.append((f"{a}{op}{b}={true}", int(p.argmax()), float(p[true]), float(p.max())))
    right = sum(name.endswith(f"={pred}") for name, pred, _, _ in facts)
    print(
        f"{path}: {right}/{len(facts)} facts right (greedy); mean p(true digit) {sum(f[2] for f in facts) / len(facts):.2f}"
    )
    print("wrong: fact -> greedy digit (p of the true digit, p of the greedy one)")
    for name, pred, p_true, p_max in facts:
        if not name.endswith(f"={pred}"):
            print(f"  {name} -> {pred} ({p_true:.2f}, {p_max:.2f})")


if __name__ == "__main__":
    main(sys.argv[1])
