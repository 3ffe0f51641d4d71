"""Smoke test of benchmarks/decode_speed.py: a --quick run finishes and writes the JSON
keys the lead reads (not the speed figures, which depend on the machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "decode_speed.py")
# Top-level keys of the JSON (benchmarks.decode_speed.JSON_KEYS; not imported here because
# importing the script sets up jax and torch in the test process).
JSON_KEYS = ("config", "num_params", "weight_bytes", "new_tokens", "prompt_tokens", "repeats",
             "init", "threads", "environment", "bandwidth", "floor_tokens_per_s", "systems",
             "parity", "load_average")


def test_decode_speed_quick(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "speed.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--repeats", "1", "--new-tokens", "16",
         "--gammas", "4", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| specjax-ar |" in proc.stdout

    result = json.loads(out.read_text())
    assert set(result) == set(JSON_KEYS)
    assert set(result["systems"]) == {"transformers", "specjax-ar", "specjax-self-G4"}
    for s in result["systems"].values():
        assert {"wall_s", "tokens_per_s", "tau", "compile_s", "fraction_of_floor"} <= set(s)
        assert {"median", "min", "max"} <= set(s["tokens_per_s"])
        assert len(s["wall_s"]) == 1
    assert result["systems"]["specjax-self-G4"]["tau"] == pytest.approx(5.0, abs=1.0)
    parity = result["parity"]
    assert len(parity["specjax_ar_tokens"]) == 16
    assert parity["specjax-self-G4_equals_ar"] is True  # greedy speculative is lossless
    assert parity["ar_transformers_common_prefix"] >= 0
    assert result["bandwidth"]["median"] > 0 and result["floor_tokens_per_s"] > 0


def test_profile_step_attributes_every_op(tiny_demo, tmp_path):
    """benchmarks/profile_step.py: every op of the traced loop is matched to its HLO
    instruction, the parts add up to the wall time, and the verify forward shows up."""
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "profile_step.py"), "--target",
         str(tiny_demo / "target"), "--drafter", str(tiny_demo / "draft"), "--prompts",
         str(tiny_demo / "prompts.jsonl"), "--num-prompts", "2", "--new-tokens", "24",
         "--runs", "1", "--top", "3", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    parts = r["ms_per_step"]
    assert sum(parts.values()) == pytest.approx(r["step_ms"], rel=1e-6)
    assert parts["ops not matched to the module"] < 0.02 * r["step_ms"]
    assert parts["target_verify_forward"] > 0 and parts["drafter_propose"] > 0
    assert "| target_verify_forward |" in proc.stdout
    # --top: the per-op times add up to the matched parts of the step.
    assert "target_verify_forward: top 3 of" in proc.stdout
    matched = sum(v for k, v in parts.items() if k not in (
        "ops not matched to the module", "not in any op"))
    assert sum(r["top_ops"].values()) == pytest.approx(matched, rel=1e-6)


def test_matmul_rows_table(tiny_demo):
    """benchmarks/matmul_rows.py: one table row per --rows value with the four variants
    (figures depend on the machine; only the table is checked), and exit 2 on bad input."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = os.path.join(ROOT, "benchmarks", "matmul_rows.py")
    proc = subprocess.run([sys.executable, script, "--target", str(tiny_demo / "target"),
                           "--rows", "1", "4", "--repeats", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert "f32 plain ms" in lines[0] and "f32 unpadded ms" in lines[0]
    assert [ln.split("|")[1].strip() for ln in lines[1:]] == ["1", "4"]
    bad = subprocess.run([sys.executable, script, "--rows", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_kernels_roofline_arithmetic():
    """benchmarks/kernels.py and its model (benchmarks/lib/roofline.py) against hand-worked
    figures (independent arithmetic)."""
    from benchmarks import kernels
    from benchmarks.lib import roofline

    # Block verification, B 2, G 3, V 1000, f32 logits: the fused path reads the target
    # logits twice (2 * 2*4*1000*4 B) and the draft probabilities once (2*3*1000*4 B).
    assert roofline.verify_bytes(2, 3, 1000, "block") == 64_000 + 24_000
    # Unfused: the softmax reads the logits twice and writes p (3 * 32,000 B); the A_i
    # pass reads p and q (32,000 + 24,000 B); the correction reads one p row per row of
    # the batch (8,000 B) and p_t, q_t (2 * 2*1000*4 B).
    assert roofline.verify_bytes(2, 3, 1000, "block", fused=False) == 96_000 + 56_000 + 8_000 + 16_000
    # Attention, B 1, T 1, 1024 valid of 32768, K 8, H 128, N 32, bf16: K and V of the
    # valid tokens only (2 * 8 * 1024 * 128 * 2 B) plus q and out (2 * 32 * 128 * 2 B).
    assert roofline.attention_bytes(1, 1, 1024, 32768, 32, 8, 128) == 4_194_304 + 16_384
    text = kernels.format_tables(markdown=True)
    assert "| block | 8 | 8 |" in text and "roofline us H100" in text


def _kept_for_backward(f, *args):
    """[(shape, dtype)] of what jax.vjp of f keeps for the backward pass (the leaves of the
    pullback), by abstract evaluation: no arrays are made."""
    import jax

    pullback = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
    return [(x.shape, x.dtype) for x in jax.tree.leaves(pullback)]


def _nbytes(kept):
    import numpy as np

    return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in kept)


@pytest.mark.timeout(120)
def test_kernels_packed_training_arithmetic():
    """benchmarks/kernels.py's packed-attention training table (benchmarks/lib/roofline.py's
    model) against hand-worked figures: causal T = S = 2048 at Qwen3-8B heads (N 32, K 8,
    R 4, H 128, bf16). What each path keeps for the backward is checked against jax
    itself: the residuals of jax.vjp through `attend` (the jnp path) and through
    `packed_attention` (the kernel), by abstract evaluation at that shape."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import kernels
    from benchmarks.lib import roofline
    from pallas_kernels.attention import packed_attention
    from specjax.drafters.attend import attend

    limit = roofline.packed_limits("causal", 2048, 2048)
    # Folded rows: 2048 * 4 = 8192 per KV head, 64 row tiles of 128 rows = 32 queries;
    # tile i's largest limit is 32 (i + 1), so it reads i // 4 + 1 S tiles of 128:
    # 4 * (1 + ... + 16) = 544 per KV head, 8 KV heads.
    assert roofline.packed_pairs(limit, 32, 8, 2048) == 4352
    # Forward: K and V tiles per pair (2 * 4352 * 128*128*2 B), q read and o written
    # (2 * 8*8192*128*2 B), limits read and lse written (2 * 8*8192*4 B).
    fwd, bwd = roofline.packed_train_bytes(limit, 32, 8, 2048, 128)
    assert fwd == 285_212_672 + 33_554_432 + 524_288
    # What autodiff keeps, from jax: the jnp path's largest f32 residual is the scores /
    # probabilities [B, K, R, T, S] (the table's "f32 probs", a lower bound of all it
    # keeps beyond q, k, v: also the mask and a bf16 copy of P); the kernel keeps exactly
    # o and lse beyond its inputs (q, k, v and the limits).
    B, T, S, N, K, H = 1, 2048, 2048, 32, 8, 128
    spec = jax.ShapeDtypeStruct
    q, kvs = spec((B, T, N, H), jnp.bfloat16), spec((B, K, S, H), jnp.bfloat16)
    limits = jnp.broadcast_to(jnp.arange(1, T + 1, dtype=jnp.int32), (B, T))
    causal = jnp.arange(S)[None, None, :] < limits[:, :, None]
    jnp_kept = _kept_for_backward(lambda q, k, v: attend(q, [(k, v, causal)]), q, kvs, kvs)
    f32 = [x for x in jnp_kept if x[1] == np.float32]
    scores = max(_nbytes([x]) for x in f32)
    largest = {shape for shape, dt in f32 if _nbytes([(shape, dt)]) == scores}
    assert largest == {(B, K, N // K, T, S)}  # [B, N, T, S], heads grouped per KV head
    inputs = _nbytes([(q.shape, q.dtype), (kvs.shape, kvs.dtype), (kvs.shape, kvs.dtype)])
    assert _nbytes(jnp_kept) - inputs >= scores
    kernel_kept = _kept_for_backward(
        lambda q, k, v: packed_attention(q, k, v, limits, backend="tpu", interpret=True),
        q, kvs, kvs)
    kernel_extra = _nbytes(kernel_kept) - inputs - _nbytes([(limits.shape, limits.dtype)])
    assert roofline.packed_kept_bytes(1, 2048, 2048, 32, 128) == (kernel_extra, scores)
    jfwd, jbwd = roofline.jnp_train_bytes(1, 2048, 2048, 32, 8, 128)
    qo, kv = 2048 * 32 * 128 * 2, 8 * 2048 * 128 * 2
    assert jfwd == 4 * scores + 2 * qo + 2 * kv and jbwd == 7 * scores + 4 * qo + 4 * kv
    # FLOPs: jnp 4 * 32 * 2048^2 * 128 forward (all entries), backward 2x; the kernel
    # 4 * 128^3 per computed pair forward, backward 3.5x.
    assert roofline.jnp_train_flops(1, 2048, 2048, 32, 128) == (68_719_476_736,
                                                                 137_438_953_472)
    assert roofline.packed_train_flops(limit, 32, 8, 2048, 128) == (36_507_222_016,
                                                                    127_775_277_056)
    # Roofline: 819 GB at 819 GB/s, or 197 TFLOP at 197 TFLOP/s, is one second on v5e.
    assert roofline.roofline_ms((819e9, 0), (0, 197e12), "TPU v5e") == 2000.0
    # Block-wise: 512 blocks of 16 queries, anchors (a + 1) * 8: mean 8 * 513 / 2 = 2052.
    assert roofline.packed_limits("block", 8192, 4096, 512).mean() == 2052.0
    rows = {r["case"]: r for r in kernels.packed_rows()}
    assert rows["causal"]["T"] == 8192  # the last causal row
    assert rows["block A 512 x 16"]["ref_kept"] == 4 * 32 * 8192 * 4096
    assert all(r["bytes"] < r["ref_bytes"] and r["flops"] < r["ref_flops"]
               for r in rows.values())
    text = kernels.format_tables(markdown=True)
    assert "| causal | 2048 | 2048 | 1024 |" in text
    assert "| block A 512 x 16 | 8192 | 4096 | 2052 |" in text and "kept jnp MiB" in text


@pytest.mark.slow  # a benchmark of long contexts; the paths it runs are tested by
# tests/decoding/test_partial_verify.py and tests/models/test_target_attention.py
def test_context_length_quick(tmp_path):
    """benchmarks/context_length.py --quick: both sweeps run, every attention setting
    gives the same tokens, and the JSON and plot are written."""
    script = os.path.join(ROOT, "benchmarks", "context_length.py")
    out, png = tmp_path / "ctx.json", tmp_path / "ctx.png"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, script, "--quick", "--json", str(out),
                           "--plot", str(png)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["capacity_outputs_identical"] is True
    assert {(r["capacity"], r["chunk"]) for r in result["capacity"]} == {
        (64, 0), (64, 256), (512, 0), (512, 256)}
    assert [r["context"] for r in result["context"]] == [32, 512]
    assert png.stat().st_size > 0


@pytest.mark.slow  # a benchmark script; chunked prefill is tested in tests/decoding/
def test_prefill_settings_table(tiny_demo, tmp_path, capsys):
    """benchmarks/prefill.py on the tiny demo with a random eagle3: one row per setting and
    new-token count, the pieces each setting runs, every output equal to the first
    setting's autoregressive one; exit 2 with one line on a bad setting."""
    from benchmarks import prefill as bench
    from specjax.testing.tiny import save_random_drafter

    tgt = str(tiny_demo / "target")
    d = save_random_drafter(tgt, str(tmp_path / "drafter"))
    out = tmp_path / "r.json"
    base = ["--target", tgt, "--drafter", d, "--prompts-file", str(tiny_demo / "prompts.jsonl"),
            "--prompts", "2"]
    assert bench.main(base + ["--settings", "8:8", "16:4", "--new-tokens", "1", "6",
                              "--json", str(out)]) == 0
    rows_ = json.loads(out.read_text())["rows"]
    assert [(r["setting"], r["new_tokens"]) for r in rows_] == [
        ("8:8", 1), ("16:4", 1), ("8:8", 6), ("16:4", 6)]
    assert [r["sizes"] for r in rows_[:2]] == [[8], [16, 8, 4]]
    assert all(r["identical"] is True for r in rows_)
    assert "| 16:4 | 16, 8, 4 | 6 |" in capsys.readouterr().out
    assert bench.main(base + ["--settings", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--settings" in err and "\n" not in err


def test_git_rev_marks_code_changes_but_not_results(tmp_path):
    """benchmarks.lib.provenance.git_rev: "+dirty" for an uncommitted change to the code a
    benchmark measures (specjax/, decode.py, benchmarks/), not for its results files,
    which the benchmark before it in the same session rewrote."""
    from benchmarks.lib.provenance import git_rev

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    for rel in ("specjax/a.py", "decode.py", "benchmarks/b.py", "benchmarks/results/r.json",
                "docs/d.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("0\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    rev = git_rev(str(tmp_path))
    assert rev and not rev.endswith("+dirty")
    for rel in ("benchmarks/results/r.json", "docs/d.md"):
        (tmp_path / rel).write_text("1\n")
        assert git_rev(str(tmp_path)) == rev, rel
    for rel in ("specjax/a.py", "decode.py", "benchmarks/b.py"):
        (tmp_path / rel).write_text("1\n")
        assert git_rev(str(tmp_path)) == rev + "+dirty", rel
        (tmp_path / rel).write_text("0\n")
