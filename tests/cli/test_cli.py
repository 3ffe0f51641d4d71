"""Every command line's parse errors follow the contract of `specjax.cli`: one line on
stderr naming the program, exit code 2, nothing on stdout."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (argv after the interpreter, the program name its errors start with)
COMMANDS = [
    (["decode.py"], "decode.py"),
    (["train.py", "--config", "x.yaml"], "train.py"),
    (["benchmarks/compare.py"], "compare.py"),
    (["benchmarks/context_length.py"], "context_length.py"),
    (["benchmarks/decode_speed.py"], "decode_speed.py"),
    (["benchmarks/draft_vocab.py"], "draft_vocab.py"),
    (["benchmarks/kernels.py"], "kernels.py"),
    (["benchmarks/studies/kvshot/kvshot.py", "train"], "kvshot.py"),
    (["benchmarks/studies/kvshot/kvshot_report.py"], "kvshot_report.py"),
    (["benchmarks/matmul_rows.py"], "matmul_rows.py"),
    (["benchmarks/profile_step.py"], "profile_step.py"),
    (["benchmarks/soak.py"], "soak.py"),
    (["-m", "specjax.regenerate", "--out", "x"], "specjax.regenerate"),
    (["-m", "specjax.prepare", "--target", "t", "--data", "d", "--out", "x"], "specjax.prepare"),
    (["-m", "specjax.drafters.vocab", "x"], "python -m specjax.drafters.vocab"),
    (["-m", "specjax.drafters.convert", "--to", "dflash", "a", "b"],
     "python -m specjax.drafters.convert"),
    (["-m", "specjax.decoding.prompts", "x"], "python -m specjax.decoding.prompts"),
    (["-m", "specjax.plan", "--config", "x"], "python -m specjax.plan"),
    (["-m", "specjax.export", "--config", "x"], "python -m specjax.export"),
    (["-m", "specjax.train.plot", "x", "--out", "y"], "python -m specjax.train.plot"),
    (["-m", "specjax.testing.tiny", "x"], "python -m specjax.testing.tiny"),
]


@pytest.mark.parametrize("argv,prog", COMMANDS, ids=[p for _, p in COMMANDS])
def test_unknown_flag_is_one_line_and_exit_2(argv, prog, tmp_path):
    """An unknown flag beside otherwise complete arguments: argparse's error, not a usage
    dump, and nothing is written (the run starts in an empty directory)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if argv[0] != "-m":
        argv = [os.path.join(ROOT, argv[0]), *argv[1:]]
    proc = subprocess.run([sys.executable, *argv, "--no-such-flag"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"{prog}: error: unrecognized arguments: --no-such-flag "
                           "(see --help)\n"), proc.stderr[-2000:]
    assert proc.stdout == "" and os.listdir(tmp_path) == []
