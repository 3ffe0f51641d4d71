"""The jaxtyping shape annotations of the loop's data (issue 51 section 8) against real values.

`LoopState`, `LoopResult`, `LoopView`, `DraftTree`, `Verdict` and `TreeVerdict` annotate
their array fields as `Int[Array, "B S"]`, `Float[Array, "B N V"] | None`, ...; the
`Drafter` / `TreeDrafter` protocols annotate their methods' arguments and results. The
library never checks them at run time (no import hook, no decorator): they are
documentation, and this file is what keeps them true. Each test builds the objects from a
real run (a tiny speculative loop, its prefill view, a drafter's proposal, the rules'
verdicts) and checks every annotated field with jaxtyping's own `isinstance` inside one
`jaxtyped("context")` block, which shares one memo of dimension sizes: B must be the same
in every object checked in the block, N the same in a tree's tokens and q, G the same in
the state's counters and the drafter's proposal, V in the view's logits and the q, and a
symbolic size such as TreeVerdict.path's G+1 is computed from the G bound before.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxtyping import AbstractArray, Array, Float, Int, jaxtyped

from specjax.core.drafter import Drafter, LoopView, TreeDrafter
from specjax.core.sampling import SamplingParams
from specjax.core.tree import DraftTree, chain_tree, tree_from_drafts
from specjax.decoding.loop import LoopConfig, LoopResult, LoopState, phase_programs
from specjax.decoding.loop.prefill import prefill
from specjax.decoding.rules import RULES
from specjax.decoding.tree_verify import TreeVerdict
from specjax.decoding.verify import Verdict
from specjax.drafters.dynamic_tree import DynamicTree
from specjax.models.kv_cache import KVCache
from tests.decoding.test_speculative_greedy import TP, V, make_drafter, models, prompts

G = 3
BUDGETS = [12, 7, 3, 1]
ANNOTATED = (LoopState, LoopResult, LoopView, DraftTree, Verdict, TreeVerdict)


# ----------------------------------------------------------------------------- the check


def conforms(value, hint) -> bool:
    """value against a resolved annotation: jaxtyping array types through their own
    isinstance (the shared memo of the enclosing `jaxtyped("context")`), unions member by
    member (typing.Union's own isinstance skips jaxtyping's check: PRNGKeyArray is one),
    tuple[...] element by element, other classes with isinstance, Any always."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(conforms, value, args))
    return isinstance(value, origin or hint)


def _describe(value):
    return (f"{value.dtype}{list(value.shape)}" if hasattr(value, "shape")
            else type(value).__name__)


def field_names(cls) -> list[str]:
    return ([f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls)
            else list(cls._fields))


def check_fields(obj) -> list[str]:
    """Every field of `obj` (a flax struct.dataclass or a NamedTuple) against its class's
    annotation, in declaration order; call inside `jaxtyped("context")`. Returns the
    names of the array-annotated fields that held an array (those whose shapes the memo
    saw). Raises AssertionError naming the first field that does not conform."""
    hints = typing.get_type_hints(type(obj))
    seen = []
    for name in field_names(type(obj)):
        value = getattr(obj, name)
        assert conforms(value, hints[name]), (
            f"{type(obj).__name__}.{name}: {_describe(value)} is not {hints[name]}")
        if hasattr(value, "shape"):
            seen.append(name)
    return seen


def check_call(fn, args: dict, result) -> None:
    """A protocol method's annotations against the arguments it was called with and what
    it returned (inside `jaxtyped("context")`)."""
    hints = typing.get_type_hints(fn)
    for name, value in args.items():
        assert conforms(value, hints[name]), (
            f"{fn.__qualname__}({name}={_describe(value)}) is not {hints[name]}")
    assert conforms(result, hints["return"]), (
        f"{fn.__qualname__} returned {jax.tree.map(_describe, result)}; "
        f"annotated {hints['return']}")


def _is_array_hint(hint) -> bool:
    args = typing.get_args(hint)
    return (isinstance(hint, type) and issubclass(hint, AbstractArray)) or (
        bool(args) and any(_is_array_hint(a) for a in args))


