"""Drafters trained elsewhere: EAGLE-3 heads (SafeAILab/EAGLE, SpecForge) and DFlash
heads (z-lab/dflash), read from local directories into specjax's eagle3 and block
drafters (docs/design.md section 5, "Checkpoint layouts").

    layout = detect_layout("heads/qwen3-8b-eagle3")          # "eagle3-hf", "dflash", None
    drafter, params = load_external("heads/qwen3-8b-eagle3", target)
    speculative_loop(..., drafter, params, ...)

One name table per layout (`tensor_table`) maps every tensor of the directory to a
specjax weight (and a layer index into the stacked [Ld, ...] weights); `convert.py`
writes the same tables back. Facts taken from the public code:

- EAGLE-3 (`architectures: ["LlamaForCausalLMEagle3"]`; sgl-project/SpecForge
  `specforge/modeling/draft/llama3_eagle.py`, vllm `model_executor/models/llama_eagle3.py`,
  SafeAILab/EAGLE `eagle/model/cnets.py`): `fc.weight` [D,3D]; `midlayer.*` one decoder
  layer whose q/k/v read [input_layernorm(embedding) ; hidden_norm(h)] (2D, embedding
  first), residual h; `norm.weight`; `lm_head.weight` [Vd,D] over a hot draft
  vocabulary with `d2t` (i64[Vd], target id = draft id + d2t[draft id]) and `t2d`
  (bool[V], the hot set; SpecForge `data/preprocessing.py`); optional Qwen3-style
  `midlayer.self_attn.{q,k}_norm.weight` [H]. The draft's RoPE is its own (config
  `rope_theta`, LlamaConfig's 10000 when absent; `rope_scaling` default or llama3).
- EAGLE-3 target features (`eagle3_capture`): the engines disagree on what a layer id
  means. specjax's capture depth d is the input of target layer d (HF `hidden_states[d]`).
  * vLLM (`eagle3_utils.get_eagle3_aux_layers_from_config`) reads the TOP-LEVEL
    `eagle_aux_hidden_state_layer_ids` and captures the input of layer k: depth = k.
  * SpecForge (`algorithms/model_providers.resolve_eagle_capture_layers`, HF backend
    forward hooks on layer outputs) writes and reads `eagle_config.
    eagle_aux_hidden_state_layer_ids` as layer OUTPUTS: depth = k + 1; its default
    [1, L//2-1, L-4] is depths (2, L//2, L-3).
  * SGLang (`set_eagle3_layers_to_capture`, after PR #25454) reads `eagle_config`'s list
    and adds 1 only when its first id is 1 (else the ids are layer inputs).
  * Neither key: every engine's default, depths (2, L//2, L-3) (EAGLE `modeling_llama_kv.py`).
  specjax reads the top-level key when present (and refuses a nested list that SGLang
  would read as other layers), else a nested list that starts at 1 (outputs, where
  SpecForge and SGLang agree), and refuses a nested list that starts elsewhere: SpecForge
  would read it as outputs and SGLang as inputs, and nothing in the directory says which
  layers the head was trained on.
- DFlash (a Qwen3Config with `dflash_config: {mask_token_id, target_layer_ids}` and
  `block_size`; z-lab/dflash `dflash/model.py`, vllm `qwen3_dflash.py`): `fc.weight`
  [D,n*D], `hidden_norm.weight`, `norm.weight`, `layers.{i}.*` Qwen3 layers (q_norm,
  k_norm); no embedding or LM head; target_layer_ids index layer OUTPUTS (HF
  hidden_states[id + 1], the input of layer id + 1 = a specjax capture depth). Without
  them, z-lab's `build_target_layer_ids` (`zlab_target_layer_ids`); a top-level
  `eagle_aux_hidden_state_layer_ids` takes precedence as in vLLM (layer inputs).
  SpecForge's `dflash_config.projector_type` is "dflash" (or absent) for this layout and
  "dspark" for DSpark's (below); "domino" heads carry another network and are refused, as
  is a trained mask embedding (`mask_embedding.pt`) and attention shapes other than the
  target's.
- DFlash2 (z-lab `DFlash2DraftModel`, `tests/fixtures/dflash2-config.json`; read as the
  same "dflash" layout, `is_dflash2`): DFlash plus, per layer, `attention_conv` and
  `mlp_conv` (`base_kernel` [2,T,D], `kernel_projection.weight` [2*T*D/g,D]; dflash_config
  `conv_kernel_size` T, `conv_group_size` g: `specjax.drafters.conv`) and a
  `candidate_selector` (`predecessor_codebook`, `successor_codebook` [V,R] stored without
  a `.weight` suffix, `hidden_projection.weight` [R,D]; `selector_rank` R,
  `selector_top_k`: `specjax.drafters.selector`). z-lab reads every dflash setting from
  `dflash_config` first, then the top level (`_draft_value`), so does specjax:
  `output_multiplier` and `final_logit_softcapping` (`compute_logits`, DFlash's too)
  become the block drafter's logit transforms. Layers of `layer_types`
  "sliding_attention" see the context positions s with p - s < `sliding_window` (as
  Qwen3Config: only with `use_sliding_window`; without `layer_types`, the layers from
  `max_window_layers` on) and are causal unless `is_causal` says otherwise: specjax
  runs the non-causal ones (the fixture's `is_causal: false`) with a per-layer window on
  the context and refuses causal draft attention.

- DSpark (SpecForge `DSparkDraftModel`: `architectures: ["DSparkDraftModel"]` or
  `dflash_config.projector_type: "dspark"`, `is_dspark`; `specforge/modeling/draft/
  dspark.py`): the DFlash backbone plus, read as SpecForge reads its dflash_config (here
  dflash_config first, then the top level), `markov_rank` R (0 or absent: no Markov
  head), `markov_head_type` ("vanilla" default, "gated", "rnn"),
  `enable_confidence_head` (default: `confidence_head_alpha` > 0) and
  `confidence_head_with_markov` (needs R > 0). Tensors: `markov_head.markov_w1.weight`
  [V,R] (an nn.Embedding), `markov_head.markov_w2.weight` [V,R] (nn.Linear(R, V)),
  gated `markov_head.gate_proj.{weight [R,D+R], bias}`, rnn `markov_head.joint_proj.
  {weight [3R,2R+D], bias}`, `confidence_head.proj.{weight [1,D(+R)], bias [1]}`, all
  stored as specjax holds them; early checkpoints' `logit_head.markov_head.*` /
  `logit_head.confidence_head.*` are read as those (SpecForge's
  `normalize_draft_head_checkpoint_keys`). The anchor slot drafts too: SpecForge's
  trainer labels slot k with the token at anchor + k + 1 and feeds the Markov head the
  anchor token first, and SGLang and vLLM serve DSpark with `sample_from_anchor` true
  unless the config says otherwise, `block_size` drafts per block; specjax reads
  `sample_from_anchor` (default true) into the block drafter's option of that name, so
  G = block_size (block_size - 1 when false). Refused: DFlash2 keys, logit transforms
  and sliding layers on a DSpark head (SpecForge's DSpark has none of the first two and
  makes sliding layers causal inside the block), `dspark_*`-prefixed keys (another
  checkpoint convention).

Anything these layouts can say that specjax cannot run exactly (biases, fc_norm, causal
draft attention, input_embedding_scale, other RoPE types, ...) raises SpecjaxError naming
the key or tensor: an inexact import would still be lossless (the target verifies) but
slower than the user was promised, silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.drafters.config import MARKOV_HEAD_TYPES, DrafterConfig
from specjax.errors import SpecjaxError
from specjax.fileio import read_config_json
from specjax.models.config import ModelConfig, rope_scaling_pairs

EAGLE3, DFLASH = "eagle3-hf", "dflash"
LAYOUTS = (EAGLE3, DFLASH)

# Per-layer suffix -> stacked specjax weight (common.layer_weights names).
_LAYER = {
    "self_attn.q_proj.weight": "q_proj", "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj", "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "post_norm", "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj", "mlp.down_proj.weight": "down_proj",
}
# Tensors a directory may hold that are not drafter weights: read by `_hot_vocab`, or
# the target's own embedding (SpecForge and EAGLE may save a frozen copy; specjax always
# reads the target's).
_OUTSIDE = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")
# DFlash2's names (z-lab `DFlash2DraftModel`): per layer (suffix -> BlockNet weight), the
# selector's (whole weights; hidden_projection [R,D] is sel_proj [D,R] transposed).
_CONV = {"attention_conv.base_kernel": "attn_conv_base",
         "attention_conv.kernel_projection.weight": "attn_conv_proj",
         "mlp_conv.base_kernel": "mlp_conv_base",
         "mlp_conv.kernel_projection.weight": "mlp_conv_proj"}
_SELECTOR = {"candidate_selector.predecessor_codebook": "sel_pred",
             "candidate_selector.successor_codebook": "sel_succ",
             "candidate_selector.hidden_projection.weight": "sel_proj"}
TRANSPOSED = ("candidate_selector.hidden_projection.weight",)
DFLASH2_ARCH = "DFlash2DraftModel"
# DSpark's heads (SpecForge `DSparkDraftModel`): external name -> BlockNet weight, by piece
_MARKOV = {"markov_head.markov_w1.weight": "markov_w1",
           "markov_head.markov_w2.weight": "markov_w2"}
_MARKOV_KIND = {"gated": {"markov_head.gate_proj.weight": "markov_gate",
                          "markov_head.gate_proj.bias": "markov_gate_bias"},
                "rnn": {"markov_head.joint_proj.weight": "markov_joint",
                        "markov_head.joint_proj.bias": "markov_joint_bias"}}
_CONFIDENCE = {"confidence_head.proj.weight": "conf_proj",
               "confidence_head.proj.bias": "conf_bias"}
_LEGACY_HEADS = ("logit_head.markov_head.", "logit_head.confidence_head.")
DSPARK_ARCH = "DSparkDraftModel"


def tensor_table(dcfg: DrafterConfig) -> dict[str, tuple[str, int | None]]:
    """External tensor name -> (specjax weight name, layer index or None) for an eagle3
    (EAGLE-3 layout) or block-hidden (DFlash layout; DFlash2's convolution and selector
    names when the drafter has them) drafter config. The tensors named in `TRANSPOSED`
    are their specjax weight transposed."""
    if dcfg.kind == "eagle3":
        out = {"fc.weight": ("fc", None), "norm.weight": ("final_norm", None),
               "midlayer.input_layernorm.weight": ("embed_norm", None),
               "midlayer.hidden_norm.weight": ("hidden_norm", None)}
        out.update({f"midlayer.{k}": (v, 0) for k, v in _LAYER.items()})
    else:
        out = {"fc.weight": ("fc", None), "norm.weight": ("final_norm", None),
               "hidden_norm.weight": ("hidden_norm", None)}
        for i in range(dcfg.num_layers):
            out[f"layers.{i}.input_layernorm.weight"] = ("input_norm", i)
            out.update({f"layers.{i}.{k}": (v, i) for k, v in _LAYER.items()})
            if dcfg.conv_kernel_size:
                out.update({f"layers.{i}.{k}": (v, i) for k, v in _CONV.items()})
        if dcfg.selector_rank:
            out.update({k: (v, None) for k, v in _SELECTOR.items()})
        if dcfg.markov_rank:
            out.update({k: (v, None) for k, v in _MARKOV.items()})
            out.update({k: (v, None) for k, v in
                        _MARKOV_KIND.get(dcfg.markov_head_type, {}).items()})
        if dcfg.confidence_head:
            out.update({k: (v, None) for k, v in _CONFIDENCE.items()})
    if not dcfg.qk_norm:
        out = {k: v for k, v in out.items() if v[0] not in ("q_norm", "k_norm")}
    return out


def detect_layout(path: str) -> str | None:
    """"dflash" for a config.json with `dflash_config` or naming DFlashDraftModel /
    DFlash2DraftModel / DSparkDraftModel (DFlash2 and DSpark are read by the same reader), "eagle3-hf" for one naming an
    Eagle3 architecture or carrying `draft_vocab_size`, else None (a specjax drafter
    directory, an HF draft LM, or not a directory). Never raises."""
    try:
        raw = read_config_json(path, "drafter")
    except SpecjaxError:
        return None
    return layout_of(raw)


def layout_of(raw: dict) -> str | None:
    """`detect_layout` of a config.json already read (a JSON object)."""
    if raw.get("format") == "specjax-drafter":
        return None
    archs = raw.get("architectures") or []
    if "dflash_config" in raw or any(a in ("DFlashDraftModel", DFLASH2_ARCH, DSPARK_ARCH)
                                     for a in archs):
        return DFLASH
    if any("eagle3" in str(a).lower() for a in archs) or "draft_vocab_size" in raw:
        return EAGLE3
    return None


# ----------------------------------------------------------------------------- reading

def safetensors_files(path: str) -> list[str]:
    """The weight files of `path`: its sharded index, model.safetensors, or else every
    *.safetensors. Raises SpecjaxError when there are none (pytorch_model.bin included:
    specjax never unpickles)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise SpecjaxError(f"{index} is unreadable ({e})") from None
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, f) for f in files]
    bins = [f for f in os.listdir(path) if f.endswith(".bin") or f.endswith(".pt")]
    hint = (f" ({bins[0]} is a torch pickle: re-save it with safetensors.torch.save_file)"
            if bins else "")
    raise SpecjaxError(f"{path} has no *.safetensors weights{hint}; specjax reads "
                       "safetensors only")


