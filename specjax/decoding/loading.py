"""Loading a target and a drafter for decoding, as decode.py does, from plain arguments.

    from specjax import load_target, load_drafter, read_prompts
    from specjax.decoding.engine import Engine

    target = load_target("checkpoints/demo/target")            # dtype "auto": f32 on CPU
    prompts = read_prompts(target.tokenizer, target.cfg.vocab_size, prompt="def f(x):")
    d = load_drafter("checkpoints/demo/drafters/eagle3", target)  # or None: the default
    engine = Engine(target.model, drafter=d.drafter, drafter_params=d.params,
                    max_length=256, eos_token_ids=target.cfg.eos_token_ids)
    out = engine.run([ids for _, ids in prompts], 128, jax.random.key(0))

Nothing here reads or writes an argparse namespace, and no function changes its
arguments. jax is imported inside the functions, so importing this module (and
`specjax`) stays cheap for tools that never decode.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

# The repository checkout: the bundled demo lives in its checkpoints/demo.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_DIR = os.path.join(ROOT, "checkpoints", "demo")
DEMO_TARGET = os.path.join(DEMO_DIR, "target")
DEMO_PROMPTS = os.path.join(DEMO_DIR, "prompts.jsonl")
# The default drafter: the first of these under DEMO_DIR that exists.
DEMO_DRAFTERS = ("drafters/eagle3", "drafters/block", "draft")
DEFAULT_GAMMA = 4  # n-gram and draft LM (learned drafters default to their trained G)


class Target(NamedTuple):
    """A loaded target: `model` (a `specjax.models.model.Transformer`), its `cfg`
    (`specjax.models.config.ModelConfig`), its `tokenizer` (transformers' AutoTokenizer, or None
    where the directory has no tokenizer files), the directory `path` and the parameter
    `dtype` (a jnp dtype) it was loaded with."""

    model: Any
    cfg: Any
    tokenizer: Any
    path: str
    dtype: Any


class LoadedDrafter(NamedTuple):
    """What `load_drafter` resolved: `drafter` and `params` for `specjax.decoding.engine.Engine`
    (both None for "none"), `name` (the drafter argument, or the default drafter it
    chose: a directory or "ngram") and `gamma` (the G it uses: the given one, a learned
    drafter's trained G, else DEFAULT_GAMMA; None for "none")."""

    drafter: Any
    params: Any
    name: str
    gamma: int | None


def default_drafter() -> str:
    """The default drafter: the first of DEMO_DRAFTERS under DEMO_DIR, else "ngram"."""
    found = [d for d in DEMO_DRAFTERS if os.path.isdir(os.path.join(DEMO_DIR, d))]
    return os.path.join(DEMO_DIR, found[0]) if found else "ngram"


def resolve_dtype(dtype):
    """"auto" -> float32 on CPU, bfloat16 on TPU/GPU; "float32" / "bfloat16" -> that jnp
    dtype; anything else (a jnp dtype) is returned as it is."""
    from specjax.dtypes import backend_default, parse_dtype

    if isinstance(dtype, str):
        return backend_default() if dtype == "auto" else parse_dtype(dtype)
    return dtype


def flag_dtype(name, auto=None):
    """A dtype flag's value ("auto", "float32", "bfloat16") -> a jnp dtype; "auto" -> `auto`.
    --matmul-dtype: auto None (the model's --dtype); --drafter-dtype: auto bfloat16. A
    value that is not a string (a jnp dtype, or None) is returned as it is."""
    from specjax.dtypes import parse_dtype

    if not isinstance(name, str):
        return name
    return auto if name == "auto" else parse_dtype(name)


def drafter_matmul_dtype(name):
    """--drafter-dtype -> the matmul dtype for make_drafter (auto: bfloat16)."""
    import jax.numpy as jnp

    return flag_dtype(name, auto=jnp.bfloat16)


def load_target(path: str = DEMO_TARGET, *, dtype="auto", matmul_dtype="auto", cfg=None,
                tokenizer="auto") -> Target:
    """The target in HF checkpoint directory `path` (Qwen3 / Llama-3), as decode.py loads
    --target.

    Args:
      dtype: "auto" (float32 on CPU, bfloat16 on TPU/GPU), "float32", "bfloat16" or a jnp
        dtype: the parameters' dtype.
      matmul_dtype: "auto" (= dtype), "float32", "bfloat16" or a jnp dtype / None: the
        weight matrices' dtype (`specjax.models.checkpoint.load_model`).
      cfg: its ModelConfig when the caller has already read config.json (else read here).
      tokenizer: "auto" loads the directory's tokenizer (None when it has none); any
        other value (a tokenizer already loaded, or None) is used as it is.
    Raises: SpecjaxError as `specjax.models.checkpoint.load_model` and `load_tokenizer`.
    """
    from specjax.models.checkpoint import load_model, load_tokenizer
    from specjax.models.config import ModelConfig

    dtype = resolve_dtype(dtype)
    if cfg is None:
        cfg = ModelConfig.from_dir(path)
    if isinstance(tokenizer, str) and tokenizer == "auto":
        tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=dtype, matmul_dtype=flag_dtype(matmul_dtype), cfg=cfg)
    return Target(model, cfg, tokenizer, path, dtype)


