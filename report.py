"""The run report: RUN_DIR/report.html, one self-contained page (no network, no script
library: it opens from a laptop's disk or a cluster's shared folder) of what a run wrote:

  curves    metrics.jsonl's, one inline SVG each, beside the run's config and machine (run.json)
  rollouts  samples.jsonl's groups (whole, side by side) and evals/step_<k>.jsonl's samples,
            each completion a span per token, coloured by its advantage, by |sampler -
            learner| log-prob, or by its mask (the environment's tokens, the mismatch
            correction's, the untrained); hovering a token shows its id, text and numbers

    python report.py RUN_DIR        (any run: finished, stopped, or still writing)

The run writes it itself at its end and on eval steps (job.py). Plain stdlib: the token
texts come from the run's tokenizer where transformers is there, else the ids are shown."""

import glob
import html
import json
import math
import os
import platform
import subprocess
import sys

# (title, keys) of each chart, in reading order; a key a run did not log is left out.
CURVES = [
    ("reward", ["reward_mean", "METRICS", "reward_*"]),  # METRICS: the tasks' (tasks/: accuracy, format)
    ("held-out", ["eval_accuracy", "eval_reward", "eval_pass_at_*", "eval_maj_at_*"]),
    ("loss", ["loss"]),
    ("KL", ["kl", "teacher_kl"]),
    ("entropy", ["entropy"]),
    ("grad norm", ["grad_norm"]),
    ("mismatch |sampler - learner| log-prob", ["mismatch_mean", "mismatch_max"]),
    ("clip and masked fractions", ["clip_low_frac", "clip_high_frac", "mismatch_masked_*", "truncated_frac"]),
    ("seconds per phase", ["sync_s", "sample_s", "reward_s", "env_s", "wait_s", "train_s", "eval_s", "step_s"]),
    ("tokens per second", ["sampled_tokens_per_s", "trained_tokens_per_s"]),
]
NOT_PARTS = {"reward_mean", "reward_std", "reward_s", "reward_errors", "reward_timeouts"}  # reward_* that are no reward
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def machine():
    """The processor and GPUs this process sees: what run.json records of the run's machine."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    return {"processor": cpu, "cpus": os.cpu_count(), "gpus": listed.splitlines(), "host": platform.node()}


def write_run_info(cfg, model_path):
    """RUN_DIR/run.json, at the start: the config, the model folder (the tokenizer the
    report decodes with) and the machine."""
    import dataclasses

    with open(os.path.join(cfg.out_dir, "run.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "model_path": model_path, "machine": machine()}, f, indent=1)


def read_jsonl(path):
    """The rows of a JSON-lines file; a line that does not parse (the last one of a run
    still writing it) is skipped."""
    rows = []
    for line in open(path) if os.path.exists(path) else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def token_texts(model_path, ids):
    """{id: its text} for the ids, decoded one by one with the run's tokenizer, or {} where
    there is none to load (the report then shows ids)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception:  # no transformers, no folder any more: the ids stand in
        return {}
    return {i: tokenizer.decode([i]) for i in sorted(ids)}


def expand(keys, rows):
    """The keys present in rows, a trailing * matching every logged key of that prefix."""
    logged = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))})
    out = []
    for k in keys:
        if k == "METRICS":  # the rewards the tasks log under their own names
            import tasks

            out += [m for m in tasks.metric_names() if m in logged]
        elif k.endswith("*"):
            out += [m for m in logged if m.startswith(k[:-1]) and m not in NOT_PARTS]
        elif k in logged:
            out.append(k)
    return list(dict.fromkeys(out))