# ----------------------------------------------------------------------------- fixtures


def _cfg():
    return LoopConfig(max_length=TP + 24, prompt_width=TP, verify="block")


@pytest.fixture(scope="module")
def loop_run():
    """(the prefill's LoopState, the LoopResult and the final LoopState) of one tiny
    speculative loop (draft LM drafter, G = 3), compiled as the two phase programs."""
    target, _ = models()
    g, p = nnx.split(target)
    drafter, dparams = make_drafter("draft_lm", G)
    toks, lens = prompts()
    budgets, key = jnp.asarray(BUDGETS, jnp.int32), jax.random.key(0)
    progs = phase_programs(g, p, drafter, dparams, _cfg(), toks, lens, budgets, key)
    start = progs.prefill(p, dparams, toks, lens, budgets, key)
    # decode donates the state it is given: a second prefill's
    res, final = progs.decode(p, dparams, progs.prefill(p, dparams, toks, lens, budgets, key))
    assert int(np.sum(np.asarray(res.lengths) - np.asarray(res.prompt_lengths))) > 0
    return start, res, final


# ----------------------------------------------------------------------------- tests


def test_annotations_resolve_and_cover_every_array_field():
    """With `from __future__ import annotations` the annotations are strings: each
    module must import what they name, so that typing.get_type_hints (what jaxtyping and
    the checks here use) resolves them; and no array field is left as a bare jax.Array."""
    for cls in ANNOTATED:
        hints = typing.get_type_hints(cls)
        assert set(field_names(cls)) <= set(hints), cls
        bare = [n for n in field_names(cls) if hints[n] in (jax.Array, jax.Array | None)]
        assert not bare, (cls.__name__, bare)
    for fn in (Drafter.init, Drafter.propose, Drafter.update, TreeDrafter.propose_tree):
        hints = typing.get_type_hints(fn)
        assert _is_array_hint(hints["key" if "key" in hints else "num_accepted"]), fn
    assert typing.get_type_hints(TreeDrafter.propose_tree)["return"] == tuple[DraftTree, Any]


RULE_NAMES = ("greedy", "token", "block")


def _first_step(drafter, dparams, capture=(), tree=False):
    """One compiled program (eager dispatch of these tiny ops is slower than compiling
    them): the prefill's view with `capture` depths, drafter.init on it, the view a step's
    propose reads (no hidden states, no logits, T = 1) and the proposal; for a chain
    drafter also each chain rule's Verdict on the proposal (random target logits) and
    drafter.update after the last one. -> (key, view, init state, step view, proposal,
    {rule: Verdict}, updated state)."""
    target, _ = models()
    graphdef, params = nnx.split(target)
    toks, lens = prompts()
    budgets = jnp.asarray(BUDGETS, jnp.int32)

    def run(params, dparams, key):
        _, view = prefill(nnx.merge(graphdef, params), _cfg(), toks, lens, budgets, key, G,
                          capture, drafter)
        state = drafter.init(dparams, view, key)
        step_view = LoopView(view.tokens, view.lengths, view.target_cache, None,
                             (view.lengths - 1)[:, None])
        if tree:
            return view, state, step_view, drafter.propose_tree(dparams, state, step_view,
                                                                key), {}, None
        proposal = drafter.propose(dparams, state, step_view, key)
        draft, q, new = proposal
        logits = jax.random.normal(key, (len(BUDGETS), G + 1, V))
        verdicts = {name: RULES[name].chain(draft, q, logits, key,
                                            SamplingParams(temperature=1.0))
                    for name in RULE_NAMES}
        tau = verdicts[RULE_NAMES[-1]].num_accepted
        return view, state, step_view, proposal, verdicts, drafter.update(dparams, new,
                                                                          step_view, tau)

    key = jax.random.key(1)
    return (key, *jax.jit(run)(params, dparams, key))