def load_learned_drafter(path, target, target_dir, gamma, sampling, dtype, matmul_dtype=None,
                         draft_vocab="full", stop_below=0.0, config=None):
    """(drafter, params) from a drafter directory written by train.py, checked against the
    target (a `specjax.models.model.Transformer` loaded from `target_dir`): same shapes, and
    trained against these weights (the fingerprint recorded at export). draft_vocab:
    "auto" drafts over the directory's hot vocabulary (draft_vocab.json,
    `specjax.drafters.vocab`) when it has one, "full" over all ids. stop_below: early
    stop of drafting (`specjax.drafters.make_drafter`). config: the directory's
    config.json when the caller has read it already (else read here).
    Raises SpecjaxError naming both directories otherwise."""
    from flax import nnx

    from specjax.drafters import build_network, make_drafter
    from specjax.drafters.io import load_drafter as read_drafter
    from specjax.errors import SpecjaxError
    from specjax.models.checkpoint import fingerprint

    dcfg, params, record = read_drafter(path, dtype=dtype, config=config)
    trained_on = record.get("path", "an unrecorded target")
    recorded = record.get("weights_fingerprint")
    if recorded is not None and recorded != fingerprint(target_dir):
        raise SpecjaxError(f"drafter {path} was trained against target {trained_on}, not "
                           f"--target {target_dir} (other weights); pass --target "
                           f"{trained_on} or train a drafter for this target")
    try:
        dcfg.check_target(target.cfg, where=f"drafter {path}")
    except SpecjaxError as e:
        raise SpecjaxError(f"{e}: it was trained against {trained_on}, not --target "
                           f"{target_dir}") from None
    net = build_network(dcfg, dtype=dtype, rngs=nnx.Rngs(0))
    nnx.update(net, params)
    hot = None
    if draft_vocab == "auto":
        from specjax.drafters.vocab import load_draft_vocab

        hot = load_draft_vocab(path, target.cfg.vocab_size)
    return make_drafter(dcfg, net, target, gamma=gamma, sampling=sampling,
                        matmul_dtype=matmul_dtype, draft_vocab=hot, stop_below=stop_below)


# ----------------------------------------------------------------------------- sources

class DrafterOptions(NamedTuple):
    """`load_drafter`'s keyword arguments as a source's `load` gets them (sampling and
    dtype resolved: a SamplingParams and a jnp dtype)."""

    gamma: int | None
    sampling: Any
    dtype: Any
    matmul_dtype: Any
    draft_vocab: str
    draft_stop: float
    verify: str | None
    num_drafts: int
    tree_nodes: int | None
    draft_window: int | None
    draft_reuse: bool


