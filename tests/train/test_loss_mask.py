"""Loss masks (chat data: only assistant tokens are targets) through the whole trainer:
the stream cut, config checks, the lm / ttt / block objectives against float64 numpy
references, and train.py runs with a mask (mesh parity, bit-exact resume, the mask
changes what is trained)."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.data.packing import ConcatStream, PackedStream
from specjax.errors import SpecjaxError
from specjax.train import load_config, train
from specjax.train.objectives.block import block_loss, sample_anchors
from specjax.train.objectives.ttt import sample_positions, ttt_loss

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "test_tiny_drafter.yaml")


# ----------------------------------------------------------------------------- the stream

def test_mask_rows_are_the_mask_of_the_rows():
    tokens = np.arange(1000, dtype=np.uint16) * 7 % 301
    mask = (tokens % 3 == 0).astype(np.uint8)
    for stream in (PackedStream(tokens, 16, 3, loss_mask=mask),
                   PackedStream(ConcatStream([tokens[:400], tokens[400:].astype(np.int32)]),
                                16, 3, loss_mask=ConcatStream([mask[:400], mask[400:]]))):
        for pos in (0, 5, stream.num_sequences - 2, 3 * stream.num_sequences + 1):
            rows, _ = stream.batch(pos, 6)
            got = stream.mask_rows(pos, 6)
            assert got.dtype == np.uint8 and got.shape == rows.shape
            np.testing.assert_array_equal(got, (rows % 3 == 0).astype(np.uint8))
    assert PackedStream(tokens, 16, 3).mask_rows(0, 2) is None
    with pytest.raises(ValueError, match="loss_mask must be 1-D"):
        PackedStream(tokens, 16, 0, loss_mask=mask[:-1])


# ----------------------------------------------------------------------------- objectives

def _ce(logits, label_probs):
    """f64 cross-entropy of logits [..., V] against label distributions [..., V]."""
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return -(label_probs * logp).sum(-1)


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class _Frozen(NamedTuple):
    embed: None = None
    head: None = None
    inv_freq: None = None


FROZEN = _Frozen()


class _Tgt(NamedTuple):
    logits: jax.Array
    hidden: jax.Array | None = None
    kv: tuple | None = None


class _FakeTTTNet:
    """A TTT network whose draft outputs are fixed arrays and whose logits are them."""

    def __init__(self, outs):
        self.outs = outs

    def ttt(self, hidden, kv, rows, embed, inv_freq, steps, anchors, kernel=None):
        return self.outs, None

    def logits(self, out, head):
        return out


class _FakeBlockNet:
    """A block network whose block outputs [B,A,G+1,V] are read from a table by anchor."""

    def __init__(self, table):  # f32[B, T+1, G+1, V]: the block output of anchor a
        self.table = table

    def contexts(self, hidden, kv, pos, inv_freq):
        return None

    def blocks(self, contexts, anchors, tokens, embed, inv_freq, G, kernel):
        return jnp.take_along_axis(self.table, anchors[:, :, None, None], axis=1)

    def logits(self, out, head):
        return out

    def selector(self):  # no path selector
        return None

    def layout(self, G):  # DFlash's block [anchor, G masks]: slots 1..G draft
        return G + 1, 1

    def markov(self):  # no Markov head
        return None

    class cfg:  # the config as the loss reads it: no confidence head
        confidence_head = False


def test_ttt_loss_with_a_mask_matches_a_float64_reference():
    B, T, V, G, decay = 3, 12, 7, 3, 0.8
    rng = np.random.default_rng(0)
    rows = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T + 1)) < 0.6).astype(np.float32)
    outs = rng.normal(size=(G, B, T, V)).astype(np.float32)
    tl = rng.normal(size=(B, T, V)).astype(np.float32)
    net, tgt = _FakeTTTNet(jnp.asarray(outs)), _Tgt(jnp.asarray(tl))
    for soft in (True, False):
        loss, st = ttt_loss(net, tgt, jnp.asarray(rows), FROZEN, steps=G, soft=soft,
                            decay=decay, mask=jnp.asarray(mask))
        want, acc, chains = 0.0, np.zeros(G), 0.0
        for k in range(G):
            num = den = 0.0
            for b in range(B):
                for t in range(T):
                    if t + k + 1 > T - 1 or not mask[b, t + k + 2]:
                        continue
                    label = (_softmax(tl[b, t + k + 1]) if soft
                             else np.eye(V)[rows[b, t + k + 2]])
                    num += _ce(outs[k, b, t], label)
                    den += 1
            want += decay ** k * num / max(den, 1)
        for b in range(B):
            for t in range(T):
                if t + G > T - 1 or not all(mask[b, t + k + 2] for k in range(G)):
                    continue
                chains += 1
                ok = [outs[k, b, t].argmax() == tl[b, t + k + 1].argmax() for k in range(G)]
                acc += np.cumprod(ok)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(st["accepted"]), acc)
        assert float(st["chains"]) == chains
    # a mask of ones is no mask at all
    plain = ttt_loss(net, tgt, jnp.asarray(rows), FROZEN, steps=G)
    ones = ttt_loss(net, tgt, jnp.asarray(rows), FROZEN, steps=G,
                    mask=jnp.ones((B, T + 1), jnp.float32))
    assert float(plain[0]) == float(ones[0])
    for k in plain[1]:
        np.testing.assert_array_equal(np.asarray(plain[1][k]), np.asarray(ones[1][k]))


def test_block_loss_with_a_mask_matches_a_float64_reference():
    B, T, V, G, A, gw = 2, 14, 6, 3, 4, 7.0
    rng = np.random.default_rng(1)
    rows = rng.integers(0, V, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T + 1)) < 0.5).astype(np.float32)
    table = rng.normal(size=(B, T + 1, G + 1, V)).astype(np.float32)
    tl = rng.normal(size=(B, T, V)).astype(np.float32)
    key = jax.random.key(3)
    net, tgt = _FakeBlockNet(jnp.asarray(table)), _Tgt(jnp.asarray(tl))
    anchors = np.asarray(sample_anchors(key, B, T, G, A, jnp.asarray(mask[:, 2:T - G + 2])))
    for soft in (True, False):
        loss, st = block_loss(net, tgt, jnp.asarray(rows), FROZEN, key, num_anchors=A,
                              soft=soft, gamma_w=gw, gamma=G, mask=jnp.asarray(mask))
        num = den = chains = 0.0
        acc = np.zeros(G)
        for b in range(B):
            for a in anchors[b]:
                ok = []
                for k in range(G):  # block position k+1 predicts token a+k+1
                    label = (_softmax(tl[b, a + k]) if soft else np.eye(V)[rows[b, a + k + 1]])
                    w = np.exp(-k / gw) * mask[b, a + k + 1]
                    num += w * _ce(table[b, a, k + 1], label)
                    den += w
                    ok.append(table[b, a, k + 1].argmax() == tl[b, a + k].argmax())
                if all(mask[b, a + k + 1] for k in range(G)):
                    chains += 1
                    acc += np.cumprod(ok)
        np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(st["accepted"]), acc)
        assert float(st["chains"]) == chains


def test_anchors_prefer_masked_positions():
    key, B, T = jax.random.key(0), 4, 40
    prefer = np.zeros((B, T - 1), np.float32)
    prefer[:, 10:20] = 1
    got = np.asarray(sample_positions(key, B, T, 6, jnp.asarray(prefer)))
    assert ((got >= 10) & (got < 20)).all()
    got = np.asarray(sample_positions(key, B, T, 14, jnp.asarray(prefer)))
    assert (((got >= 10) & (got < 20)).sum(1) == 10).all()  # all ten, then others
    prefer = np.zeros((B, T - 4), np.float32)
    prefer[:, 5:9] = 1
    got = np.asarray(sample_anchors(key, B, T, 4, 4, jnp.asarray(prefer)))
    np.testing.assert_array_equal(got, np.tile(np.arange(6, 10), (B, 1)))  # a = index + 1


def test_lm_loss_with_a_mask_matches_a_float64_reference():
    from flax import nnx

    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config
    from specjax.train.step import Trainer

    cfg = tiny_config(64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      head_dim=16, intermediate_size=64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    _, params, _ = nnx.split(model, nnx.Param, ...)
    trainer = Trainer.__new__(Trainer)  # only the loss: no mesh, no optimizer
    trainer.graphdef, _, trainer.rest = nnx.split(model, nnx.Param, ...)
    trainer.attention = None
    rng = np.random.default_rng(2)
    rows = rng.integers(0, 64, (2, 11)).astype(np.int32)
    mask = (rng.random((2, 11)) < 0.5).astype(np.uint8)
    got = float(trainer.loss(params, (jnp.asarray(rows), jnp.asarray(mask))))
    T = rows.shape[1] - 1
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    logits = np.asarray(model(jnp.asarray(rows[:, :-1]), pos, None).logits)
    ce = _ce(logits, np.eye(64)[rows[:, 1:]])
    m = mask[:, 1:].astype(bool)
    np.testing.assert_allclose(got, ce[m].mean(), rtol=1e-5)
    assert abs(got - ce.mean()) > 1e-3  # the mask changed the loss


# ----------------------------------------------------------------------------- train.py

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random tiny target, its token streams, and loss masks that keep about half of
    every stream (runs of 5 tokens on, 5 off)."""
    from flax import nnx

    from specjax.models.checkpoint import save_model
    from specjax.models.model import Transformer
    from specjax.testing.tiny import tiny_config, write_token_corpus

    d = tmp_path_factory.mktemp("mask_data")
    tok, paths = write_token_corpus(str(d))
    target = Transformer(tiny_config(320, hidden_size=32, num_layers=4, num_heads=4,
                                     num_kv_heads=2, head_dim=8, intermediate_size=64),
                         rngs=nnx.Rngs(7))
    save_model(target, str(d / "target"), tokenizer=tok)
    out = {**paths, "target": str(d / "target")}
    for name in ("tokens", "val"):
        n = len(np.load(paths[name]))
        out[name + "_mask"] = str(d / f"{name}_mask.npy")
        np.save(out[name + "_mask"], (np.arange(n) // 5 % 2).astype(np.uint8))
    return out


def _cfg(setup, run_dir, kind="ttt", mesh=(1, 1, 1), masked=True, *extra):
    d, f, m = mesh
    sets = (["objective=ttt", "drafter.kind=eagle3"] if kind == "ttt" else
            ["objective=block", "drafter.kind=block", "drafter.num_anchors=4"])
    args = [*sets, f"target={setup['target']}", f"data.tokens_npy={setup['tokens']}",
            f"data.val_tokens_npy={setup['val']}", f"mesh.data={d}", f"mesh.fsdp={f}",
            f"mesh.model={m}", "train.eval_every=2"]
    if masked:
        args += [f"data.loss_mask_npy={setup['tokens_mask']}",
                 f"data.val_loss_mask_npy={setup['val_mask']}"]
    return load_config(TINY, [*args, *extra], run_dir=str(run_dir))


@pytest.mark.parametrize("kind", ["ttt", pytest.param("block", marks=pytest.mark.slow)])
def test_masked_runs_match_across_meshes_and_differ_from_unmasked(setup, tmp_path, kind):
    ref = train(_cfg(setup, tmp_path / "a", kind), progress=False)
    mesh = train(_cfg(setup, tmp_path / "b", kind, (2, 2, 2)), progress=False)
    plain = train(_cfg(setup, tmp_path / "c", kind, (1, 1, 1), False), progress=False)
    a = np.array([ref.losses[s] for s in sorted(ref.losses)])
    np.testing.assert_allclose([mesh.losses[s] for s in sorted(mesh.losses)], a, rtol=1e-5)
    assert np.isfinite(a).all()
    b = np.array([plain.losses[s] for s in sorted(plain.losses)])
    assert np.abs(a - b).max() > 1e-4  # the mask reached the loss (parity above: 1e-5)
    for s in ref.val_metrics:
        np.testing.assert_allclose(mesh.val_metrics[s]["tau"], ref.val_metrics[s]["tau"],
                                   rtol=1e-5)


@pytest.mark.slow
def test_masked_resume_is_bit_exact(setup, tmp_path):
    ref = train(_cfg(setup, tmp_path / "ref", "block", (2, 2, 2), True,
                     "train.grad_accum=2"), progress=False)
    cfg = _cfg(setup, tmp_path / "run", "block", (2, 2, 2), True, "train.grad_accum=2",
               "train.checkpoint_every=1")
    first = train(cfg, stop_at=3, progress=False)
    second = train(cfg, progress=False)
    for s in (1, 2, 3):
        assert first.losses[s] == ref.losses[s], s
    for s in (4, 5):
        assert second.losses[s] == ref.losses[s], s


@pytest.mark.parametrize("extra,needle", [
    (["data.loss_mask_npy=[a.npy,b.npy]"], "names 2 files but data.tokens_npy 1"),
    (["data.val_loss_mask_npy=null"], "data.val_loss_mask_npy is not"),
    (["data.loss_mask_npy=/nonexistent/m.npy"], "data.loss_mask_npy /nonexistent/m.npy"),
    (["data.loss_mask_npy=VAL_MASK"], "entries but its token stream"),
    (["data.loss_mask_npy=TWOS"], "values other than 0 and 1"),
    (["data.loss_mask_npy=ZEROS"], "all zeros"),
])
def test_bad_masks_are_one_line_errors(setup, tmp_path, extra, needle):
    n = len(np.load(setup["tokens"]))
    np.save(tmp_path / "twos.npy", np.full(n, 2, np.uint8))
    np.save(tmp_path / "zeros.npy", np.zeros(n, np.uint8))
    subs = {"VAL_MASK": setup["val_mask"], "TWOS": str(tmp_path / "twos.npy"),
            "ZEROS": str(tmp_path / "zeros.npy")}
    extra = [e.split("=")[0] + "=" + subs.get(e.split("=")[1], e.split("=")[1])
             for e in extra]
    with pytest.raises(SpecjaxError, match=needle) as e:
        train(_cfg(setup, tmp_path / "run", "ttt", (1, 1, 1), True, *extra), progress=False)
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
