"""report.py: the run report. A real short run's page opened in headless Chromium as a
person would (the DOM after its script ran, and a screenshot); the pieces it is made of
without a model."""

import json
import os
import re
import shutil
import subprocess
import sys
import types
from html.parser import HTMLParser

import pytest

import report
from conftest import FAST, ROOT, rows, torchrun
from metrics import sample_indices

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
ENV_COLOUR = (0xAE, 0xC7, 0xE8)  # report.STYLE's background of an environment's token in the mask view


def browser():
    """A headless Chromium, or a skip that says how to get one (.ci/run installs it)."""
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if not found:
        pytest.skip("no Chromium to open the report in: `apt-get install -y chromium` (Debian), as .ci/run does")
    return found


def chromium(*args, timeout=120):
    # --no-sandbox: CI and containers run as root, where Chromium's sandbox refuses to start.
    cmd = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class Cards(HTMLParser):
    """From a page: each .sample card's token spans as their class lists, in page order
    (and their hover titles), the keys of the curves' polylines and the body's class."""

    def __init__(self, page):
        super().__init__()
        self.cards, self.titles, self.curves, self.body = [], [], [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "body":
            self.body = a.get("class")
        elif tag == "polyline":
            self.curves.append(a["data-key"])
        elif "sample" in classes:
            self.cards.append([])
            self.titles.append([])
        elif tag == "span" and "t" in classes:
            self.cards[-1].append(classes)
            self.titles[-1].append(a["title"])


def jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def episodes_run(tiny_model, tmp_path_factory):
    """Two learners (the logged groups' learner log-probs come from both), three-turn
    episodes with an environment, every step logged, an eval before and after."""
    browser()  # no browser, no run
    out = tmp_path_factory.mktemp("report") / "run"
    args = [*FAST, "--steps", 2, "--env", "tests.plugins.envs:follow_up", "--max-turns", 3, "--max-new-tokens", 64]
    args += ["--samples-every", 1, "--eval-every", 2, "--eval-size", 4, "--out-dir", out]
    result = torchrun(3, "--learners", 2, *args)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "report: " in result.stdout  # the run wrote its own at the end
    return out


def test_the_report_of_a_real_run_opens_in_a_browser(episodes_run, tmp_path):
    """The page as Chromium has it after the script ran (opened on the mask colouring): a
    curve per logged metric, a card per sample of samples.jsonl and evals/, a span per
    completion token, the environment's tokens marked as such; and a screenshot."""
    out = episodes_run
    os.remove(out / "report.html")
    made = subprocess.run([sys.executable, os.path.join(ROOT, "report.py"), out], capture_output=True, text=True)
    assert made.returncode == 0 and (out / "report.html").exists(), made.stderr
    url = f"file://{out / 'report.html'}#colour=mask"
    dom = chromium("--dump-dom", url)
    assert dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr[-3000:]
    page = Cards(dom.stdout)
    assert page.body == "by-mask"  # the script ran and took the link's view

    metrics = rows(out)
    for _, keys in report.CURVES:
        for key in report.expand(keys, metrics):
            assert key in page.curves, key
    assert {"reward_mean", "loss", "entropy", "grad_norm", "mismatch_mean", "eval_accuracy"} <= set(page.curves)

    samples = jsonl(out / "samples.jsonl")
    evals = jsonl(out / "evals" / "step_0.jsonl") + jsonl(out / "evals" / "step_2.jsonl")
    assert len(samples) == 2 * 2 * 4 and len(evals) == 2 * 4  # two groups of 4 a step; 4 prompts an eval
    shown = re.search(r'id="shown">(\d+)<', dom.stdout).group(1)
    assert len(page.cards) == int(shown) == len(samples) + len(evals)
    for card, titles, s in zip(page.cards, page.titles, samples + evals):
        assert len(card) == len(s["token_ids"])
        assert [int(t.split()[1]) for t in titles] == s["token_ids"]  # the hover names each token's id
        assert ["env" in c for c in card] == [m == 0 for m in s["model_mask"]]
    assert any("env" in c for card in page.cards for c in card), "no episode ran a second turn"
    for titles, s in zip(page.titles, samples):
        # the hover's numbers are the logged ones
        assert all(f"sampler {a:.6f}" in t for t, a, m in zip(titles, s["sampler_logprobs"], s["model_mask"]) if m)
        # Every logged completion was trained (no group dropped), its learner log-probs those
        # of its own tokens whichever learner trained it: float32 agrees with the sampler.
        assert s["learner_logprobs"] is not None, s
        model = [(a, b) for a, b, m in zip(s["sampler_logprobs"], s["learner_logprobs"], s["model_mask"]) if m]
        assert max(abs(a - b) for a, b in model) < 1e-3, s

    shot = tmp_path / "report.png"
    taken = chromium(f"--screenshot={shot}", "--window-size=1200,3000", url)
    assert taken.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", taken.stderr[-3000:]
    # What a reader sees: the environment's tokens painted in the mask view's colour.
    from PIL import Image

    colours = {c for _, c in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 24)}
    assert ENV_COLOUR in colours, f"no environment token painted in {shot}"