class DrafterSource:
    """One kind of --drafter value, as `specjax.drafters.registry.DrafterKind` is one kind
    of learned drafter: subclass, set the attributes, implement `matches` and `load`,
    and `register_source` an instance.

    Attributes:
      name: what the source is called in messages.
      learned: a drafter directory written by train.py: --draft-stop and --draft-reuse
        apply (the adapter checks its kind); other sources refuse both.
      window: whether --draft-window may apply (False: refused before loading; True:
        applied to the loaded adapter, refused there if it has no `window` field).
    """

    name = ""
    learned = False
    window = True

    def matches(self, spec: str, config: dict | None) -> bool:
        """Whether --drafter `spec` is this source; config: the JSON object in
        spec/config.json (`directory_config`), None where there is none."""
        raise NotImplementedError

    def load(self, spec: str, config: dict | None, target: Target,
             opts: DrafterOptions) -> LoadedDrafter:
        """The loaded drafter (before --draft-window, which `load_drafter` applies).
        Raises SpecjaxError (one line)."""
        raise NotImplementedError


class NoDrafter(DrafterSource):
    """"none": autoregressive decoding (drafter and params None)."""

    name, window = "none", False

    def matches(self, spec, config):
        return spec == "none"

    def load(self, spec, config, target, opts):
        return LoadedDrafter(None, None, spec, None)


class NgramSource(DrafterSource):
    """"ngram": prompt lookup (`specjax.drafters.ngram`)."""

    name, window = "ngram", False

    def matches(self, spec, config):
        return spec == "ngram"

    def load(self, spec, config, target, opts):
        from specjax.drafters.ngram import NgramDrafter

        G = opts.gamma or DEFAULT_GAMMA
        drafter = NgramDrafter(G, target.cfg.vocab_size, sampling=opts.sampling)
        return LoadedDrafter(drafter, (), spec, G)


class LogitSpecSource(DrafterSource):
    """"logitspec": a retrieval draft tree (`specjax.drafters.logitspec`)."""

    name, window = "logitspec", False

    def matches(self, spec, config):
        return spec == "logitspec"

    def load(self, spec, config, target, opts):
        from specjax.drafters.logitspec import LogitSpecDrafter
        from specjax.errors import SpecjaxError

        if opts.verify == "block" and not opts.sampling.greedy:
            raise SpecjaxError("--drafter logitspec: its retrieval tree is not K i.i.d. "
                               "drafts, so --verify block does not apply when sampling; "
                               "pass --verify token")
        if opts.num_drafts > 1:
            raise SpecjaxError(f"--drafter logitspec builds its own draft tree; "
                               f"--num-drafts {opts.num_drafts} does not apply (leave it "
                               f"at 1)")
        G = opts.gamma or DEFAULT_GAMMA
        drafter = LogitSpecDrafter.create(target.cfg.vocab_size, G, sampling=opts.sampling,
                                          **({} if opts.tree_nodes is None
                                             else {"tree_nodes": opts.tree_nodes}))
        return LoadedDrafter(drafter, (), spec, G)


class LearnedSource(DrafterSource):
    """A drafter directory written by train.py (config.json's "format" is
    `specjax.drafters.config.FORMAT`): eagle3, kv, hybrid, block, medc."""

    name, learned = "learned drafter", True

    def matches(self, spec, config):
        from specjax.drafters.config import FORMAT

        return config is not None and config.get("format") == FORMAT

    def load(self, spec, config, target, opts):
        import dataclasses

        from specjax.errors import SpecjaxError

        drafter, dparams = load_learned_drafter(
            spec, target.model, target.path, opts.gamma, opts.sampling, opts.dtype,
            matmul_dtype=drafter_matmul_dtype(opts.matmul_dtype),
            draft_vocab=opts.draft_vocab, stop_below=opts.draft_stop, config=config)
        if opts.draft_reuse:
            if drafter.cfg.kind != "medc":
                raise SpecjaxError(f"{_no_reuse(spec)} (a {drafter.cfg.kind} drafter)")
            drafter = dataclasses.replace(drafter, reuse=True)
        return LoadedDrafter(drafter, dparams, spec, drafter.gamma)