def svg_curve(title, keys, rows, width=420, height=190):
    """One chart: a polyline per key over the steps, with its range and a legend."""
    series = {
        k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])] for k in keys
    }
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
    sx, sy = (x1 - x0) or 1, (y1 - y0) or 1
    left, top, w, h = 48, 8, width - 56, height - 30

    def xy(p):
        return f"{left + (p[0] - x0) / sx * w:.1f},{top + h - (p[1] - y0) / sy * h:.1f}"

    lines = [
        f'<polyline data-key="{k}" fill="none" stroke="{COLOURS[j % len(COLOURS)]}" stroke-width="1.5" points="{" ".join(map(xy, s))}"/>'
        for j, (k, s) in enumerate(series.items())
        if s
    ]
    frame = f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>'
    labels = f'<text x="2" y="{top + 10}">{y1:.4g}</text><text x="2" y="{top + h}">{y0:.4g}</text>'
    labels += (
        f'<text x="{left}" y="{height - 6}">step {x0}</text><text x="{left + w - 50}" y="{height - 6}">{x1}</text>'
    )
    legend = " ".join(
        f'<span style="color:{COLOURS[j % len(COLOURS)]}">&#9632; {k}</span>' for j, k in enumerate(series) if series[k]
    )
    return (
        f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption><svg class="curve" data-title="{html.escape(title)}" '
        f'viewBox="0 0 {width} {height}">{frame}{"".join(lines)}{labels}</svg><div class="legend">{legend}</div></figure>'
    )


def curves_section(rows):
    """Every chart of CURVES that the run has data for, with the derived throughputs."""
    for r in rows:
        if r.get("sample_s"):
            r["sampled_tokens_per_s"] = r["tokens_sampled"] / r["sample_s"]
        if r.get("train_s"):
            r["trained_tokens_per_s"] = r["tokens_trained"] / r["train_s"]
    charts = [svg_curve(title, expand(keys, rows), rows) for title, keys in CURVES]
    return "".join(charts) or "<p>no metrics yet</p>"


def colours(advantage, delta):
    """The token's two background colours: advantage (green up, red down, full at |A| 2)
    and the mismatch (white at 1e-6 or less, full red at 1 nat, on a log scale)."""
    a = min(1.0, abs(advantage) / 2)
    adv = f"rgba(44,160,44,{a:.2f})" if advantage > 0 else f"rgba(214,39,40,{a:.2f})"
    m = 0.0 if delta is None else min(1.0, max(0.0, (math.log10(max(delta, 1e-12)) + 6) / 6))
    return adv, f"rgba(214,39,40,{m:.2f})"


def masked_by_correction(cfg, sampler, learner):
    """Whether --mismatch mask drops this token (grpo.mismatch_weight's rule, per token)."""
    if cfg.get("mismatch") != "mask" or learner is None:
        return False
    ratio = math.exp(min(50.0, learner - sampler))
    return not cfg["mismatch_low"] <= ratio <= cfg["mismatch_high"]


def token_spans(sample, texts, cfg):
    """[(is_model, span html)] for each completion token: its colours as CSS variables, its
    numbers in the hover title."""
    ids = sample.get("token_ids") or []
    mask = sample.get("model_mask") or [1] * len(ids)
    sampler = sample.get("sampler_logprobs") or [None] * len(ids)
    learner = sample.get("learner_logprobs") or [None] * len(ids)
    advantage = sample.get("advantage", 0.0)
    out = []
    for t, m, s, lp in zip(ids, mask, sampler, learner):
        text = texts.get(t, f"[{t}]")
        delta = abs(s - lp) if m and s is not None and lp is not None else None
        adv, mm = colours(advantage if m else 0.0, delta)
        kind = "env" if not m else "untrained" if "learner_logprobs" in sample and lp is None else "model"
        if m and s is not None and masked_by_correction(cfg, s, lp):
            kind = "masked"
        tip = f"id {t} {text!r}"
        if m and s is not None:
            tip += f"\nadvantage {advantage:.3f}\nsampler {s:.6f}"
            tip += f"\nlearner {lp:.6f}\n|diff| {delta:.2e}" if lp is not None else "\nlearner: not trained"
        style = f"--a:{adv};--m:{mm}"
        out.append((m, f'<span class="t {kind}" style="{style}" title="{html.escape(tip)}">{html.escape(text)}</span>'))
    return out