def test_a_run_still_writing_is_reported_without_its_partial_line(tmp_path):
    """A run cut mid-write (no run.json yet, the last line of each log half written): the
    report has every whole row, and without a tokenizer shows each token by its id."""
    run = tmp_path / "run"
    run.mkdir()
    metric = {"step": 0, "reward_mean": 0.5, "loss": 0.1, "tokens_sampled": 10, "sample_s": 2.0}
    (run / "metrics.jsonl").write_text(json.dumps(metric) + "\n" + '{"step": 1, "rew')
    sample = {"step": 0, "group": 0, "text": "ab", "reward": 1.0, "advantage": 0.5, "prompt_ids": [1, 2]}
    sample.update(token_ids=[7, 8, 9], sampler_logprobs=[-0.1, -0.2, -0.3], learner_logprobs=[-0.1, -0.2, -0.35])
    (run / "samples.jsonl").write_text(json.dumps(sample) + "\n" + json.dumps(sample)[:40])
    page = open(report.write_report(str(run))).read()
    parsed = Cards(page)
    assert parsed.curves.count("reward_mean") == 1 and "sampled_tokens_per_s" in parsed.curves
    assert [len(c) for c in parsed.cards] == [3]
    assert re.findall(r">\[(\d+)\]</span>", page) == ["7", "8", "9"]
    assert not re.search(r"\b(src|href)=|http", page)  # nothing to fetch: it opens offline


def test_the_logged_rollouts_are_whole_groups_spread_over_the_step():
    cfg = types.SimpleNamespace(samples_every=10, group_size=4)
    assert sample_indices(cfg, 20, 16) == [0, 1, 2, 3, 8, 9, 10, 11]  # groups 0 and 2 of 4
    assert sample_indices(cfg, 21, 16) == []
    assert sample_indices(cfg, 0, 4) == [0, 1, 2, 3]  # a step of one group
    assert sample_indices(types.SimpleNamespace(samples_every=0, group_size=4), 0, 16) == []


def test_a_multi_turn_completion_shows_each_turn_with_its_role():
    """The mask cuts the ids into turns: the model's, the tool's result (marked), the model's."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
    turns += [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "done"}]
    sample = {"step": 0, "token_ids": [5, 6, 7, 8, 9], "model_mask": [1, 1, 0, 0, 1], "turns": turns}
    page = report.completion_html(sample, {}, {})
    assert re.findall(r'<div class="turn ?(\w*)"><b>(\w+)</b>', page) == [
        ("call", "assistant"),
        ("tool", "tool"),
        ("", "assistant"),
    ]
    assert page.count('class="t env"') == 2
