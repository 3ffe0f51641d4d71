"""Helpers shared by the benchmark scripts (decode_speed.py, compare.py, profile_step.py,
draft_vocab.py, prefill.py).

jax, torch and transformers are imported inside the functions: a benchmark script sets
its environment (JAX_NUM_CPU_DEVICES, HF offline flags) before the first jax import.
"""

from __future__ import annotations

import os
import platform
import statistics


def summary(values: list[float]) -> dict:
    """median, min and max of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_transformers(model_dir):
    """transformers model (torch, f32, eval mode) with EOS disabled."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0  # no EOS to fall back on; silences the pad warning
    return model


def environment(threads: list[int]) -> dict:
    """Versions, backend, devices and core counts of this process."""
    import jax

    env = {"python": platform.python_version(), "jax": jax.__version__,
           "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
           "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
           "torch_threads": threads, "machine": platform.machine(),
           "processor": platform.processor()}
    try:
        import flax
        env["flax"] = flax.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        import torch
        import transformers
        env["torch"] = torch.__version__
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def prompt_ids(path: str, tokenizer, vocab_size: int, n: int, target_dir: str
               ) -> list[list[int]]:
    """The first `n` prompts of the JSONL `path` as token ids, read and checked as
    decode.py reads --prompts (`specjax.read_prompts`: "prompt" text or "input_ids";
    SpecjaxError on bad lines)."""
    from specjax.decoding.prompts import read_prompts

    return [ids for _, ids in read_prompts(tokenizer, vocab_size, path=path,
                                           target=target_dir)[:n]]


def replace_doc_section(doc: str, tag: str, body: str, heading: str = "") -> None:
    """Replaces the text between `<!-- tag -->` and `<!-- /tag -->` in the markdown file
    `doc` with `body` (the section is appended, after `heading` for a new file, where
    it is missing); written atomically."""
    begin, end = f"<!-- {tag} -->", f"<!-- /{tag} -->"
    text = open(doc).read() if os.path.exists(doc) else heading
    block = f"{begin}\n{body}{end}"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc + ".tmp", "w") as f:
        f.write(text)
    os.replace(doc + ".tmp", doc)


def git_rev(root: str) -> str:
    """The short hash of HEAD in the checkout at `root` (the code a benchmark measured),
    with "+dirty" when tracked files under specjax/, decode.py or benchmarks/ (results
    files aside: a benchmark that ran before this one changes them, not the code) differ
    from HEAD (the code measured is then HEAD plus uncommitted changes), or "" outside a
    git checkout."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True,
                              text=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD")
    if rev and git("status", "--porcelain", "--untracked-files=no", "--", "specjax",
                   "decode.py", "benchmarks", ":(exclude)benchmarks/results"):
        rev += "+dirty"
    return rev


def save_results(path: str, res: dict, committed: str, write_doc) -> None:
    """Writes the results record `res` to `path` as JSON (atomically); when `path` is the
    committed results file `committed`, `write_doc(res)` brings the doc's table along."""
    import json

    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    if os.path.abspath(path) == committed:  # the committed figures: the doc follows
        write_doc(res)