def read_tensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of `path` (numpy, stored dtype) and the file each came from.
    Raises SpecjaxError for unreadable files, a tensor present in two files, and NaN or
    Inf in a tensor (`checkpoint.check_finite`, naming it)."""
    from specjax.models.checkpoint import check_finite, open_safetensors

    out, where = {}, {}
    for file in safetensors_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():
                if name in out:
                    raise SpecjaxError(f"{file}: tensor {name} is also in {where[name]}")
                out[name], where[name] = f.get_tensor(name), file
                check_finite(name, out[name], file)
    return out, where


def rope_inv_freq(raw: dict, head_dim: int, where: str, default_theta: float | None,
                  target: ModelConfig) -> tuple[float, np.ndarray]:
    """(rope_theta, f64[H/2] RoPE inverse frequencies) of a draft config (rope_theta,
    rope_scaling or rope_parameters: default or llama3), by `ModelConfig.inv_freq`.

    default_theta: used when the config has no rope_theta (None: SpecjaxError)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise SpecjaxError(f"{where}: rope_scaling must be an object or null")
    theta = rope.get("rope_theta", raw.get("rope_theta", default_theta))
    if theta is None:
        raise SpecjaxError(f"{where}: rope_theta is missing (z-lab's code would take "
                           "Qwen3Config's 10000, vLLM 1000000); add it to config.json")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None, "llama3"):  # YaRN too: its temperature is left out
        raise SpecjaxError(f"{where}: rope_scaling type {kind!r} is not supported "
                           "(default or llama3)")
    try:
        scaling = rope_scaling_pairs(rope)
    except SpecjaxError as e:
        raise SpecjaxError(f"{where}: {e}") from None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise SpecjaxError(f"{where}: rope_theta={theta!r} must be a positive number")
    return float(theta), dataclasses.replace(target, rope_theta=float(theta),
                                             rope_scaling=scaling, head_dim=head_dim).inv_freq()