def test_loop_state_result_view_and_drafter_shapes(loop_run):
    """The prefill's state, the final state and the result of one loop, the prefill's
    view (with hidden states and logits), the drafter's init / propose / update calls and
    the chain rules' verdicts on that proposal, all in ONE memo: B, S, G, V agree."""
    start, res, final = loop_run
    drafter, dparams = make_drafter("draft_lm", G)
    # the view a drafter's init reads, with two captured depths: hidden [C,B,Tp,D]
    key, view, state, step_view, proposal, verdicts, updated = _first_step(
        drafter, dparams, capture=(0, 2))
    assert view.hidden is not None and view.logits is not None
    with jaxtyped("context"):
        assert check_fields(start) == ["tokens", "lengths", "prompt_lengths", "budgets",
                                       "done", "key", "steps", "accepted", "reached"]
        check_fields(final)
        assert check_fields(res) == ["tokens", "lengths", "prompt_lengths", "steps",
                                     "accepted", "reached"]
        assert check_fields(view) == ["tokens", "lengths", "hidden", "positions", "logits"]
        # the sizes the memo bound are the run's: the same B, S, G in every object
        assert isinstance(res.tokens, Int[Array, f"{len(BUDGETS)} {TP + 24 + G + 1}"])
        assert isinstance(final.accepted, Int[Array, f"B {G}"])
        assert isinstance(view.hidden, Float[Array, f"2 B {TP} D"])
        check_call(Drafter.init, {"view": view, "key": key}, state)
        # the propose view's T = 1 is not the prefill view's T: its own memo, with B and S
        # bound again from the state
        with jaxtyped("context"):
            check_fields(final)
            assert check_fields(step_view) == ["tokens", "lengths", "positions"]
            assert isinstance(step_view.pending, Int[Array, " B"])
        check_call(Drafter.propose, {"view": step_view, "key": key}, proposal)  # G, V
        for name in RULE_NAMES:
            assert isinstance(verdicts[name], Verdict), name
            assert check_fields(verdicts[name]) == ["num_accepted", "next_token"]
        tau = verdicts[RULE_NAMES[-1]].num_accepted
        check_call(Drafter.update, {"view": step_view, "num_accepted": tau}, updated)


@functools.partial(jax.jit, static_argnames="rule")
def _tree_and_verdict(drafts, q, key, rule):
    """tree_from_drafts and the tree rule's verdict on random target probabilities."""
    B, K, _ = drafts.shape
    tree = tree_from_drafts(jnp.arange(B, dtype=jnp.int32), drafts, q)
    p = jax.nn.softmax(jax.random.normal(key, (B, tree.num_nodes, q.shape[-1])), -1)
    fn = RULES[rule].tree_rule(max_depth=G, max_children=K, drafts=True)
    return tree, fn(tree, p, key), chain_tree(tree.tokens[:, 0], drafts[:, 0])


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_draft_tree_and_tree_verdict_shapes(rule):
    """A tree of K drafts (`tree_from_drafts`: N = 1 + K*G) and a chain tree, and the tree
    rules' verdicts on them: B, N, V agree across the tree's fields, path is [B, G+1]."""
    B, K, Vt = 3, 2, 5
    kd, kq, kv = jax.random.split(jax.random.key(2), 3)
    drafts = jax.random.randint(kd, (B, K, G), 0, Vt, jnp.int32)
    q = jax.nn.softmax(jax.random.normal(kq, (B, K, G, Vt)), -1)
    tree, verdict, chain = _tree_and_verdict(drafts, q, kv, rule)
    with jaxtyped("context"):
        assert isinstance(drafts, Int[Array, "B K G"]) and isinstance(q, Float[Array, "B K G V"])
        assert check_fields(tree) == ["tokens", "parents", "depths", "valid", "q"]
        assert isinstance(tree.tokens, Int[Array, "B 1+K*G"])  # N = 1 + K*G, from the memo
        assert isinstance(verdict, TreeVerdict)
        assert check_fields(verdict) == ["num_accepted", "next_token", "path"]
    with jaxtyped("context"):  # a chain: N = G + 1, and no q at temperature 0
        assert check_fields(chain) == ["tokens", "parents", "depths", "valid"]
        assert isinstance(chain.tokens, Int[Array, f"B {G + 1}"])