def completion_html(sample, texts, cfg):
    """The completion's tokens, cut into turns by the mask: each run of the model's or the
    environment's ids labelled with its message's role (sample["turns"] after the prompt)."""
    spans = token_spans(sample, texts, cfg)
    if not spans:  # an eval sample of a run before token ids were kept
        return f'<div class="turn">{html.escape(sample.get("completion", ""))}</div>'
    turns = sample.get("turns") or []
    first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
    messages, runs = turns[first:], []
    for is_model, span in spans:
        if not runs or runs[-1][0] != is_model:
            runs.append((is_model, []))
        runs[-1][1].append(span)
    out = []
    for k, (is_model, run) in enumerate(runs):
        message = messages[k] if k < len(messages) else {"role": "assistant" if is_model else "env", "content": ""}
        kind = "tool" if message["role"] == "tool" else "call" if "<tool_call>" in message.get("content", "") else ""
        out.append(f'<div class="turn {kind}"><b>{message["role"]}</b> {"".join(run)}</div>')
    return "".join(out)


def card(sample, source, texts, cfg):
    """One sample: its rewards and advantage over its completion."""
    numbers = {k: v for k, v in sample.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    numbers = {k: v for k, v in numbers.items() if k not in ("step", "group", "index", "sample")}
    head = ", ".join(f"{k} {v:.3g}" for k, v in numbers.items())
    flags = " truncated" if sample.get("truncated") else ""
    return (
        f'<div class="sample" data-step="{sample["step"]}" data-reward="{sample.get("reward", 0)}" data-source="{source}">'
        f'<div class="head">{html.escape(head)}{flags}</div>{completion_html(sample, texts, cfg)}</div>'
    )


def groups(samples, evals):
    """(source, step, prompt, [samples]) blocks: a training group's G completions, or an
    eval prompt's samples, side by side."""
    blocks = {}
    for j, s in enumerate(samples):
        blocks.setdefault(("train", s["step"], s.get("group", f"row{j}")), []).append(s)
    for step, rows in evals:
        for s in rows:
            blocks.setdefault(("eval", step, s["index"]), []).append({**s, "step": step})
    return [(src, step, members) for (src, step, _), members in blocks.items()]


def prompt_of(sample, texts):
    if "prompt" in sample:
        return sample["prompt"]
    return "".join(texts.get(t, f"[{t}]") for t in sample.get("prompt_ids", []))


def rollouts_section(samples, evals, texts, cfg):
    out = []
    for source, step, members in groups(samples, evals):
        prompt = prompt_of(members[0], texts)
        rewards = [m.get("reward", 0.0) for m in members]
        why = "uniform: every reward equal, advantage 0" if len(set(rewards)) == 1 else "rewards differ"
        if all("learner_logprobs" in m and m["learner_logprobs"] is None for m in members):
            why += "; not trained (dropped)"  # --drop-uniform-groups, or --overlong mask
        out.append(
            f'<section class="group" data-prompt="{html.escape(prompt.lower())}"><h3>{source} step {step}, '
            f"{len(members)} completions, {why}</h3><details><summary>prompt</summary><pre>{html.escape(prompt)}</pre>"
            f'</details><div class="row">{"".join(card(m, source, texts, cfg) for m in members)}</div></section>'
        )
    return "".join(out) or "<p>no samples yet</p>"


STYLE = """body{font:14px system-ui,sans-serif;margin:8px;max-width:1400px}
.charts,.row{display:flex;flex-wrap:wrap;gap:8px}.chart{margin:0;flex:1 1 300px;max-width:440px}
svg.curve{width:100%;height:auto}svg text{font-size:10px;fill:#555}.legend{font-size:11px}
.sample{flex:1 1 260px;border:1px solid #ddd;padding:4px;min-width:0;overflow-wrap:anywhere}
.head{font-size:11px;color:#444}.turn{margin:2px 0;white-space:pre-wrap;font-family:monospace}
.turn.tool{border-left:4px solid #9467bd}.turn.call{border-left:4px solid #ff7f0e}
.t{border-radius:2px}body.by-adv .t{background:var(--a)}body.by-mm .t{background:var(--m)}
body.by-mask .t.env{background:#aec7e8}body.by-mask .t.masked{background:#999;text-decoration:line-through}
body.by-mask .t.untrained{background:#eee;color:#888}.t.env{font-style:italic}
table{font-size:12px}td{padding:0 6px;vertical-align:top}.hidden{display:none}"""

SCRIPT = """function apply(){
 const step=document.getElementById('step').value, lo=parseFloat(document.getElementById('rmin').value),
  hi=parseFloat(document.getElementById('rmax').value), q=document.getElementById('q').value.toLowerCase();
 document.body.className='by-'+document.getElementById('colour').value;
 let shown=0;
 for(const g of document.querySelectorAll('.group')){
  let any=false;
  for(const s of g.querySelectorAll('.sample')){
   const r=parseFloat(s.dataset.reward);
   const ok=(!step||s.dataset.step===step)&&!(r<lo)&&!(r>hi)&&(!q||g.dataset.prompt.includes(q));
   s.classList.toggle('hidden',!ok); any=any||ok; shown+=ok;}
  g.classList.toggle('hidden',!any);}
 document.getElementById('shown').textContent=shown;}
for(const e of document.querySelectorAll('.controls input,.controls select'))e.addEventListener('input',apply);
// report.html#colour=mask&step=3 opens on that view: a link to share, and the test's way in
for(const [k,v] of new URLSearchParams(location.hash.slice(1)))if(document.getElementById(k))document.getElementById(k).value=v;
apply();"""


def config_table(info):
    cfg, where = info.get("config", {}), info.get("machine", {})
    rows = {**{f"machine {k}": v for k, v in where.items()}, "model folder": info.get("model_path"), **cfg}
    cells = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows.items())
    return f"<details><summary>config and machine</summary><table>{cells}</table></details>"


