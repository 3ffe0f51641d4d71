"""Configuration of the drafters that read the target (docs/design.md section 5), and the
`config.json` of an exported drafter directory.

    cfg = DrafterConfig.for_target(target_cfg, "block", context="kv", num_layers=2)

Every learned drafter here uses the target's attention shapes (N, K, H) and width D, so
that merged target keys and values drop into its attention unchanged, and the target's
embedding and LM head (frozen, not part of the drafter's weights).
"""

from __future__ import annotations

import dataclasses
import json
import os

from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig

CONTEXTS = ("hidden", "kv", "both")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")  # SpecForge's `build_markov_head`
CONFIG_NAME = "config.json"
FORMAT = "specjax-drafter"


def evenly_spaced_layers(num_layers: int, n: int) -> tuple[int, ...]:
    """n target layer indices spread over 1 .. L-3 (DFlash's `build_target_layer_ids`:
    skip the first layer and the last two), clipped to 0 .. L-1 for shallow targets."""
    if n < 1:
        raise SpecjaxError(f"need at least one target layer, got {n}")
    lo, hi = min(1, num_layers - 1), max(min(1, num_layers - 1), num_layers - 3)
    if n == 1:
        return ((lo + hi) // 2,)
    return tuple(int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n))


def kv_layer_set(num_layers: int, n: int) -> tuple[int, ...]:
    """The distinct target layers, ascending, whose K/V a drafter merges: n evenly spaced
    (`evenly_spaced_layers`; a shallow target may give fewer than n)."""
    return tuple(sorted(set(evenly_spaced_layers(num_layers, n))))


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Hyper-parameters of one learned drafter (shape letters: docs/design.md section 2).

    Attributes:
      kind: "eagle3" (hidden states), "kv" (KVShot KV-only), "hybrid" (both, gated),
        "block" (DFlash-style parallel block drafter) or "medc" (eagle3's layout with the
        token injected after the layer, medc.py).
      gamma: G, the draft length it is trained for (decode.py's default --gamma).
      num_layers: Ld, drafter decoder layers (eagle3 and hybrid: 1).
      hidden_size, num_heads, num_kv_heads, head_dim: D, N, K, H: the target's.
      intermediate_size: F of the drafter's SwiGLU MLP.
      vocab_size: V, the target's vocabulary (the drafter drafts over all of it).
      rms_norm_eps, rope_theta: the target's; inv_freq is taken from the target.
      capture: target depths whose residual stream the drafter reads (input of layer d;
        eagle3: the inputs of layers {2, L/2, L-3}; block hidden/both: outputs of Ld
        evenly spaced layers); empty for kv.
      kv_layers: Ls target layers whose K/V are merged into the drafter's memory (kv,
        hybrid, block kv/both); empty otherwise.
      context: block only: "hidden", "kv" or "both".
      mask_token_id: block only: the id whose (frozen) target embedding fills the G
        draft slots of a block; the tokenizer's pad token by default.
      selector_rank: block only: R of DFlash2's path selector (`specjax.drafters.selector`;
        0: none, each block position drafted on its own).
      selector_top_k: block only: K candidates per position the selector scores.
      conv_kernel_size: block only: taps of DFlash2's grouped dynamic causal convolution
        around each layer's attention and MLP (`specjax.drafters.conv`; 0: none,
        DFlash2: 2).
      conv_group_size: block only: channels per group of that convolution's dynamic
        coefficients (DFlash2: 16); hidden_size must be a multiple of it.
      output_multiplier, final_logit_softcapping: block only: the draft logits are
        l * output_multiplier, then tanh(l / c) * c when c = final_logit_softcapping > 0
        (DFlash2's `compute_logits`; defaults 1.0 and 0: unchanged).
      sliding_windows: block only: per drafter layer, the sliding window W of its
        attention (a block query at position p sees context positions s > p - W; 0: the
        whole context); empty: no layer has one (DFlash2's `sliding_attention` layers).
      markov_rank: block only: R of DSpark's Markov head (`specjax.drafters.markov`; 0:
        none): draft position k's logits gain W2 W1[x_{k-1}] (x_{k-1} the token drafted
        before it, the pending token for the first), and the block is drafted left to
        right.
      markov_head_type: block only: "vanilla" (that bias), "gated" (W1[x_{k-1}] gated by
        sigmoid of a linear map of [h_k ; W1[x_{k-1}]]) or "rnn" (a recurrent state over
        the block's positions), SpecForge's three heads.
      confidence_head: block only: DSpark's confidence head, one logit per draft
        position from h_k (and W1[x_{k-1}] with confidence_head_with_markov) whose
        sigmoid predicts that position's acceptance (`BlockDrafter.confidence`).
      confidence_head_with_markov: block only: the confidence head also reads W1[x_{k-1}]
        (needs markov_rank > 0).
      sample_from_anchor: block only: DSpark's block layout: the block is [pending, G-1
        mask tokens] and every slot drafts, slot k the token after position pending + k
        (G slots for G drafts); False: DFlash's [pending, G mask tokens], slots 1..G draft.
      block_causal: block only: attention inside the block is causal (position k sees
        block positions <= k; JetSpec's block-causal head, arXiv 2606.18394 section 2.2;
        `specjax.drafters.attend.Blocks`); False: bidirectional, as DFlash.
      qk_norm: RMSNorm over each head of q and k before RoPE (Qwen3-style, the default);
        False for EAGLE-3 heads trained in Llama layout (SafeAILab/EAGLE, SpecForge).
      target_num_layers: L of the target it was built for (checked at load).
    """

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_num_layers: int
    gamma: int = 7
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    capture: tuple[int, ...] = ()
    kv_layers: tuple[int, ...] = ()
    context: str | None = None
    mask_token_id: int | None = None
    qk_norm: bool = True
    selector_rank: int = 0
    selector_top_k: int = 16
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    sliding_windows: tuple[int, ...] = ()
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = False
    block_causal: bool = False

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "target_num_layers", "gamma",
                     "num_layers"):
            if not is_int(getattr(self, name)):
                raise SpecjaxError(f"drafter {name}={getattr(self, name)!r} must be an integer")
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "target_num_layers"):
            if getattr(self, name) < 1:
                raise SpecjaxError(f"drafter {name}={getattr(self, name)} must be >= 1")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or \
                    v == float("inf"):
                raise SpecjaxError(f"drafter {name}={v!r} must be a positive number")
        for name in ("capture", "kv_layers"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(is_int(x) for x in v):
                raise SpecjaxError(f"drafter {name}={v!r} must be a list of integers")
        if self.mask_token_id is not None and not is_int(self.mask_token_id):
            raise SpecjaxError(f"drafter mask_token_id={self.mask_token_id!r} must be a "
                               "token id or null")
        for name in ("selector_rank", "selector_top_k"):
            if not is_int(getattr(self, name)):
                raise SpecjaxError(f"drafter {name}={getattr(self, name)!r} must be an integer")
        if self.selector_rank < 0 or (self.selector_rank and
                                      not 1 <= self.selector_top_k <= self.vocab_size):
            raise SpecjaxError(f"drafter selector_rank={self.selector_rank} must be >= 0 and "
                               f"selector_top_k={self.selector_top_k} in [1, {self.vocab_size}]")
        if self.selector_rank and self.kind != "block":
            raise SpecjaxError(f"selector_rank is a block drafter setting, not {self.kind}'s")
        self._check_dflash2()
        self._check_dspark()
        if not isinstance(self.qk_norm, bool):
            raise SpecjaxError(f"drafter qk_norm={self.qk_norm!r} must be true or false")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise SpecjaxError(f"drafter num_heads={self.num_heads} must be a multiple of "
                               f"num_kv_heads={self.num_kv_heads} and head_dim="
                               f"{self.head_dim} even")
        from specjax.drafters import registry

        if not registry.is_kind(self.kind):
            raise SpecjaxError(f"drafter kind {self.kind!r}; use one of {registry.kinds()}")
        if self.gamma < 1 or self.num_layers < 1:
            raise SpecjaxError(f"drafter gamma={self.gamma} and num_layers={self.num_layers} "
                               "must be >= 1")
        spec = registry.get(self.kind)
        spec.validate(self)
        if self.context is not None and "context" not in spec.settings:
            owners = "/".join(registry.setting_kinds("context"))
            raise SpecjaxError(f"context={self.context!r} is a {owners} drafter setting")
        if self.uses_hidden and not self.capture:
            raise SpecjaxError(f"{self.kind} drafter needs capture depths")
        if self.uses_kv and not self.kv_layers:
            raise SpecjaxError(f"{self.kind} drafter needs kv_layers")
        for d in self.capture:
            if not 0 <= d <= self.target_num_layers:
                raise SpecjaxError(f"capture depth {d} outside 0..{self.target_num_layers}")
        for layer in self.kv_layers:
            if not 0 <= layer < self.target_num_layers:
                raise SpecjaxError(f"kv layer {layer} outside 0..{self.target_num_layers - 1}")

    def _check_dflash2(self):
        """Validates the DFlash2 layer options (conv, logit transforms, sliding windows)."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and \
                abs(v) != float("inf") and v == v

        k, g = self.conv_kernel_size, self.conv_group_size
        if not is_int(k) or not is_int(g) or k < 0 or g < 1:
            raise SpecjaxError(f"drafter conv_kernel_size={k!r} must be an integer >= 0 and "
                               f"conv_group_size={g!r} >= 1")
        if k and self.hidden_size % g:
            raise SpecjaxError(f"drafter hidden_size={self.hidden_size} must be a multiple of "
                               f"conv_group_size={g}")
        m, cap = self.output_multiplier, self.final_logit_softcapping
        if not is_num(m) or not m > 0 or not is_num(cap) or cap < 0:
            raise SpecjaxError(f"drafter output_multiplier={m!r} must be a positive number "
                               f"and final_logit_softcapping={cap!r} >= 0 (0: off)")
        w = self.sliding_windows
        if not isinstance(w, tuple) or not all(is_int(x) and x >= 0 for x in w) or \
                (w and len(w) != self.num_layers):
            raise SpecjaxError(f"drafter sliding_windows={w!r} must list one window >= 0 per "
                               f"layer ({self.num_layers}; 0: the whole context) or be empty")
        if any(0 < x <= self.gamma for x in w):
            raise SpecjaxError(f"drafter sliding_windows={list(w)}: a window must exceed "
                               f"gamma={self.gamma} (the block of G+1 positions sees itself "
                               "whole)")
        used = [name for name, on in (("conv_kernel_size", k), ("output_multiplier", m != 1),
                                      ("final_logit_softcapping", cap), ("sliding_windows",
                                                                         any(w)))
                if on]
        if used and self.kind != "block":
            raise SpecjaxError(f"{used[0]} is a block drafter setting, not {self.kind}'s")

    def _check_dspark(self):
        """Validates DSpark's options (Markov head, confidence head, block layout)."""
        r, kind = self.markov_rank, self.markov_head_type
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise SpecjaxError(f"drafter markov_rank={r!r} must be an integer >= 0 (0: none)")
        if kind not in MARKOV_HEAD_TYPES:
            raise SpecjaxError(f"drafter markov_head_type={kind!r}; use one of "
                               f"{MARKOV_HEAD_TYPES}")
        for name in ("confidence_head", "confidence_head_with_markov", "sample_from_anchor",
                     "block_causal"):
            if not isinstance(getattr(self, name), bool):
                raise SpecjaxError(f"drafter {name}={getattr(self, name)!r} must be true or "
                                   "false")
        if self.confidence_head_with_markov and not (self.confidence_head and r):
            raise SpecjaxError("drafter confidence_head_with_markov needs confidence_head and "
                               "markov_rank > 0 (it reads the Markov head's W1[x_{k-1}])")
        if self.selector_rank and r:  # two ways to condition position k on x_{k-1}
            raise SpecjaxError("drafter markov_rank and selector_rank together: DSpark's "
                               "Markov head and DFlash2's path selector both condition a "
                               "position on the token before it; use one")
        used = [name for name, on in (("markov_rank", r), ("confidence_head",
                                                           self.confidence_head),
                                      ("sample_from_anchor", self.sample_from_anchor),
                                      ("block_causal", self.block_causal)) if on]
        if used and self.kind != "block":
            raise SpecjaxError(f"{used[0]} is a block drafter setting, not {self.kind}'s")

    def window(self, layer: int) -> int:
        """The sliding window of drafter layer `layer` (0: none)."""
        return self.sliding_windows[layer] if self.sliding_windows else 0

    # ------------------------------------------------------------------ derived

    @property
    def spec(self):
        """The registered `registry.DrafterKind` of this config's kind."""
        from specjax.drafters import registry

        return registry.get(self.kind)

    @property
    def uses_hidden(self) -> bool:
        """Reads target hidden states (eagle3, hybrid, block hidden/both: the kind says)."""
        return self.spec.uses_hidden(self)

    @property
    def uses_kv(self) -> bool:
        """Reads the target KV cache (kv, hybrid, block kv/both: the kind says)."""
        return self.spec.uses_kv(self)

    @property
    def num_memories(self) -> int:
        """Merged target-KV memories: one per drafter layer (kv, block), one for hybrid."""
        return self.spec.num_memories(self)

    def merge_sources(self) -> tuple[int, ...]:
        """For each memory, the index into kv_layers that its merge map starts as (an
        identity on that layer): evenly spread, the deepest for a single memory."""
        n, s = self.num_memories, len(self.kv_layers)
        if n == 1:
            return (s - 1,)
        return tuple(int(round(i * (s - 1) / (n - 1))) for i in range(n))

    @classmethod
    def for_target(cls, target: ModelConfig, kind: str, *, gamma: int = 7,
                   num_layers: int | None = None, intermediate_size: int | None = None,
                   context: str | None = None, num_kv_layers: int = 3,
                   mask_token_id: int | None = None, qk_norm: bool = True) -> DrafterConfig:
        """A drafter config sized for `target` with the defaults of docs/design.md section 5:
        eagle3 captures the inputs of layers {2, L/2, L-3}; kv has Ld = 2 layers over
        Ls = 3 target layers; block has Ld = 2 layers, context "hidden"; F defaults to
        the target's."""
        from specjax.drafters import registry

        spec = registry.get(kind)
        if num_layers is None:
            num_layers = spec.default_num_layers
        picked = spec.defaults(target, dict(num_layers=num_layers, context=context,
                                            num_kv_layers=num_kv_layers,
                                            mask_token_id=mask_token_id))
        extra = {name: picked.get(name) for name in ("context", "mask_token_id")}
        return cls(kind=kind, hidden_size=target.hidden_size, num_heads=target.num_heads,
                   num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   intermediate_size=intermediate_size or target.intermediate_size,
                   vocab_size=target.vocab_size, target_num_layers=target.num_layers,
                   gamma=gamma, num_layers=num_layers, rms_norm_eps=target.rms_norm_eps,
                   rope_theta=target.rope_theta, capture=tuple(picked.get("capture", ())),
                   kv_layers=tuple(picked.get("kv_layers", ())), qk_norm=qk_norm, **extra)

    def check_target(self, target: ModelConfig, where: str = "drafter") -> None:
        """Raises SpecjaxError unless `target` has the shapes this drafter was built for
        (an eagle3 drafter reads no target K/V: its own N, K, H may differ)."""
        want = dict(hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                    num_layers=self.target_num_layers)
        if self.spec.reads_target_kv_shapes:
            want.update(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim)
        diff = [f"{k} {getattr(target, k)} != {v}" for k, v in want.items()
                if getattr(target, k) != v]
        if diff:
            raise SpecjaxError(f"{where} was built for another target ({', '.join(diff)})")

    # ------------------------------------------------------------------ JSON

    def to_json_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["capture"], out["kv_layers"] = list(self.capture), list(self.kv_layers)
        if self.qk_norm:
            del out["qk_norm"]  # the default: drafter dirs written before it stay identical
        kept = set_block_options(self)  # likewise for the block options at their defaults
        for name in BLOCK_OPTIONS:
            if name not in kept:
                del out[name]
        if "sliding_windows" in out:
            out["sliding_windows"] = list(self.sliding_windows)
        return {"format": FORMAT, **out}

    @classmethod
    def from_json_dict(cls, raw: dict, where: str = "drafter config") -> DrafterConfig:
        raw = {k: v for k, v in raw.items() if k not in ("format", "target", "train")}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise SpecjaxError(f"{where}: unknown keys {unknown}")
        for key in ("capture", "kv_layers", "sliding_windows"):
            if key in raw:
                if not isinstance(raw[key], list):
                    raise SpecjaxError(f"{where}: {key} must be a list of integers")
                raw[key] = tuple(raw[key])
        try:
            return cls(**raw)
        except (TypeError, SpecjaxError) as e:  # a bad value names the file it came from
            raise SpecjaxError(f"{where}: {e}") from None

    @staticmethod
    def is_drafter_dir(path: str) -> bool:
        """True if `path` holds a specjax drafter config.json (not an HF model's)."""
        try:
            with open(os.path.join(path, CONFIG_NAME)) as f:
                return json.load(f).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False


# The block drafter's options beyond DFlash's (DFlash2, DSpark, JetSpec): left out of
# config.json where they are off, so drafter directories written before them stay
# byte-identical, and passed from train.py's drafter section where they are on. An option
# in REFINES only means something when the option it refines is on (selector_top_k with a
# selector, conv_group_size with a convolution).
BLOCK_OPTIONS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size",
                 "output_multiplier", "final_logit_softcapping", "sliding_windows",
                 "markov_rank", "markov_head_type", "confidence_head",
                 "confidence_head_with_markov", "sample_from_anchor", "block_causal")
REFINES = {"selector_top_k": "selector_rank", "conv_group_size": "conv_kernel_size"}


def set_block_options(obj) -> dict:
    """{name: value} of the BLOCK_OPTIONS that `obj` (a DrafterConfig, or train.py's
    DrafterTrainConfig, which lacks some) has switched on: away from DrafterConfig's
    default, or, for an option in REFINES, whenever the option it refines is on."""
    defaults = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}
    out = {}
    for name in BLOCK_OPTIONS:
        if not hasattr(obj, name):
            continue
        parent = REFINES.get(name)
        if (getattr(obj, parent) if parent else getattr(obj, name) != defaults[name]):
            out[name] = getattr(obj, name)
    return out
