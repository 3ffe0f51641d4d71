"""Greedy speculative decoding == autoregressive greedy decoding, token for token;
and autoregressive greedy == transformers `generate` (an independent reference)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.core.sampling import SamplingParams
from specjax.decoding.engine import Engine
from specjax.decoding.loop import LoopConfig, autoregressive_loop, speculative_loop
from specjax.drafters.draft_lm import DraftLMDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.models.config import ModelConfig
from specjax.testing.models import noisy_copy, peaked_model

V = 48
CFG = ModelConfig(family="qwen3", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, intermediate_size=64)
PROMPT_LENS = np.array([9, 2, 5, 7], np.int32)
TP = 9


@functools.cache
def models():
    target = peaked_model(CFG, seed=0, scale=8.0)
    return target, noisy_copy(target, 0.6)


def prompts():
    rs = np.random.RandomState(0)
    # Repetitive prompts so that n-gram lookup finds matches.
    base = rs.randint(2, V, size=(4, 4))
    toks = np.tile(base, (1, 3))[:, :TP].astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(PROMPT_LENS)


def rows(res):
    t, n = np.asarray(res.tokens), np.asarray(res.lengths)
    return [t[b, :n[b]].tolist() for b in range(t.shape[0])]


def run_ar(budgets, eos=()):
    target, _ = models()
    g, p = nnx.split(target)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, eos_token_ids=eos)
    toks, lens = prompts()
    return autoregressive_loop(g, p, cfg, toks, lens, jnp.asarray(budgets, jnp.int32),
                               jax.random.key(0))


def make_drafter(kind, G):
    target, draft = models()
    if kind == "draft_lm":
        return DraftLMDrafter.create(draft, G, SamplingParams(), V)
    if kind == "self":
        return DraftLMDrafter.create(target, G, SamplingParams(), V)
    return NgramDrafter(G, V), ()


def run_spec(kind, G, budgets, eos=(), verify="block"):
    target, _ = models()
    g, p = nnx.split(target)
    drafter, dparams = make_drafter(kind, G)
    cfg = LoopConfig(max_length=TP + 24, prompt_width=TP, eos_token_ids=eos, verify=verify)
    toks, lens = prompts()
    return speculative_loop(g, p, drafter, dparams, cfg, toks, lens,
                            jnp.asarray(budgets, jnp.int32), jax.random.key(0))


BUDGETS = [24, 13, 7, 1]


@pytest.mark.parametrize("G", [1, 3, 5])
@pytest.mark.parametrize("kind", ["draft_lm", "ngram"])
def test_speculative_equals_autoregressive(kind, G):
    ar = run_ar(BUDGETS)
    sp = run_spec(kind, G, BUDGETS)
    assert rows(sp) == rows(ar)
    lens = np.asarray(sp.lengths) - PROMPT_LENS
    assert lens.tolist() == BUDGETS  # no EOS: every row stops exactly at its budget
    steps, acc = np.asarray(sp.steps), np.asarray(sp.accepted)
    assert (acc[:, 1:] <= acc[:, :-1]).all()  # acceptance counts are prefix-closed
    # Every emitted token after the first comes from a verification step.
    assert ((lens - 1) <= steps + acc.sum(1)).all()


def test_drafters_disagree_sometimes():
    """The test above is only meaningful if drafts are both accepted and rejected."""
    for kind in ("draft_lm", "ngram"):
        sp = run_spec(kind, 3, BUDGETS)
        acc, steps = np.asarray(sp.accepted).sum(), np.asarray(sp.steps).sum()
        assert 0 < acc < 3 * steps, kind


@pytest.mark.parametrize("verify", ["token", "block"])
def test_every_rule_is_greedy_at_temperature_zero(verify):
    assert rows(run_spec("draft_lm", 3, BUDGETS, verify=verify)) == rows(run_ar(BUDGETS))


@pytest.mark.parametrize("G", [3, 5])
def test_budget_ends_mid_block(G):
    """Self-drafting accepts whole blocks of G+1 tokens; budgets not a multiple stop inside."""
    budgets = [11, 4, 9, 2]
    sp = run_spec("self", G, budgets)
    assert rows(sp) == rows(run_ar(budgets))
    assert (np.asarray(sp.accepted)[:, -1] > 0).all()  # blocks were fully accepted


@pytest.mark.parametrize("G", [3, 5])
def test_eos_inside_accepted_block(G):
    ar = run_ar(BUDGETS)
    out0 = rows(ar)[0][PROMPT_LENS[0]:]
    eos = out0[4]  # a token the target emits mid-generation
    first = out0.index(eos)
    ar_eos, sp_eos = run_ar(BUDGETS, (eos,)), run_spec("self", G, BUDGETS, (eos,))
    assert rows(sp_eos) == rows(ar_eos)
    got = rows(sp_eos)[0][PROMPT_LENS[0]:]
    assert got == out0[:first + 1]  # stopped right after the EOS, EOS included
    assert first + 1 < BUDGETS[0]


def test_padding_rows_emit_nothing():
    ar = run_ar([5, 0, 3, 0])
    lens = np.asarray(ar.lengths) - PROMPT_LENS
    assert lens.tolist() == [5, 0, 3, 0]


def test_engine_batches_match_single_rows():
    target, draft = models()
    toks, lens = prompts()
    ids = [np.asarray(toks)[b, :PROMPT_LENS[b]].tolist() for b in range(4)]
    drafter, dparams = DraftLMDrafter.create(draft, 3, SamplingParams(), V)
    kw = dict(max_length=TP + 16, prompt_width=TP)
    big = Engine(target, drafter=drafter, drafter_params=dparams, batch_size=3, **kw)
    one = Engine(target, batch_size=1, **kw)
    key = jax.random.key(0)
    together = big.run(ids[:3], 16, key).outputs + big.run(ids[3:], 16, key).outputs
    alone = [one.run([x], 16, key).outputs[0] for x in ids]
    assert together == alone


def test_autoregressive_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from specjax.models.checkpoint import save_model

    target, _ = models()
    save_model(target, str(tmp_path / "t"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "t"),
                                                           dtype=torch.float32).eval()
    ar = rows(run_ar(BUDGETS))
    toks, _ = prompts()
    for b, n in enumerate(PROMPT_LENS):
        inp = torch.tensor(np.asarray(toks)[b:b + 1, :n], dtype=torch.long)
        with torch.no_grad():
            out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                              max_new_tokens=BUDGETS[b], min_new_tokens=BUDGETS[b],
                              eos_token_id=None, pad_token_id=0)
        assert out[0].tolist() == ar[b]