def write_report(run_dir):
    """RUN_DIR/report.html from what the run has written so far; returns its path."""
    info = (
        json.load(open(os.path.join(run_dir, "run.json"))) if os.path.exists(os.path.join(run_dir, "run.json")) else {}
    )
    cfg = info.get("config", {})
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    samples = read_jsonl(os.path.join(run_dir, "samples.jsonl"))
    files = glob.glob(os.path.join(run_dir, "evals", "step_*.jsonl"))
    evals = sorted((int(os.path.basename(f)[5:-6]), read_jsonl(f)) for f in files)
    ids = {
        t
        for s in samples + [e for _, rows in evals for e in rows]
        for t in s.get("token_ids", []) + s.get("prompt_ids", [])
    }
    texts = token_texts(info.get("model_path") or os.path.join(run_dir, "final"), ids) if ids else {}
    steps = sorted({s["step"] for s in samples} | {step for step, _ in evals})
    options = "".join(f'<option value="{s}">{s}</option>' for s in steps)
    total = len(samples) + sum(len(rows) for _, rows in evals)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>run report: {html.escape(run_dir)}</title>
<style>{STYLE}</style></head><body class="by-adv"><h1>{html.escape(os.path.abspath(run_dir))}</h1>
<p>{cfg.get("model", "?")} on {cfg.get("dataset", "?")}, {len(metrics)} metrics rows; {info.get("machine", {}).get("processor", "machine unknown")}
{", ".join(info.get("machine", {}).get("gpus", []))}</p>{config_table(info)}
<h2>curves</h2><div class="charts">{curves_section(metrics)}</div>
<h2>rollouts: <span id="shown">{total}</span> of <span id="total">{total}</span> samples</h2>
<div class="controls">step <select id="step"><option value="">all</option>{options}</select>
reward <input id="rmin" type="number" step="any" placeholder="min" size="4"> to <input id="rmax" type="number" step="any" placeholder="max" size="4">
prompt <input id="q" placeholder="contains"> colour by <select id="colour"><option value="adv">advantage</option>
<option value="mm">|sampler - learner| log-prob</option><option value="mask">mask: environment, masked, untrained</option></select></div>
{rollouts_section(samples, evals, texts, cfg)}<script>{SCRIPT}</script></body></html>"""
    path = os.path.join(run_dir, "report.html")
    with open(path + ".tmp", "w") as f:
        f.write(page)
    os.replace(path + ".tmp", path)  # a reader never opens half a page
    return path


def write_report_safely(run_dir, warn):
    """The run's call: a report that fails is a warning, never the run's failure."""
    try:
        return write_report(run_dir)
    except Exception as e:
        warn(f"report.html not written: {type(e).__name__}: {e} (python report.py {run_dir} retries)")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python report.py RUN_DIR")
    print(write_report(sys.argv[1]))
