"""train.py --distributed with 2 processes on localhost (4 simulated CPU devices each,
gloo collectives, coordinator on 127.0.0.1) against an independent 1-process run on 8
simulated devices (this pytest process, tests/conftest.py): lm and an eagle3 drafter
(objective ttt) train to the same losses, validation and export; the checkpoint both
processes write restores in both; SIGTERM to one of them checkpoints and stops both.

Runs use configs/test_tiny.yaml (D 32, L 2, V 320) and configs/test_tiny_drafter.yaml
(G 3, against a random tiny target D 32, L 4, V 320), B 8, T 16, on a token stream of a
few standard-library files under a 300-token BPE. Every subprocess is bounded by
TIMEOUT: a hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import train as train_cli
from specjax.train import load_config, train
from specjax.train.checkpointing import Checkpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny.yaml")
TINY_DRAFTER = os.path.join(ROOT, "configs", "test_tiny_drafter.yaml")
TIMEOUT = 300  # seconds for one launch of both processes (start, compile, train, exit)
# Each launch starts and compiles in 2 processes on the same cores: 25-40 s for lm and
# 60-130 s for the drafter (measured with other jobs on the same 2 cores): the tests
# that train in 2 processes are marked slow.


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """{"tokens", "val", "target"}: token streams of a few standard-library files under a
    300-token BPE, and a random tiny Qwen3 target (V 320) saved with that tokenizer."""
    from flax import nnx

    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config, write_token_corpus

    d = tmp_path_factory.mktemp("mp_data")
    tok, paths = write_token_corpus(str(d))
    target = Transformer(tiny_config(320, hidden_size=32, num_layers=4, num_heads=4,
                                     num_kv_heads=2, head_dim=8, intermediate_size=64),
                         rngs=nnx.Rngs(7))
    save_model(target, str(d / "target"), tokenizer=tok)
    return {**paths, "target": str(d / "target")}


def lm_sets(setup, *extra):
    return [f"data.tokens_npy={setup['tokens']}", f"data.val_tokens_npy={setup['val']}",
            "mesh.data=-1", *extra]


def drafter_sets(setup, *extra):
    return ["objective=ttt", "drafter.kind=eagle3", f"target={setup['target']}",
            *lm_sets(setup, *extra)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two train.py processes of one run on localhost; stderr of process i goes to
    <run_dir>.p<i>.log (gloo is chatty: files, not pipes that could fill up)."""

    def __init__(self, config: str, run_dir, sets: list[str], *args: str):
        port = free_port()
        self.logs = [f"{run_dir}.p{i}.log" for i in range(2)]
        env = dict(os.environ, JAX_NUM_CPU_DEVICES="4", PYTHONPATH=ROOT,
                   JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")  # loopback only
        self.procs = []
        for i in range(2):
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", config,
                   "--run-dir", str(run_dir), "--no-progress", "--distributed",
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i), *args]
            for s in sets:
                cmd += ["--set", s]
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env,
                                                   stdout=subprocess.DEVNULL, stderr=log))
        self.deadline = time.time() + TIMEOUT

    def stderr(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return "".join(line for line in f if "[Gloo]" not in line)

    def wait(self) -> list[int]:
        """Exit codes of both; kills both and fails if either outlives the deadline."""
        try:
            for p in self.procs:
                p.wait(timeout=max(1.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"train.py --distributed hung for {TIMEOUT} s:\n"
                        f"{self.stderr(0)[-3000:]}\n{self.stderr(1)[-3000:]}")
        return [p.returncode for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def check_ok(self) -> None:
        codes = self.wait()
        assert codes == [0, 0], f"exit codes {codes}:\n{self.stderr(0)}\n{self.stderr(1)}"


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same_tensors(dir_a, dir_b, name):
    """The tensors of two safetensors files agree to float32 rounding after a few AdamW
    steps: lr 1e-2 moves a weight ~1e-2 a step, and a gradient near 0 (m / sqrt(v))
    turns a reduction-order difference into up to ~1e-6 of it."""
    from safetensors.numpy import load_file

    a, b = load_file(os.path.join(dir_a, name)), load_file(os.path.join(dir_b, name))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=2e-5, err_msg=k)


def no_temporaries(run_dir) -> bool:
    return not [d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if "tmp" in d]


# ----------------------------------------------------------------------------- lm

@pytest.mark.slow
def test_lm_two_processes_equal_one_and_resume_in_both(setup, tmp_path):
    """3 steps in 2 processes, then a 2-process resume to step 4 (the export): losses,
    validation loss and exported weights equal one process on 8 devices."""
    sets = lm_sets(setup, "train.steps=4")
    ref = train(load_config(TINY, sets, run_dir=str(tmp_path / "ref")), progress=False)
    assert sorted(ref.losses) == [1, 2, 3, 4]

    run = tmp_path / "run"
    Job(TINY, run, sets, "--stop-at-step", "3").check_ok()
    assert Checkpoints(str(run / "checkpoints"), 2).latest_step() == 3 and no_temporaries(run)
    first = metrics(run)
    assert first[0]["devices"] == 8 and first[0]["mesh"]["data"] == 8

    job = Job(TINY, run, sets)  # both processes restore step 3 (else step 4 would differ)
    job.check_ok()
    assert "done at step 4" in job.stderr(0)
    assert "done at step" not in job.stderr(1)  # process 0 reports for the run
    second = metrics(run)[len(first):]
    assert second[0]["event"] == "resume" and second[0]["step"] == 3
    got = {**losses(first), **losses(second)}
    assert sorted(got) == [1, 2, 3, 4]  # one metrics line per step: process 0 only
    np.testing.assert_allclose([got[s] for s in range(1, 5)],
                               [ref.losses[s] for s in range(1, 5)], rtol=1e-5)
    done = second[-1]
    assert done["event"] == "done"
    np.testing.assert_allclose(done["val_loss"], ref.val_losses[4], rtol=1e-5)
    assert_same_tensors(ref.export_dir, done["export_dir"], "model.safetensors")


# ----------------------------------------------------------------------------- drafter

@pytest.mark.slow
def test_eagle3_ttt_two_processes_equal_one(setup, tmp_path):
    """An eagle3 drafter (objective ttt) for 3 steps with validation at steps 2 and 3:
    losses, alpha / tau and the exported best-tau drafter equal one process."""
    sets = drafter_sets(setup, "train.steps=3", "train.eval_every=2")
    ref = train(load_config(TINY_DRAFTER, sets, run_dir=str(tmp_path / "ref")),
                progress=False)
    run = tmp_path / "run"
    job = Job(TINY_DRAFTER, run, sets)
    job.check_ok()
    records = metrics(run)
    got = losses(records)
    assert sorted(got) == [1, 2, 3]
    np.testing.assert_allclose([got[s] for s in (1, 2, 3)], [ref.losses[s] for s in (1, 2, 3)],
                               rtol=1e-5)
    vals = {r["step"]: r for r in records if "val_loss" in r and "event" not in r}
    assert sorted(vals) == [2, 3]
    for s, rec in vals.items():
        want = ref.val_metrics[s]
        np.testing.assert_allclose(rec["val_loss"], want["val_loss"], rtol=1e-5)
        np.testing.assert_allclose(rec["tau"], want["tau"], rtol=1e-5)
        assert [a is None for a in rec["alpha"]] == [a is None for a in want["alpha"]]
        np.testing.assert_allclose([a for a in rec["alpha"] if a is not None],
                                   [a for a in want["alpha"] if a is not None], rtol=1e-5)
    assert records[-1]["best_step"] == ref.best["step"]
    assert_same_tensors(ref.export_dir, records[-1]["export_dir"], "model.safetensors")


# ----------------------------------------------------------------------------- SIGTERM

@pytest.mark.slow
@pytest.mark.parametrize("which", [1])  # process 0 (the coordinator) behaves the same
def test_sigterm_to_one_process_checkpoints_both_and_resumes(setup, tmp_path, which):
    """SIGTERM to process `which` mid-run: both processes reach the same step, write one
    complete checkpoint and exit 0; the run then resumes from it (here in one process on
    8 devices) with the losses of an uninterrupted run."""
    sets = lm_sets(setup, "train.steps=100000", "export.enabled=false")
    run = tmp_path / "run"
    job = Job(TINY, run, sets)
    path = run / "metrics.jsonl"
    try:
        while time.time() < job.deadline and all(p.poll() is None for p in job.procs):
            if path.exists() and sum('"loss"' in line for line in open(path)) >= 2:
                break
            time.sleep(0.1)
        assert all(p.poll() is None for p in job.procs), job.stderr(0) + job.stderr(1)
        job.procs[which].send_signal(signal.SIGTERM)
        job.check_ok()
    finally:
        job.kill()
    assert "preempted: checkpointed" in job.stderr(0)
    records = metrics(run)
    assert records[-1]["event"] == "preempted"
    step = records[-1]["step"]
    assert step >= 2 and Checkpoints(str(run / "checkpoints"), 2).latest_step() == step
    assert no_temporaries(run)
    before = losses(records)
    assert sorted(before) == list(range(1, step + 1))

    resumed = train(load_config(TINY, sets, run_dir=str(run)), stop_at=step + 1,
                    progress=False)
    assert sorted(resumed.losses) == [step + 1]
    ref = train(load_config(TINY, sets, run_dir=str(tmp_path / "ref")), stop_at=step + 1,
                progress=False)
    got = {**before, **resumed.losses}
    np.testing.assert_allclose([got[s] for s in range(1, step + 2)],
                               [ref.losses[s] for s in range(1, step + 2)], rtol=1e-5)


# ----------------------------------------------------------------------------- errors

def test_a_held_run_dir_refuses_the_whole_job(tmp_path):
    """Only process 0 takes the run dir's lock (its partner shares the run dir); when
    another train.py holds it, both processes of the job exit 2 with the holder's pid
    instead of one of them waiting in a collective."""
    from specjax.train.run_dir import RunDirLock

    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "never_read.npy").write_bytes(b"not an npy file")  # exists (train.py checks
    # data paths before the lock), and reading it would fail with another message
    lock = RunDirLock(str(run))
    try:
        job = Job(TINY, run, [f"data.tokens_npy={tmp_path}/never_read.npy"])
        codes = job.wait()
    finally:
        lock.release()
    for i in range(2):
        err = job.stderr(i)
        assert f"is in use by another train.py (pid {os.getpid()})" in err, err
    assert codes == [2, 2]
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("args,needle", [
    (["--coordinator", "127.0.0.1:1"], "need --distributed"),
    (["--distributed", "--coordinator", "127.0.0.1:1"], "go together"),
    (["--distributed", "--num-processes", "2", "--process-id", "0"], "go together"),
    (["--distributed", "--coordinator", "localhost", "--num-processes", "2",
      "--process-id", "0"], "is not HOST:PORT"),
    (["--distributed", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "2"], "must be in [0, 2)"),
    (["--distributed", "--coordinator", "127.0.0.1:1", "--num-processes", "0",
      "--process-id", "0"], "must be >= 1"),
])
def test_bad_cluster_flags_exit_2_with_one_line(args, needle, capsys):
    code = train_cli.main(["--config", TINY, "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err