class ExternalSource(DrafterSource):
    """An EAGLE-3 or DFlash head trained elsewhere (`specjax.drafters.external`)."""

    name = "external head"

    def matches(self, spec, config):
        if config is None:
            return False
        from specjax.drafters.external import layout_of

        return layout_of(config) is not None

    def load(self, spec, config, target, opts):
        from specjax.drafters.external import load_external

        drafter, dparams = load_external(
            spec, target.model, gamma=opts.gamma, sampling=opts.sampling, dtype=opts.dtype,
            matmul_dtype=drafter_matmul_dtype(opts.matmul_dtype),
            draft_vocab=opts.draft_vocab, config=config)
        return LoadedDrafter(drafter, dparams, spec, drafter.gamma)


class DraftLMSource(DrafterSource):
    """Any other directory: an HF draft LM (`specjax.drafters.draft_lm`), read by
    `specjax.models.checkpoint.load_model`, whose errors name what is wrong with it (a
    missing directory or config.json included). The fallback: it matches everything."""

    name = "draft LM"

    def matches(self, spec, config):
        return True

    def load(self, spec, config, target, opts):
        from specjax.drafters.draft_lm import DraftLMDrafter
        from specjax.models.checkpoint import load_model

        G = opts.gamma or DEFAULT_GAMMA
        drafter, dparams = DraftLMDrafter.create(load_model(spec, dtype=opts.dtype), G,
                                                 opts.sampling, target.cfg.vocab_size)
        return LoadedDrafter(drafter, dparams, spec, G)


# The sources in the order they are asked; the draft LM, which takes any directory, last.
_SOURCES: list[DrafterSource] = [NoDrafter(), NgramSource(), LogitSpecSource(),
                                 LearnedSource(), ExternalSource()]
_FALLBACK = DraftLMSource()


def register_source(source: DrafterSource) -> DrafterSource:
    """Adds a drafter source, asked after the built-in ones and before the draft LM
    fallback. Raises ValueError for a name already registered."""
    if any(s.name == source.name for s in sources()):
        raise ValueError(f"drafter source {source.name!r} is already registered")
    _SOURCES.append(source)
    return source


def sources() -> tuple[DrafterSource, ...]:
    """The registered drafter sources, in the order `find_source` asks them."""
    return (*_SOURCES, _FALLBACK)


def find_source(spec: str, config: dict | None) -> DrafterSource:
    """The first source that `matches` --drafter `spec` (the draft LM if none does)."""
    return next(s for s in sources() if s.matches(spec, config))


