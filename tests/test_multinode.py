"""Two nodes on one machine: two launch.sh (torchrun) invocations with NNODES=2 and
NODE_RANK 0/1 on one master address and port form one job, as two real nodes would."""

import json
import os
import subprocess
import sys

from conftest import FAST, ROOT, free_port


def test_two_nodes_form_one_job(tiny_model, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    flags = [*FAST, "--steps", 2, "--prompts-per-step", 3, "--out-dir", out]
    nodes = []
    for node in (0, 1):
        # 2 ranks per node, 1 learner: rank 0 learns; ranks 1 (node 0), 2 and 3 (node 1) sample.
        env = {
            **os.environ,
            "PYTHON": sys.executable,
            "NNODES": "2",
            "NODE_RANK": str(node),
            "NPROC": "2",
            "LEARNERS": "1",
        }
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = ["bash", os.path.join(ROOT, "launch.sh"), *map(str, flags)]
        nodes.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    for node, (p, output) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"node {node}:\n{output[-4000:]}"
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["samplers"] == 3  # samplers of both nodes reported
        assert r["tokens_trained"] > 0 and r["mismatch_max"] < 1e-4  # weights reached node 1's samplers too
