"""Completions that each try one harm, for the sandbox's tests: as programs for
sandbox.run, as a code task's tests (code_tests runs them), and as the code of a python
tool call in a multi-turn episode. `{run_dir}` is the run's folder, `{port}` a listener
on 127.0.0.1 the test holds, `{secret}` the name of an environment variable it planted."""

import json

import tools

HARMS = {
    "rmtree_run_dir": "import shutil\nshutil.rmtree({run_dir!r})\nprint('deleted')",
    "rmtree_home": "import os, shutil\nshutil.rmtree(os.path.expanduser('~'))\nprint('deleted')",
    "read_ssh": "import os\nprint(open(os.path.expanduser('~/.ssh/id_rsa')).read())",
    "read_secret": (
        "import os, glob\nprint(os.environ[{secret!r}])\n"
        "for path in glob.glob('/proc/*/environ'):\n    print(open(path, 'rb').read())"
    ),
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "memory_bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(256 << 20))",
    "endless_loop": "while True:\n    pass",
    "fill_disk": "i = 0\nwhile True:\n    open(f'fill{{i}}', 'wb').write(b'x' * (8 << 20))\n    i += 1",
    "forge_fds": (
        "import os, pickle\nforged = b'\"ready\"\\n' + pickle.dumps((1.0, None, 0.0))\n"
        "hit = 0\nfor fd in range(1024):\n    try:\n        os.write(fd, forged)\n        hit += 1\n"
        "    except OSError:\n        pass\nraise SystemExit(f'wrote to {{hit}} descriptors')"
    ),
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'escaped')",
    "outlive": (
        "import subprocess\nsubprocess.Popen(['sleep', '3617'], start_new_session=True)\n"
        "subprocess.Popen(['sh', '-c', 'sleep 3617'], preexec_fn=__import__('os').setsid)"
    ),
}


def programs(run_dir, port, secret):
    return {name: code.format(run_dir=str(run_dir), port=port, secret=secret) for name, code in HARMS.items()}


def write_task(path, run_dir, port, secret, copies=2):
    """A code task's rows, one harm each (`tests`: the harm, so code_tests runs it), `copies` times."""
    with open(path, "w") as f:
        for _ in range(copies):
            for name, code in programs(run_dir, port, secret).items():
                f.write(
                    json.dumps({"question": f"Write {name}.", "answer": "#### 0", "harm": name, "tests": [code]}) + "\n"
                )
    return path


def through_python_tool(record, turns):
    """An environment that calls the python tool with the row's harm after the model's
    first answer (the tiny model writes no tool calls of its own), then ends."""
    if sum(m["role"] == "assistant" for m in turns) > 1:
        return None
    call = json.dumps({"name": "python", "arguments": {"code": record["tests"][0]}})
    return {"role": "tool", "content": tools.call([tools.python], call)}
