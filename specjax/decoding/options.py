"""`DecodeConfig`: every option of a decoding session, validated once.

decode.py's flags are generated from these fields (`add_arguments`), so the library call
and the command line take the same options with the same defaults and the same errors:

    cfg = DecodeConfig(drafter="checkpoints/demo/drafters/eagle3", max_new_tokens=64)
    session = specjax.decoding.session.build(cfg)

Errors are one-line `SpecjaxError`s that name the flag (decode.py prints them and exits
2). Output files and what to print are decode.py's own flags, not options here.
"""

from __future__ import annotations

import argparse
import dataclasses

from specjax.decoding.loading import DEMO_TARGET
from specjax.errors import SpecjaxError

DTYPES = ("auto", "float32", "bfloat16")


def option(default, help: str, **flag):
    """A DecodeConfig field and its decode.py flag (argparse keywords in `flag`)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def _gamma_arg(text: str):
    """--gamma: a positive draft length, "auto" or "fixed"."""
    if text in ("auto", "fixed"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a draft length, auto or "
                                         "fixed") from None


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The options of one decoding session (decode.py's flags; see each field's help,
    `decode.py --help`). `gamma` is resolved on construction: "auto" (adaptive, the default
    for a drafter of one chain), "fixed" (the drafter's own G: draft trees, --num-drafts,
    logitspec, --partial-verify, --verify fly, --drafter none) or a draft length.

    Raises: SpecjaxError (one line naming the flag) for options that contradict each
    other or are out of range."""

    target: str = option(DEMO_TARGET, "HF checkpoint directory of the target (default: "
                         "the bundled demo)")
    drafter: str | None = option(
        None, "none (autoregressive), ngram (prompt lookup), logitspec (a prompt-lookup tree "
        "with next-next-token guesses from the target's logits; sampling needs --verify "
        "token), a drafter directory written by train.py ({kinds}), or a draft LM directory "
        "(default: the best bundled demo drafter)")
    max_new_tokens: int = option(128, "new tokens per prompt")
    gamma: int | str | None = option(
        None, "draft length. auto (the default for a drafter of one chain): every step picks "
        "its length from 0 (an autoregressive step), 1, 2, 3, 5 and the drafter's G by "
        "expected tokens per ms, from a cost table measured once per setting, and a batch "
        "runs without the drafter when speculation is not predicted to win by more than the "
        "timing noise (docs/adaptive.md); fixed: always the G a learned drafter was trained "
        "for (else 4; the default for draft trees, --partial-verify and --verify fly); N: "
        "always N",
        type=_gamma_arg, metavar="N|auto|fixed")
    cost_table: str | None = option(
        None, "--gamma auto: ms per step at each draft length and the baseline a batch is "
        "priced against without the drafter (JSON); read if it exists, else measured on the "
        "batch of median prompt length and written here (default: measured once per "
        "setting, cached in the compile cache, unless its repeated rounds spread more than "
        "50%%: a busy machine)", metavar="FILE")
    temperature: float = option(0.0, "0 = greedy")
    top_k: int = option(0, "0 = off")
    top_p: float = option(1.0, "1 = off")
    verify: str = option(
        "block", "verification rule when sampling (greedy at temperature 0); fly = LOSSY FLy "
        "loose verification at temperature 0: a draft token that is not the target's choice "
        "is accepted where the target is unsure and agrees with the drafts after it (the "
        "output is NOT the target's; docs/long_context.md)", choices=("token", "block", "fly"))
    fly_window: int | None = option(
        None, "--verify fly (LOSSY): a mismatch is accepted when the next W-1 drafts match "
        "the target (default 6, the authors')", type=int, metavar="W")
    fly_entropy: float | None = option(
        None, "--verify fly (LOSSY): never accept a mismatch where the target's top-3 "
        "entropy is below this (default 0.3; inf = greedy)", type=float, metavar="NATS")
    partial_verify: bool = option(
        False, "LOSSY SpecPV partial verification for long contexts: past a context "
        "threshold most verify forwards attend only to a partial KV cache (sink blocks, the "
        "blocks that score highest against the last full pass's queries, a recent window), "
        "with a full verification every 20 accepted tokens (the output is NOT the target's; "
        "docs/long_context.md)")
    partial_budget: int | None = option(
        None, "--partial-verify (LOSSY): KV slots per row and head in the partial cache, "
        "sink + retrieval + window (default 4096); partial steps start once every prompt is "
        "longer than this plus 20", type=int, metavar="TOKENS")
    num_drafts: int = option(
        1, "drafts per step, verified as one draft tree of 1 + K*G nodes (at temperature 0 "
        "the drafter's top-K first tokens, each continued greedily; above it K independent "
        "samples); 1 = one chain", metavar="K")
    tree_topk: int | None = option(
        None, "EAGLE-2 dynamic draft tree: expand the top-K children of the K best nodes per "
        "depth (eagle3, hybrid, kv, block, draft LM); needs --tree-nodes; sampling verifies "
        "with --verify token", type=int, metavar="K")
    tree_nodes: int | None = option(
        None, "node budget of the --tree-topk tree (root included): the N-1 best candidates "
        "by cumulative draft log-probability; alone, --drafter logitspec's node budget "
        "(default 8)", type=int, metavar="N")
    regex: str | None = option(
        None, "structured output: every output must match this regex (Rust regex syntax; "
        "outlines-core compiles it into a token automaton over the target's tokenizer). "
        "Lossless: the output is exactly the target's constrained decoding "
        "(docs/structured.md); end of sequence is allowed only where the pattern is complete. "
        "Prompts "
        "with their own \"regex\" or \"json_schema\" field keep theirs", metavar="PATTERN")
    json_schema: str | None = option(
        None, "structured output: every output must be JSON valid against this JSON schema "
        "file (turned into a regex by outlines-core; as --regex otherwise)", metavar="FILE")
    step_timing: bool = option(
        False, "also time one step's parts (draft ms, verify ms: compiled and run outside "
        "the loop on the first batch, an estimate; costs three more compilations)")
    batch_size: int = option(1, "prompts decoded together in one compiled loop")
    seed: int = option(0, "PRNG seed")
    ignore_eos: bool = option(False, "generate exactly --max-new-tokens")
    max_length: int | None = option(
        None, "prompt + new tokens per row, at most (default: the longest prompt rounded "
        "up to a multiple of 16, the compiled prompt width, + --max-new-tokens)", type=int)
    allow_long_context: bool = option(
        False, "allow --max-length beyond the target's max_position_embeddings")
    dtype: str = option("auto", "auto: float32 on CPU, bfloat16 on TPU/GPU", choices=DTYPES)
    matmul_dtype: str = option(
        "auto", "the target's matmul inputs with --dtype float32: bfloat16 keeps its weight "
        "matrices in bf16 and accumulates in f32 (a few-token verification then costs about "
        "1.2 one-token forwards on CPU, not 2.3); both engines use it, so their outputs "
        "match; it is a slightly different model from the f32 run (docs/decode.md). auto: "
        "--dtype", choices=DTYPES)
    drafter_dtype: str = option(
        "auto", "matmul inputs of a learned drafter ({kinds}); the target and so the output "
        "are unaffected. auto: bfloat16 (bf16 inputs, f32 accumulation; faster on CPU, the "
        "TPU/GPU default anyway)", choices=DTYPES)
    draft_vocab: str = option(
        "auto", "learned drafters: auto = draft over the hot vocabulary in the drafter "
        "directory's draft_vocab.json when there is one (a smaller LM-head matmul per draft "
        "step; output unchanged), full = all ids", choices=("auto", "full"))
    draft_stop: float = option(
        0.0, "{stoppers} drafters: stop drafting a step once every row's chain confidence "
        "(product of its drafts' top-1 draft probabilities) is below this; the rest of the "
        "G positions get a filler the target rejects unless it agrees (output unchanged). "
        "0: always draft G")
    draft_window: int | None = option(
        None, "learned drafters: read only the last W context positions of the target's "
        "hidden states or K/V when drafting (long contexts: the drafter's attention stops "
        "growing with the context). Output unchanged: the target verifies every draft "
        "(default: all)", type=int, metavar="W")
    draft_reuse: bool = option(
        False, "medc drafters (Make Every Draft Count, docs/medc.md): start each step's "
        "draft chain from the previous step's drafted hidden states where they cover the "
        "new positions, skipping those draft forwards. Output unchanged: the target "
        "verifies every draft")
    kernels: str = option(
        "auto", "verification: pallas = the fused Pallas kernel from the target's logits "
        "(interpret mode on CPU: slow), reference = its jnp twin (identical output for a "
        "seed), off = specjax.decoding.verify on probabilities. pallas also runs the "
        "target's and the learned drafters' attention through pallas_kernels.attention; "
        "attention = those attention kernels with verification as off. auto: the "
        "backend's entry in specjax/backend_choices.py (attention on GPU, measured; pallas "
        "on TPU, unmeasured; reference on CPU; docs/accelerators.md)",
        choices=("auto", "off", "reference", "pallas", "attention"))
    exact: bool = option(
        False, "batch-invariant target forwards (specjax/models/invariant.py): every token "
        "row is computed by the same program in a verify forward as in a one-token step, "
        "so greedy output equals autoregressive decoding bit for bit in bf16 too (the "
        "speculative and the autoregressive run both take it). Slower: token rows go in "
        "tiles of 8, one tile after another. Chains only; jnp attention (--kernels "
        "auto/off/reference)")
    mesh: str | None = option(
        None, "data=D,model=M: shard the target's weights and KV cache over M devices "
        "(heads, F, V) and batch rows over D (--batch-size a multiple of D); default: one "
        "device")
    compare_ar: bool = option(
        True, "with a drafter, also run autoregressive decoding (interleaved) and report the "
        "speedup (default: on)", action=argparse.BooleanOptionalAction)
    compile_cache: str | None = option(
        None, "jax's persistent compilation cache: a later run with the same shapes loads "
        "the compiled loops instead of compiling them (default: $JAX_COMPILATION_CACHE_DIR "
        "if set, else ~/.cache/specjax/jax; none: off)", metavar="DIR|none")

    def __post_init__(self):
        if self.gamma == "auto" and self.drafter == "none":
            raise SpecjaxError("--gamma auto needs a drafter (--drafter none decodes "
                               "autoregressively)")
        if self.gamma is None:  # auto for one chain; trees and no drafter: fixed
            fixed = (self.trees or self.partial_verify or self.verify == "fly"
                     or self.drafter == "none")
            object.__setattr__(self, "gamma", "fixed" if fixed else "auto")
        _check(self)

    @property
    def trees(self) -> bool:
        """A draft tree per step (--num-drafts, --tree-topk or logitspec)."""
        return self.num_drafts > 1 or self.tree_topk is not None or self.drafter == "logitspec"

    @property
    def constrained(self) -> bool:
        """--regex or --json-schema (prompts may also carry their own)."""
        return self.regex is not None or self.json_schema is not None

    @property
    def adaptive(self) -> bool:
        return self.gamma == "auto"

    @property
    def draft_length(self) -> int | None:
        """The fixed draft length asked for (None: the drafter's own G, or auto)."""
        return self.gamma if isinstance(self.gamma, int) else None