def _refuse(raw: dict, where: str, checks) -> None:
    """Raises for the first (key, value, neutral values) whose value is not neutral."""
    for key, value, neutral in checks:
        if value not in neutral:
            raise SpecjaxError(f"{where}: {key}={value!r} is not supported by specjax's "
                               f"drafter (supported: {neutral[0]!r})")


class External(NamedTuple):
    """A directory read into specjax terms.

    dcfg: the DrafterConfig (kind eagle3 or block/hidden).
    weights: specjax weight name -> np.ndarray in the network's shapes (stacked [Ld,...]).
    head: own LM head [Vd,D] or None (the target's is used).
    draft_ids: i32[Vd] target id of each hot-vocabulary row, or None (Vd == V, identity).
    inv_freq: f64[H/2] the drafter's own RoPE frequencies.
    """

    dcfg: DrafterConfig
    weights: dict
    head: np.ndarray | None
    draft_ids: np.ndarray | None
    inv_freq: np.ndarray


def _common_config(raw: dict, target: ModelConfig, where: str) -> dict:
    """DrafterConfig fields every layout shares; checks width and vocabulary."""
    D, V = target.hidden_size, target.vocab_size
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(raw.get(key), int):
            raise SpecjaxError(f"{where}: {key} is missing or not an integer")
    if raw["hidden_size"] != D or raw.get("target_hidden_size", D) != D:
        raise SpecjaxError(f"{where}: hidden_size {raw['hidden_size']} (target_hidden_size "
                           f"{raw.get('target_hidden_size')}) != the target's {D}")
    if raw.get("vocab_size", V) != V:
        raise SpecjaxError(f"{where}: vocab_size {raw['vocab_size']} != the target's {V}")
    _refuse(raw, where, [
        ("attention_bias", raw.get("attention_bias", False), (False, None)),
        ("qkv_bias", raw.get("qkv_bias", False), (False, None)),
        ("mlp_bias", raw.get("mlp_bias", False), (False, None)),
        ("hidden_act", raw.get("hidden_act", "silu"), ("silu",)),
        ("logit_scale", raw.get("logit_scale", 1.0), (1.0, 1, None)),
    ])
    N = raw["num_attention_heads"]
    return dict(hidden_size=D, num_heads=N, num_kv_heads=raw.get("num_key_value_heads") or N,
                head_dim=raw.get("head_dim") or D // N,
                intermediate_size=raw["intermediate_size"], vocab_size=V,
                target_num_layers=target.num_layers,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)))