def directory_config(path: str) -> dict | None:
    """The JSON object in `path`/config.json, or None (no such directory or file, not
    readable JSON, not an object): what the sources match on. Never raises; the
    source that loads the directory reports what is wrong with it."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _no_reuse(name: str) -> str:
    return (f"--draft-reuse: only medc drafters (whose hidden-state chain reads no "
            f"token) reuse their drafted hidden states, not --drafter {name}")


def load_drafter(spec: str | None, target: Target, *, gamma: int | None = None,
                 sampling=None, dtype=None, matmul_dtype="auto", draft_vocab: str = "auto",
                 draft_stop: float = 0.0, verify: str | None = None,
                 num_drafts: int = 1, tree_nodes: int | None = None,
                 draft_window: int | None = None, draft_reuse: bool = False) -> LoadedDrafter:
    """The drafter `spec` names, for `target`, as decode.py's --drafter takes it.

    Args:
      spec: None (the default: the first bundled demo drafter, else "ngram"), "none"
        (autoregressive: drafter and params None), "ngram" (prompt lookup),
        "logitspec" (a retrieval draft tree with next-next-token guesses from the target's
        logits, `specjax.drafters.logitspec`), or a
        directory: an EAGLE-3 or DFlash head trained elsewhere (`drafters.external`), a
        specjax drafter written by train.py (eagle3, kv, hybrid, block), or an HF draft
        LM, told apart by its config.json (read once here; the sources: `sources()`).
      target: from `load_target` (a learned drafter is checked against its weights).
      gamma: G (None: a learned or external drafter's own, else DEFAULT_GAMMA).
      sampling: SamplingParams (None: greedy).
      dtype: the drafter's parameter dtype (None: the target's; "auto", "float32",
        "bfloat16" as `resolve_dtype`).
      matmul_dtype: a learned or external drafter's matmul inputs: "auto" (bfloat16),
        "float32", "bfloat16", or a jnp dtype / None (`drafters.make_drafter`).
      draft_vocab: "auto" (a directory's draft_vocab.json when it has one) or "full".
      draft_stop: eagle3/hybrid early stop of drafting (0: off).
      verify, num_drafts: the loop's rule and drafts per step, where the caller passes
        them: "logitspec" needs verify "token" when sampling (its tree is not K i.i.d.
        drafts) and makes its own tree (num_drafts 1).
      tree_nodes: "logitspec"'s node budget N (None: its default).
      draft_window: a learned or external drafter reads only the last `draft_window`
        context positions at decoding (`LearnedDrafter.window`; None: all of them).
      draft_reuse: a medc drafter starts each step's chain from the previous step's
        drafted hidden states where they cover the new positions
        (`specjax.drafters.eagle3.Eagle3Drafter.propose`, docs/medc.md); output unchanged.
    Returns: LoadedDrafter(drafter, params, name, gamma); the arguments are not changed.
    Raises: SpecjaxError (one line) for a directory that cannot be loaded or does not fit
      the target, a draft_stop given to a drafter that cannot stop early, a draft_window
      below 1 or given to a drafter without a context window (none, ngram, logitspec, a
      draft LM), draft_reuse for a drafter other than medc, or "logitspec" with verify
      "block" at temperature > 0 or num_drafts > 1.
    """
    import dataclasses

    from specjax.core.sampling import SamplingParams
    from specjax.errors import SpecjaxError

    sampling = SamplingParams() if sampling is None else sampling
    dtype = target.dtype if dtype is None else resolve_dtype(dtype)
    name = default_drafter() if spec is None else spec
    config = directory_config(name)
    source = find_source(name, config)
    if draft_stop and not source.learned:
        raise SpecjaxError(f"--draft-stop: only learned eagle3, hybrid and medc drafters "
                           f"stop early, not --drafter {name}")
    no_window = (f"--draft-window: only learned drafters (eagle3, medc, hybrid, kv, block, "
                 f"external heads) read a context window, not --drafter {name}")
    if draft_window is not None:
        if draft_window < 1:
            raise SpecjaxError(f"--draft-window={draft_window} must be >= 1")
        if not source.window:
            raise SpecjaxError(no_window)
    if draft_reuse and not source.learned:
        raise SpecjaxError(_no_reuse(name))
    opts = DrafterOptions(gamma, sampling, dtype, matmul_dtype, draft_vocab, draft_stop,
                          verify, num_drafts, tree_nodes, draft_window, draft_reuse)
    loaded = source.load(name, config, target, opts)
    if draft_window is None or loaded.drafter is None:
        return loaded
    if not any(f.name == "window" for f in dataclasses.fields(loaded.drafter)):
        raise SpecjaxError(no_window)  # a draft LM
    return loaded._replace(drafter=dataclasses.replace(loaded.drafter, window=draft_window))


__all__ = ["DEFAULT_GAMMA", "DEMO_DIR", "DEMO_DRAFTERS", "DEMO_PROMPTS", "DEMO_TARGET",
           "DrafterOptions", "DrafterSource", "LoadedDrafter", "Target", "default_drafter",
           "directory_config", "drafter_matmul_dtype", "find_source", "flag_dtype",
           "load_drafter", "load_learned_drafter", "load_target", "register_source",
           "resolve_dtype", "sources"]