def _check(c: DecodeConfig) -> None:
    """The checks that need no file read (one line naming the flag)."""
    if isinstance(c.gamma, int) and (isinstance(c.gamma, bool) or c.gamma < 1):
        raise SpecjaxError(f"--gamma={c.gamma} must be >= 1 (or auto)")
    if c.gamma not in ("auto", "fixed") and not isinstance(c.gamma, int):
        raise SpecjaxError(f"--gamma={c.gamma!r}: a draft length, auto or fixed")
    if c.adaptive and c.trees:
        raise SpecjaxError("--gamma auto adapts a chain's draft length; draft trees "
                           "(--num-drafts, --tree-topk, logitspec) take a fixed --gamma")
    if c.cost_table is not None and not c.adaptive:
        raise SpecjaxError("--cost-table goes with --gamma auto")
    if not c.temperature >= 0:
        raise SpecjaxError(f"--temperature={c.temperature} must be >= 0 (0 = greedy)")
    if not 0 < c.top_p <= 1:
        raise SpecjaxError(f"--top-p={c.top_p} must be in (0, 1]")
    if c.top_k < 0:
        raise SpecjaxError(f"--top-k={c.top_k} must be >= 0 (0 = off)")
    if c.max_new_tokens < 1:
        raise SpecjaxError(f"--max-new-tokens={c.max_new_tokens} must be >= 1")
    if c.batch_size < 1:
        raise SpecjaxError(f"--batch-size={c.batch_size} must be >= 1")
    if c.num_drafts < 1:
        raise SpecjaxError(f"--num-drafts={c.num_drafts} must be >= 1 (1 = one chain)")
    pair = ("--tree-topk and --tree-nodes go together (an EAGLE-2 tree of N nodes from the "
            "top-K children per depth)")
    if c.tree_topk is None and c.tree_nodes is not None and c.drafter != "logitspec":
        raise SpecjaxError(pair + "; --tree-nodes alone sets --drafter logitspec's node budget")
    if c.tree_topk is not None and c.tree_nodes is None:
        raise SpecjaxError(pair)
    if c.tree_topk is not None:
        if c.num_drafts > 1:
            raise SpecjaxError("--tree-topk and --num-drafts are two kinds of tree: pass one")
        if c.temperature > 0 and c.verify == "block":
            raise SpecjaxError("--tree-topk with sampling needs --verify token (block "
                               "verification of several drafts needs independent drafts: "
                               "--num-drafts)")
    if c.verify != "fly" and (c.fly_window is not None or c.fly_entropy is not None):
        raise SpecjaxError("--fly-window and --fly-entropy go with --verify fly")
    if c.exact:
        if c.trees:
            raise SpecjaxError("--exact verifies one chain: no --num-drafts, --tree-topk or "
                               "logitspec")
        if c.kernels in ("pallas", "attention"):
            raise SpecjaxError(f"--exact takes the jnp attention: --kernels {c.kernels} "
                               "cannot run with it (auto, off or reference)")
    if c.partial_budget is not None and not c.partial_verify:
        raise SpecjaxError("--partial-budget goes with --partial-verify")
    lossy = [m for m, on in (("--verify fly", c.verify == "fly"),
                             ("--partial-verify", c.partial_verify)) if on]
    for mode in lossy:
        if c.trees:
            raise SpecjaxError(f"{mode} (lossy) verifies one chain: no --num-drafts, "
                               "--tree-topk or logitspec")
        if c.drafter == "none":
            raise SpecjaxError(f"{mode} needs a drafter (--drafter none decodes "
                               "autoregressively)")
        if c.exact:
            raise SpecjaxError("--exact keeps the output identical to autoregressive "
                               f"decoding: not with the lossy {mode}")
    if c.verify == "fly":
        if c.adaptive:  # FLy's published figures are for a fixed G = 7; under auto the
            # schedule's short lengths leave its window nothing to act on
            raise SpecjaxError("--verify fly (lossy) drafts a fixed length: no --gamma auto "
                               "(the default with --verify fly is the drafter's G)")
        if c.temperature > 0:
            raise SpecjaxError("--verify fly (lossy) runs at --temperature 0 only")
        if c.fly_window is not None and c.fly_window < 1:
            raise SpecjaxError(f"--fly-window={c.fly_window} must be >= 1")
        if c.fly_entropy is not None and not c.fly_entropy >= 0:
            raise SpecjaxError(f"--fly-entropy={c.fly_entropy} must be >= 0 (nats)")
    if c.partial_verify:
        if c.adaptive:
            raise SpecjaxError("--partial-verify drafts a fixed length: no --gamma auto")
        if c.partial_budget is not None:
            from specjax.decoding.partial import PartialVerify

            try:
                PartialVerify(budget=c.partial_budget)
            except ValueError as e:
                raise SpecjaxError(f"--partial-budget: {e}") from None
    if c.regex is not None or c.json_schema is not None:
        if c.regex is not None and c.json_schema is not None:
            raise SpecjaxError("--regex and --json-schema: give one constraint")
        if not c.regex and c.json_schema is None:
            raise SpecjaxError("--regex: the pattern is empty")
    for mode in lossy:  # structured output keeps the target's constrained distribution
        if c.constrained:
            raise SpecjaxError(f"{mode} (lossy) cannot run under a constraint (--regex, "
                               "--json-schema or a prompt's own): the constrained output "
                               "is lossless only")
    if c.constrained and c.ignore_eos:
        raise SpecjaxError("--ignore-eos: a constrained row ends where its automaton "
                           "accepts, at the end-of-sequence token")
    if c.constrained and c.step_timing:
        raise SpecjaxError("--step-timing times the unconstrained step: drop it with "
                           "--regex / --json-schema")
    if c.num_drafts > 1 and c.drafter == "none":
        raise SpecjaxError("--num-drafts needs a drafter (--drafter none decodes "
                           "autoregressively)")
    if c.draft_reuse and (c.num_drafts > 1 or c.tree_topk is not None):
        raise SpecjaxError("--draft-reuse reuses a chain's drafted hidden states: no "
                           "--num-drafts or --tree-topk (medc's trees share one chain "
                           "without it)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """decode.py's flags, one per DecodeConfig field (--max-new-tokens for max_new_tokens,
    ...), with the fields' defaults and help."""
    from specjax.drafters import registry

    names = {"kinds": ", ".join(registry.kinds()),
             "stoppers": "/".join(registry.early_stop_kinds())}
    for f in dataclasses.fields(DecodeConfig):
        meta = dict(f.metadata)
        kw = {"default": f.default, "help": meta.pop("help").format(**names), **meta}
        if isinstance(f.default, bool) and "action" not in kw:
            kw["action"] = "store_true"
        elif "action" not in kw and "type" not in kw and f.default is not None:
            kw["type"] = type(f.default)
        ap.add_argument("--" + f.name.replace("_", "-"), **kw)


def from_args(ns: argparse.Namespace) -> DecodeConfig:
    """The DecodeConfig of parsed flags (the namespace's other entries are ignored)."""
    return DecodeConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(DecodeConfig)})