def test_tree_drafter_propose_tree_shapes():
    """A TreeDrafter (EAGLE-2's dynamic tree around the draft LM) against
    `TreeDrafter.propose_tree`'s annotation; its tree has N = tree_nodes."""
    inner, dparams = make_drafter("draft_lm", G)
    drafter = DynamicTree(inner, 2, 6)
    key, _, _, step_view, out, _, _ = _first_step(drafter, dparams, tree=True)
    with jaxtyped("context"):
        check_call(TreeDrafter.propose_tree, {"view": step_view, "key": key}, out)
        check_fields(out[0])
        assert isinstance(out[0].tokens, Int[Array, f"B {drafter.tree_nodes}"])
        assert isinstance(step_view.tokens, Int[Array, "B S"])  # B: the tree's


def _bad_objects():
    """{what is wrong: (objects checked in one memo, the last one wrong, its wrong field)}."""
    i, f = jnp.zeros((4, 3), jnp.int32), jnp.zeros((4, 3, 5))
    r, b = jnp.zeros((4,), jnp.int32), i.astype(bool)
    cache = KVCache.init(2, 4, 8, 2, 16)
    tree = DraftTree(i, i, i, b, f)
    return {
        "q's N differs from tokens' N": ([DraftTree(i, i, i, b, f[:, :2])], "q"),
        "q has no V axis": ([DraftTree(i, i, i, b, f[..., 0])], "q"),
        "valid is not bool": ([DraftTree(i, i, i, i, f)], "valid"),
        "float tokens": ([DraftTree(f[..., 0], i, i, b, None)], "tokens"),
        "B differs between two objects": ([tree, Verdict(r[:3], r[:3])], "num_accepted"),
        "B differs between two fields": ([Verdict(r, r[:3])], "next_token"),
        "path is [B, G+2]": ([Verdict(r, r), TreeVerdict(r, r, jnp.zeros((4, 5), jnp.int32))],
                             "path"),
        "lengths is [B, 1]": ([LoopResult(i, r[:, None], r, r, i, i)], "lengths"),
        "accepted's G differs from reached's": ([LoopResult(i, r, r, r, i, i[:, :2])],
                                                "reached"),
        "hidden has no C axis": ([LoopView(i, r, cache, f, i)], "hidden"),
        "positions' T differs from hidden's": ([LoopView(i, r, cache, f[None], i[:, :2])],
                                               "positions"),
        "logits' B differs from tokens'": ([LoopView(i, r, cache, None, i, (), f[:3, 0])],
                                           "logits"),
    }


@pytest.mark.parametrize("what", list(_bad_objects()))
def test_the_check_catches_a_wrong_shape(what):
    """The check can fail: every one of these objects builds (the library checks nothing at
    run time) and the check names the wrong field. (For the wrong TreeVerdict, G = 3 is
    bound first: path's G+1 is computed from it.)"""
    objs, field = _bad_objects()[what]
    with jaxtyped("context"):
        if what.startswith("path"):
            assert isinstance(jnp.zeros((4, 3), jnp.int32), Int[Array, "B G"])
        for ok in objs[:-1]:
            check_fields(ok)
        with pytest.raises(AssertionError, match=rf"\.{field}: .* is not"):
            check_fields(objs[-1])


def test_the_annotations_change_nothing_under_jit():
    """The annotations are strings that only get_type_hints evaluates: a jitted function
    of an annotated object sees the same pytree (same structure, static fields in the
    treedef, hashable) and returns it unchanged."""
    i = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    view = LoopView(i, i[:, 0], None, None, i, (4, 2))
    tree = DraftTree(i, i, i, i > 0)
    out_view, out_tree = jax.jit(lambda v, t: (v, t))(view, tree)
    assert jax.tree.structure(out_view) == jax.tree.structure(view)
    assert jax.tree.structure(out_tree) == jax.tree.structure(tree)
    assert out_view.prefill_sizes == (4, 2) and out_tree.q is None
    assert hash(jax.tree.structure(view)) == hash(jax.tree.structure(out_view))
    np.testing.assert_array_equal(out_view.pending, view.pending)