def _id_list(value, key: str, where: str, n: int | None = None) -> list[int] | None:
    """`value` as a list of ints (None when absent or empty). Raises SpecjaxError for
    anything else, or for other than `n` entries."""
    if value is None or value == []:
        return None
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in value)) or (n and len(value) != n):
        what = f"{n} " if n else ""
        raise SpecjaxError(f"{where}: {key}={value!r} must be a list of {what}integer layer ids")
    return value


def sglang_depths(ids: list[int]) -> list[int]:
    """Capture depths SGLang takes from `eagle_config.eagle_aux_hidden_state_layer_ids`
    (`set_eagle3_layers_to_capture`, sglang PR #25454): layer outputs (+1) when the first
    id is 1, else layer inputs."""
    return [i + 1 for i in ids] if ids[0] == 1 else list(ids)


def eagle3_capture(raw: dict, L: int, where: str) -> tuple[int, ...]:
    """Capture depths (inputs of target layers) of an EAGLE-3 config.json for a target of
    L layers, read as the engines read them (module docstring, "EAGLE-3 target features").

    Raises: SpecjaxError (one line) for a malformed id list, ids outside 0..L, a nested
      list that SGLang would read as other layers than vLLM reads the top-level one, and
      a nested list alone that does not start at 1 (SpecForge: outputs; SGLang: inputs).
    """
    key = "eagle_aux_hidden_state_layer_ids"
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise SpecjaxError(f"{where}: eagle_config must be an object")
    top = _id_list(raw.get(key), key, where, 3)
    nested = _id_list(eagle.get(key), f"eagle_config.{key}", where, 3)
    if top is not None:
        depths = top
        if nested is not None and sglang_depths(nested) != top:
            raise SpecjaxError(
                f"{where}: {key} {top} (vLLM: inputs of those target layers) and "
                f"eagle_config.{key} {nested} (SGLang: inputs of layers "
                f"{sglang_depths(nested)}) name different layers; keep the one the head "
                "was trained with")
    elif nested is not None:
        if nested[0] != 1:
            raise SpecjaxError(
                f"{where}: eagle_config.{key} {nested} does not start at 1, so SpecForge "
                "reads it as outputs of those target layers and SGLang as their inputs; "
                f"add the top-level {key} (vLLM's key: inputs of target layers) to say "
                "which layers the head was trained on")
        depths = [i + 1 for i in nested]
    else:
        depths = [2, L // 2, L - 3]
    if not all(0 <= d <= L for d in depths):
        raise SpecjaxError(f"{where}: {key} names target layers {depths} (as layer inputs); "
                           f"a target of {L} layers has inputs 0..{L}")
    return tuple(depths)


def eagle3_config(raw: dict, target: ModelConfig, where: str, qk_norm: bool) -> DrafterConfig:
    """DrafterConfig of an EAGLE-3 config.json (LlamaForCausalLMEagle3)."""
    eagle = raw.get("eagle_config") or {}
    _refuse(raw, where, [
        ("num_hidden_layers", raw.get("num_hidden_layers", 1), (1,)),
        ("fc_norm", raw.get("fc_norm", False), (False, None)),
        ("norm_before_fc", raw.get("norm_before_fc", False), (False, None)),
        ("norm_output", raw.get("norm_output", True), (True, None)),
        ("norm_before_residual", raw.get("norm_before_residual", False), (False, None)),
        ("use_sliding_window", raw.get("use_sliding_window", False), (False, None)),
        ("eagle_config.use_aux_hidden_state", eagle.get("use_aux_hidden_state", True)
         if isinstance(eagle, dict) else True, (True,)),
    ])
    capture = eagle3_capture(raw, target.num_layers, where)
    fields = _common_config(raw, target, where)
    return DrafterConfig(kind="eagle3", num_layers=1, capture=capture, qk_norm=qk_norm,
                         **fields)


def zlab_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab/dflash `build_target_layer_ids`: the default target layer ids (layer
    OUTPUTS) of a DFlash head without `target_layer_ids`: L//2 for one draft layer, else
    Ld ids spread over 1 .. L-3 with Python's round (half to even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, span = 1, num_target_layers - 3 - 1
    return [int(round(start + i * span / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


def is_dflash2(raw: dict) -> bool:
    """A DFlash2 head: architectures name DFlash2DraftModel, or dflash_config sets
    selector_rank or conv_kernel_size."""
    dc = raw.get("dflash_config")
    dc = dc if isinstance(dc, dict) else {}
    return DFLASH2_ARCH in (raw.get("architectures") or []) or \
        any(dc.get(k) is not None for k in ("selector_rank", "conv_kernel_size"))


def _positive_int(value, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecjaxError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def _dflash2_options(raw: dict, dc: dict, fields: dict, layers: int, gamma: int,
                     where: str) -> dict:
    """The DrafterConfig fields of DFlash2's pieces (and of DFlash's logit transforms and
    sliding windows), each read as z-lab's `_draft_value`: dflash_config first, then the
    top level. Raises SpecjaxError (one line) for what specjax cannot run."""
    def value(name, default=None):
        return dc.get(name, raw.get(name, default))

    out = {}
    two = DFLASH2_ARCH in (raw.get("architectures") or [])
    for size, group, what in (("conv_kernel_size", "conv_group_size", "convolution"),
                              ("selector_rank", "selector_top_k", "candidate selector")):
        if value(size) is None and not two:
            continue
        if value(size) is None or value(group) is None:
            raise SpecjaxError(f"{where}: DFlash2's {what} needs dflash_config.{size} and "
                               f"dflash_config.{group}")
        out[size] = _positive_int(value(size), f"dflash_config.{size}", where)
        out[group] = _positive_int(value(group), f"dflash_config.{group}", where)
    if "conv_group_size" in out and fields["hidden_size"] % out["conv_group_size"]:
        raise SpecjaxError(f"{where}: hidden_size {fields['hidden_size']} is not a multiple of "
                           f"dflash_config.conv_group_size={out['conv_group_size']}")
    for name, off in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        v = value(name, off)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                              v != v or abs(v) == float("inf")):
            raise SpecjaxError(f"{where}: {name}={v!r} must be a number")
        if name == "output_multiplier" and v != 1:
            if not v > 0:
                raise SpecjaxError(f"{where}: output_multiplier={v!r} is not supported by "
                                   "specjax's drafter (a positive number)")
            out[name] = float(v)
        elif name == "final_logit_softcapping" and v is not None and v > 0:
            out[name] = float(v)  # z-lab: None or <= 0 is off
    scale = value("input_embedding_scale", 1.0)
    if scale not in (1.0, 1, None):
        raise SpecjaxError(f"{where}: input_embedding_scale={scale!r} is not supported by "
                           "specjax's drafter (its block embeds tokens with the target's "
                           "frozen embedding unscaled; supported: 1.0)")
    out.update(_sliding_windows(raw, layers, gamma, where))
    return out


def _sliding_windows(raw: dict, layers: int, gamma: int, where: str) -> dict:
    """{"sliding_windows": per-layer windows} (or {}) of a Qwen3Config-style config as
    z-lab's `Qwen3DFlashAttention` reads it: Qwen3Config keeps `sliding_window` (default
    4096) only with `use_sliding_window`, and without `layer_types` makes the layers from
    `max_window_layers` (default 28) on sliding; a "sliding_attention" layer has the window
    and is causal unless `is_causal` is set. Raises SpecjaxError for causal layers."""
    use = raw.get("use_sliding_window", False)
    if use not in (True, False, None):
        raise SpecjaxError(f"{where}: use_sliding_window={use!r} must be true or false")
    window = raw.get("sliding_window", 4096) if use else None
    if window is not None:
        window = _positive_int(window, "sliding_window", where)
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        types = ["sliding_attention" if window is not None and i >= first else
                 "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"full_attention", "sliding_attention"}:
        raise SpecjaxError(f"{where}: layer_types={types!r} must list {layers} of "
                           "'full_attention' / 'sliding_attention'")
    causal = raw.get("is_causal")
    if causal not in (None, False, True):
        raise SpecjaxError(f"{where}: is_causal={causal!r} must be true, false or absent")
    if causal or (causal is None and "sliding_attention" in types):
        why = ("is_causal=true" if causal else
               "layer_types 'sliding_attention' without is_causal (z-lab makes such layers "
               "causal)")
        raise SpecjaxError(f"{where}: {why}: causal draft attention inside the block is not "
                           "supported by specjax's drafter (supported: is_causal false)")
    windows = tuple(window if t == "sliding_attention" and window else 0 for t in types)
    if not any(windows):
        return {}
    if window <= gamma:
        raise SpecjaxError(f"{where}: sliding_window {window} is not longer than the block "
                           f"({gamma + 1} positions); specjax's block drafter sees its block "
                           "whole")
    return {"sliding_windows": windows}


def dflash_config(raw: dict, target: ModelConfig, where: str) -> DrafterConfig:
    """DrafterConfig (block, context hidden) of a z-lab DFlash or DFlash2 config.json."""
    L = target.num_layers
    dc = raw.get("dflash_config", {})
    if not isinstance(dc, dict):
        raise SpecjaxError(f"{where}: dflash_config must be an object")
    layers = raw.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise SpecjaxError(f"{where}: num_hidden_layers is missing or not a positive integer")
    if raw.get("num_target_layers", L) != L:
        raise SpecjaxError(f"{where}: num_target_layers {raw['num_target_layers']} != the "
                           f"target's {L} layers")
    projector = dc.get("projector_type")
    if projector not in (None, "dflash", "dspark"):
        raise SpecjaxError(f"{where}: dflash_config.projector_type={projector!r} is a "
                           "SpecForge draft family other than DFlash and DSpark (its extra "
                           "heads have no counterpart in specjax's block drafter); supported: "
                           "'dflash', 'dspark'")
    dspark = is_dspark(raw)
    if dspark and projector not in (None, "dspark"):
        raise SpecjaxError(f"{where}: architectures name {DSPARK_ARCH} but "
                           f"dflash_config.projector_type={projector!r} (SpecForge's "
                           "DSparkDraftModel requires 'dspark')")
    _refuse(raw, where, [
        ("is_neox_style", raw.get("is_neox_style", True), (True,)),
        ("dflash_config.causal", dc.get("causal"), (None, False)),
        ("dflash_config.use_swa", dc.get("use_swa", False), (False,)),
        ("dflash_config.attention_sink_bias", dc.get("attention_sink_bias", False), (False,)),
        ("dflash_config.attention_mode", dc.get("attention_mode", "gqa"), ("gqa", "mha")),
        ("dflash_config.attention_modes", dc.get("attention_modes"), (None,)),
        ("dflash_config.pure_draft_prefix_len", dc.get("pure_draft_prefix_len", 0), (0,)),
        ("dflash_config.shift_label", dc.get("shift_label", False), (False,)),
    ])
    key = "eagle_aux_hidden_state_layer_ids"
    top = _id_list(raw.get(key), key, where)
    ids = _id_list(dc.get("target_layer_ids", raw.get("target_layer_ids")),
                   "dflash_config.target_layer_ids", where)
    if top is not None:  # vLLM's precedence: the top-level key, as layer inputs
        depths, said = top, f"{key} {top} (inputs of target layers)"
    else:
        ids = ids if ids is not None else zlab_target_layer_ids(L, layers)
        depths, said = [i + 1 for i in ids], f"dflash_config.target_layer_ids {ids}"
    if not all(1 <= d <= L - 1 for d in depths):
        raise SpecjaxError(f"{where}: {said} must name layer outputs 0..{L - 2} (inputs "
                           f"1..{L - 1}); output {L - 1} is HF's post-norm hidden_states[L], "
                           "which specjax does not capture")
    mask = dc.get("mask_token_id", raw.get("mask_token_id"))
    block = raw.get("block_size", dc.get("block_size", 16))
    if dc.get("block_size", block) != block:
        raise SpecjaxError(f"{where}: block_size {block} and dflash_config.block_size "
                           f"{dc['block_size']} differ (z-lab reads the latter, vLLM the "
                           "former); keep one")
    if not isinstance(block, int) or block < 2:
        raise SpecjaxError(f"{where}: block_size={block!r} must be an integer >= 2")
    if not isinstance(mask, int):
        raise SpecjaxError(f"{where}: dflash_config.mask_token_id is missing")
    heads = _dspark_options(raw, dc, where) if dspark else {}
    gamma = block if heads.get("sample_from_anchor") else block - 1
    fields = _common_config(raw, target, where)
    mine = (fields["num_heads"], fields["num_kv_heads"], fields["head_dim"])
    theirs = (target.num_heads, target.num_kv_heads, target.head_dim)
    if mine != theirs:
        raise SpecjaxError(f"{where}: the head's attention shapes (heads, kv heads, head_dim) "
                           f"{mine} differ from the target's {theirs}; specjax's block drafter "
                           "runs with the target's attention shapes, so this head is not "
                           "supported")
    extra = _dflash2_options(raw, dc, fields, layers, gamma, where)
    if dspark:
        extra_keys = [k for k in ("conv_kernel_size", "selector_rank", "output_multiplier",
                                  "final_logit_softcapping", "sliding_windows") if k in extra]
        if extra_keys or DFLASH2_ARCH in (raw.get("architectures") or []):
            what = extra_keys[0] if extra_keys else f"architectures {DFLASH2_ARCH}"
            raise SpecjaxError(f"{where}: {what} on a DSpark head is not supported (SpecForge's "
                               "DSparkDraftModel is a DFlash backbone without DFlash2's pieces "
                               "or logit transforms, and its sliding layers are causal inside "
                               "the block)")
    return DrafterConfig(kind="block", context="hidden", num_layers=layers,
                         capture=tuple(depths), mask_token_id=mask, gamma=gamma, **fields,
                         **extra, **heads)


def is_dspark(raw: dict) -> bool:
    """A DSpark head: architectures name DSparkDraftModel, or dflash_config.projector_type
    is "dspark" (SpecForge)."""
    dc = raw.get("dflash_config")
    dc = dc if isinstance(dc, dict) else {}
    return DSPARK_ARCH in (raw.get("architectures") or []) or \
        dc.get("projector_type") == "dspark"


def _dspark_options(raw: dict, dc: dict, where: str) -> dict:
    """The DrafterConfig fields of a DSpark head's Markov and confidence heads and block
    layout, read as SpecForge's `DSparkDraftModel._init_draft_head` / `build_markov_head`
    (dflash_config first, then the top level). Raises SpecjaxError (one line)."""
    def value(name, default=None):
        return dc.get(name, raw.get(name, default))

    prefixed = sorted(k for k in list(raw) + list(dc) if str(k).startswith("dspark_"))
    if prefixed:
        raise SpecjaxError(f"{where}: {prefixed[0]}: the dspark_*-prefixed convention is not "
                           "supported (specjax reads SpecForge's dflash_config keys)")
    rank = value("markov_rank", 0) or 0
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SpecjaxError(f"{where}: dflash_config.markov_rank={rank!r} must be an integer "
                           ">= 0")
    kind = value("markov_head_type", "vanilla")
    kind = kind.lower() if isinstance(kind, str) else kind
    if rank and kind not in MARKOV_HEAD_TYPES:
        raise SpecjaxError(f"{where}: dflash_config.markov_head_type={kind!r} is not "
                           f"supported (supported: {', '.join(MARKOV_HEAD_TYPES)})")
    alpha = value("confidence_head_alpha", 0.0) or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise SpecjaxError(f"{where}: dflash_config.confidence_head_alpha={alpha!r} must be a "
                           "number")
    flags = {}
    for name, key, default in (("confidence_head", "enable_confidence_head", alpha > 0),
                               ("confidence_head_with_markov", "confidence_head_with_markov",
                                False),
                               ("sample_from_anchor", "sample_from_anchor", True)):
        v = value(key, default)
        if not isinstance(v, bool):
            raise SpecjaxError(f"{where}: dflash_config.{key}={v!r} must be true or false")
        flags[name] = v
    if flags["confidence_head_with_markov"] and not rank:
        raise SpecjaxError(f"{where}: confidence_head_with_markov=true requires markov_rank > 0 "
                           "(as SpecForge's DSparkDraftModel)")
    flags["confidence_head_with_markov"] &= flags["confidence_head"]  # unused without a head
    return dict(markov_rank=rank, markov_head_type=kind if rank else "vanilla", **flags)


def _hot_vocab(tensors, raw, dcfg: DrafterConfig, where: dict, path: str):
    """(head [Vd,D] or None, draft_ids i32[Vd] or None) from lm_head / d2t / t2d."""
    V, D = dcfg.vocab_size, dcfg.hidden_size
    head, d2t, t2d = (tensors.get(k) for k in ("lm_head.weight", "d2t", "t2d"))
    Vd = raw.get("draft_vocab_size") or V
    if head is None:
        if Vd != V or d2t is not None:
            raise SpecjaxError(f"{path}: tensor lm_head.weight missing (draft_vocab_size "
                               f"{Vd}, d2t present: {d2t is not None})")
        return None, None
    if tuple(head.shape) != (Vd, D):
        raise SpecjaxError(f"{where['lm_head.weight']}: tensor lm_head.weight has shape "
                           f"{tuple(head.shape)}, expected {(Vd, D)} from draft_vocab_size")
    if d2t is None:
        if Vd != V:
            raise SpecjaxError(f"{path}: tensor d2t missing (lm_head has {Vd} rows, the "
                               f"target vocabulary {V})")
        return head, None
    if tuple(d2t.shape) != (Vd,) or not np.issubdtype(d2t.dtype, np.integer):
        raise SpecjaxError(f"{where['d2t']}: tensor d2t has shape {tuple(d2t.shape)} "
                           f"{d2t.dtype}, expected int64 {(Vd,)}")
    ids = np.arange(Vd, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= V or len(np.unique(ids)) != Vd:
        raise SpecjaxError(f"{where['d2t']}: tensor d2t maps draft ids outside 0..{V - 1} "
                           "or two draft ids to one target id")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if tuple(t2d.shape) != (V,) or t2d.astype(bool).sum() != Vd or \
                not t2d.astype(bool)[ids].all():
            raise SpecjaxError(f"{where['t2d']}: tensor t2d (shape {tuple(t2d.shape)}) does "
                               "not mark exactly the target ids of d2t")
    if Vd == V and (ids == np.arange(V)).all():
        return head, None
    return head, ids.astype(np.int32)


def read_external(path: str, target: ModelConfig, config: dict | None = None) -> External:
    """Reads an EAGLE-3 or DFlash directory for `target` (its ModelConfig); config: its
    config.json when the caller has read it already (else read here).

    Raises: SpecjaxError (one line naming the key or tensor) for a directory of another
      layout, config keys specjax cannot run exactly, a missing, unexpected or wrongly
      shaped tensor, or shapes that do not fit the target.
    """
    from specjax import drafters

    layout = detect_layout(path) if config is None else layout_of(config)
    if layout is None:
        raise SpecjaxError(f"{path}: config.json is neither an EAGLE-3 nor a DFlash head")
    raw = read_config_json(path, "drafter") if config is None else config
    where_cfg = os.path.join(path, "config.json")
    for name in ("mask_embedding.pt", "mask_embedding.safetensors"):
        if os.path.exists(os.path.join(path, name)):
            raise SpecjaxError(f"{os.path.join(path, name)}: a trained mask embedding is not "
                               "supported (specjax's block drafter embeds mask_token_id with "
                               "the target's frozen embedding row)")
    tensors, where = read_tensors(path)
    for name in [n for n in tensors if n.startswith(_LEGACY_HEADS)]:  # SpecForge's renaming
        new = name[len("logit_head."):]
        if new not in tensors:
            tensors[new], where[new] = tensors[name], where[name]
        del tensors[name]
    if layout == EAGLE3:
        qk = "midlayer.self_attn.q_norm.weight" in tensors
        dcfg = eagle3_config(raw, target, where_cfg, qk)
        theta, inv = rope_inv_freq(raw, dcfg.head_dim, where_cfg, 10000.0, target)
    else:
        dcfg = dflash_config(raw, target, where_cfg)
        theta, inv = rope_inv_freq(raw, dcfg.head_dim, where_cfg, None, target)
    dcfg = dataclasses.replace(dcfg, rope_theta=theta)
    dcfg.check_target(target, where=path)
    abstract = nnx.eval_shape(lambda: drafters.build_network(dcfg, rngs=nnx.Rngs(0)))
    shapes = {".".join(map(str, p)): tuple(v.get_value().shape)
              for p, v in nnx.to_flat_state(nnx.split(abstract, nnx.Param, ...)[1])}
    table = tensor_table(dcfg)
    for name in tensors:
        if name not in table and name not in _OUTSIDE:
            raise SpecjaxError(f"{where[name]}: tensor {name} has no counterpart in specjax's "
                               f"{dcfg.kind} drafter ({layout} layout)")
    missing = [n for n in table if n not in tensors]
    if missing:
        raise SpecjaxError(f"{path}: tensor {missing[0]} missing ({layout} layout"
                           f"{f', and {len(missing) - 1} more' if len(missing) > 1 else ''})")
    parts: dict[str, dict] = {}
    for name, (attr, i) in table.items():
        arr, want = tensors[name], shapes[attr][1:] if i is not None else shapes[attr]
        if name in TRANSPOSED:
            want = want[::-1]
        if tuple(arr.shape) != want:
            raise SpecjaxError(f"{where[name]}: tensor {name} has shape {tuple(arr.shape)}, "
                               f"expected {want} from config.json")
        parts.setdefault(attr, {})[i] = (arr.T if name in TRANSPOSED else arr).astype(np.float32)
    # p[None]: a whole weight; else the per-layer slices stacked in layer order
    weights = {a: (p[None] if None in p else np.stack([p[i] for i in sorted(p)]))
               for a, p in parts.items()}
    assert set(weights) == set(shapes), (sorted(weights), sorted(shapes))
    emb = tensors.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise SpecjaxError(f"{where['embed_tokens.weight']}: tensor embed_tokens.weight has "
                           f"shape {tuple(emb.shape)}, not the target's embedding's")
    head, ids = _hot_vocab(tensors, raw, dcfg, where, path)
    return External(dcfg, weights, None if head is None else head.astype(np.float32), ids,
                    inv)


def load_external(path: str, target, *, gamma: int | None = None, sampling=None,
                  dtype=jnp.float32, matmul_dtype=None, draft_vocab: str = "full",
                  config: dict | None = None):
    """(drafter, params) for `speculative_loop` from an EAGLE-3 or DFlash directory.

    Args:
      path: the directory; target: the `specjax.models.model.Transformer` it drafts for.
      gamma: G (None: the layout's, DFlash block_size - 1, EAGLE-3 7).
      sampling: SamplingParams (default greedy); dtype: the drafter's parameter dtype;
      matmul_dtype: as `drafters.make_drafter`.
      draft_vocab: "auto": a head that drafts through the target's LM head (DFlash, or an
        EAGLE-3 head with draft_vocab_size = V) drafts over the directory's
        draft_vocab.json when it has one (`specjax.drafters.vocab`); "full": all ids. An
        EAGLE-3 head's own hot vocabulary (d2t) is used either way.
      config: the directory's config.json when the caller has read it already.
    Returns: the loop adapter and params {"net", "embed", "head", "inv_freq"} plus
      "draft_ids" (i32[Vd]) for a hot draft vocabulary; draft tokens and q [B,G,V] are in
      the target vocabulary, q zero outside the hot set.
    Raises: SpecjaxError as `read_external`.
    """
    from specjax.core.sampling import SamplingParams
    from specjax.drafters import build_network, make_drafter

    ext = read_external(path, target.cfg, config)
    abstract = nnx.eval_shape(lambda: build_network(ext.dcfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    for p, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(ext.weights[".".join(map(str, p))], dtype))
    net = nnx.merge(graphdef, state)
    hot = None
    if draft_vocab == "auto" and ext.head is None:
        from specjax.drafters.vocab import load_draft_vocab

        hot = load_draft_vocab(path, target.cfg.vocab_size)
    drafter, params = make_drafter(ext.dcfg, net, target, gamma=gamma,
                                   sampling=sampling or SamplingParams(),
                                   matmul_dtype=matmul_dtype, draft_vocab=hot)
    params["inv_freq"] = jnp.asarray(ext.inv_freq, jnp.float32)
    if ext.head is not None:
        params["head"] = jnp.asarray(ext.head, matmul_dtype or dtype)
    if ext.draft_ids is not None:
        params["draft_ids"] = jnp.asarray(ext.draft_ids, jnp.int32)
    return drafter, params
