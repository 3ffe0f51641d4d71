"""Export specjax's eagle3 and block drafters to the EAGLE-3 and DFlash layouts.

    python -m specjax.drafters.convert --to eagle3-hf runs/eagle3/drafter out/eagle3-hf
    python -m specjax.drafters.convert --to dflash runs/block/drafter out/dflash \\
        [--target checkpoints/demo/target] [--dtype bfloat16]

SRC is a drafter directory written by train.py; the target defaults to the one recorded
in it (the command line is `specjax.tools.convert`; `export_dir` is the library call).
The tensor names are `external.tensor_table`'s (read back by `external.load_external`
and by `decode.py --drafter`); the facts behind them are in `external`'s docstring.
What an export writes beyond the drafter's own weights:

- eagle3-hf: what vLLM, SGLang and SpecForge run as `LlamaForCausalLMEagle3`, and
  nothing else. `lm_head.weight` [Vd,D] is the target's LM head rows of the drafter's
  hot draft vocabulary (`draft_vocab.json`, sorted ids; all V rows without one), with
  `draft_vocab_size` = Vd, `d2t` = ids - arange(Vd) (i64[Vd]) and `t2d` (bool[V], the
  set), as SpecForge writes them. The capture depths go under both keys, each in its
  readers' convention (`external.eagle3_capture`): the top-level
  `eagle_aux_hidden_state_layer_ids` as layer inputs (vLLM), `eagle_config`'s as layer
  outputs, depth - 1 (SpecForge; SGLang reads a list starting at 1 as outputs too), so
  the first depth must be 2. rope_theta and rope_scaling are the target's (specjax's
  eagle3 uses the target's RoPE). A drafter with q/k norms is refused: those engines
  have none and would drop the tensors silently (train with `drafter.qk_norm: false`).
- dflash: `block_size` = G + 1, `dflash_config.target_layer_ids` = capture depths - 1,
  `mask_token_id` the drafter's; no embedding or LM head. A drafter with DFlash2's
  convolution and path selector is written as z-lab's `DFlash2DraftModel` (their
  tensors and `dflash_config` keys, `external.tensor_table`); one with only one of
  them is refused (z-lab's DFlash2 builds both). The logit transforms go into
  `dflash_config` (`output_multiplier`, `final_logit_softcapping`), sliding windows into
  `layer_types` / `sliding_window` with `is_causal: false` (one window size only). A
  drafter in DSpark's layout (`sample_from_anchor`, with or without a Markov or confidence
  head) is written as SpecForge's `DSparkDraftModel`: `projector_type: "dspark"`,
  `block_size` = G, `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov` in `dflash_config`, the heads' tensors under SpecForge's
  names; a Markov or confidence head in DFlash's layout is refused (SpecForge's DSpark
  trainer always lets the anchor slot draft), as are DFlash2's pieces, logit transforms
  and sliding windows on a DSpark drafter.

Raises SpecjaxError (exit 2 from the CLI, one line) for drafters the layout cannot hold:
hybrid and kv drafters, block drafters whose context reads the target KV cache, capture
depth 0 or L for DFlash; for EAGLE-3, q/k norms, other than 3 capture depths, depths
outside 1..L-1 or a first depth other than 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import ml_dtypes
import numpy as np

from specjax.drafters.config import DrafterConfig
from specjax.drafters.external import (
    DFLASH,
    DFLASH2_ARCH,
    DSPARK_ARCH,
    EAGLE3,
    LAYOUTS,
    TRANSPOSED,
    tensor_table,
)
from specjax.dtypes import storage_dtype
from specjax.errors import SpecjaxError
from specjax.models.config import ModelConfig


def _rope_json(target: ModelConfig) -> dict | None:
    """The drafter's rope_scaling: the target's. Raises SpecjaxError for a YaRN target:
    specjax's drafters rotate with the target's frequencies but without YaRN's attention
    temperature, which the other engines' drafters would apply."""
    if target.rope_scaling is None:
        return None
    if target.rope_type == "yarn":
        raise SpecjaxError("exporting a drafter of a YaRN-scaled target is not supported: "
                           "specjax's drafters leave out YaRN's attention temperature, which "
                           "the other engines apply")
    return {"rope_type": "llama3", **dict(target.rope_scaling)}


def _base_config(dcfg: DrafterConfig, target: ModelConfig, dtype: str) -> dict:
    return {"hidden_size": dcfg.hidden_size, "intermediate_size": dcfg.intermediate_size,
            "num_attention_heads": dcfg.num_heads, "num_key_value_heads": dcfg.num_kv_heads,
            "head_dim": dcfg.head_dim, "rms_norm_eps": dcfg.rms_norm_eps,
            "rope_theta": target.rope_theta, "rope_scaling": _rope_json(target),
            "vocab_size": dcfg.vocab_size, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": target.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": dtype,
            "bos_token_id": target.bos_token_id,
            "eos_token_id": list(target.eos_token_ids) or None}


def target_head(target_dir: str, target: ModelConfig) -> np.ndarray:
    """The target's LM head [V,D] (its embedding when tied) read from `target_dir` alone,
    as stored. Raises SpecjaxError if it is missing."""
    from safetensors import safe_open

    from specjax.drafters.external import safetensors_files

    names = ("model.embed_tokens.weight",) if target.tie_word_embeddings else (
        "lm_head.weight", "model.embed_tokens.weight")
    for name in names:
        for file in safetensors_files(target_dir):
            with safe_open(file, framework="numpy") as f:
                if name in f.keys():
                    return f.get_tensor(name)
    raise SpecjaxError(f"{target_dir}: no tensor {names[0]} (the target's LM head)")


def _dflash2_fields(dcfg: DrafterConfig, extra: dict) -> None:
    """Adds a block drafter's DFlash2 pieces to its DFlash config.json fields `extra`.
    Raises SpecjaxError for a drafter no z-lab class runs."""
    dc = extra["dflash_config"]
    if dcfg.selector_rank and dcfg.confidence_head:
        raise SpecjaxError("this block drafter has DFlash2's path selector and DSpark's "
                           "confidence head; no producer's layout holds both (z-lab's "
                           "DFlash2DraftModel has no confidence head)")
    if dcfg.sample_from_anchor or dcfg.markov_rank or dcfg.confidence_head:
        _dspark_fields(dcfg, extra)
        return
    if bool(dcfg.conv_kernel_size) != bool(dcfg.selector_rank):
        has, lacks = (("convolution", "path selector") if dcfg.conv_kernel_size else
                      ("path selector", "convolution"))
        raise SpecjaxError(f"this block drafter has DFlash2's {has} but no {lacks}; z-lab's "
                           "DFlash2DraftModel builds both, so no DFlash layout holds it")
    if dcfg.conv_kernel_size:
        extra["architectures"] = [DFLASH2_ARCH]
        dc.update(conv_kernel_size=dcfg.conv_kernel_size, conv_group_size=dcfg.conv_group_size,
                  selector_rank=dcfg.selector_rank, selector_top_k=dcfg.selector_top_k)
    if dcfg.output_multiplier != 1.0:
        dc["output_multiplier"] = dcfg.output_multiplier
    if dcfg.final_logit_softcapping > 0:
        dc["final_logit_softcapping"] = dcfg.final_logit_softcapping
    sizes = sorted({w for w in dcfg.sliding_windows if w})
    if len(sizes) > 1:
        raise SpecjaxError(f"sliding windows {list(dcfg.sliding_windows)}: a Qwen3Config "
                           "holds one sliding_window for all its sliding layers")
    if sizes:
        extra.update(layer_types=["sliding_attention" if w else "full_attention"
                                  for w in dcfg.sliding_windows],
                     use_sliding_window=True, sliding_window=sizes[0], is_causal=False)


def _dspark_fields(dcfg: DrafterConfig, extra: dict) -> None:
    """Makes a DFlash config.json's fields `extra` SpecForge's DSparkDraftModel's.
    Raises SpecjaxError for a drafter that layout cannot hold."""
    if not dcfg.sample_from_anchor:
        what = "Markov head" if dcfg.markov_rank else "confidence head"
        raise SpecjaxError(f"this block drafter has DSpark's {what} in DFlash's block layout; "
                           "SpecForge's DSpark lets the anchor slot draft (train with "
                           "drafter.sample_from_anchor: true)")
    other = [n for n, on in (("conv_kernel_size", dcfg.conv_kernel_size),
                             ("selector_rank", dcfg.selector_rank),
                             ("output_multiplier", dcfg.output_multiplier != 1.0),
                             ("final_logit_softcapping", dcfg.final_logit_softcapping),
                             ("sliding_windows", any(dcfg.sliding_windows))) if on]
    if other:
        raise SpecjaxError(f"this DSpark-layout drafter has {other[0]}, which SpecForge's "
                           "DSparkDraftModel does not run")
    extra["architectures"] = [DSPARK_ARCH]
    extra["block_size"] = dcfg.gamma
    extra["dflash_config"].update(
        projector_type="dspark", markov_rank=dcfg.markov_rank,
        markov_head_type=dcfg.markov_head_type, enable_confidence_head=dcfg.confidence_head,
        confidence_head_with_markov=dcfg.confidence_head_with_markov)


def export_tensors(dcfg: DrafterConfig, weights: dict, layout: str,
                   head: np.ndarray | None = None,
                   hot: np.ndarray | None = None) -> tuple[dict, dict]:
    """(tensors by external name, config.json fields specific to the layout) of a
    drafter's weights (specjax name -> array, as `io.param_tensors`).

    head: eagle3-hf only: the target's LM head [V,D]; hot: eagle3-hf only: i32[Vd] sorted
      target ids of the hot draft vocabulary (None: all V ids).
    Raises: SpecjaxError if the drafter does not fit `layout` (module docstring)."""
    L = dcfg.target_num_layers
    if layout == EAGLE3:
        if dcfg.kind != "eagle3":
            raise SpecjaxError(f"a {dcfg.kind} drafter has no EAGLE-3 layout (its "
                               f"{'merge_k' if dcfg.uses_kv else 'layers'} weights have no "
                               "counterpart); export an eagle3 drafter")
        if dcfg.qk_norm:
            raise SpecjaxError("this eagle3 drafter has q/k norms, which LlamaForCausalLMEagle3 "
                               "in vLLM, SGLang and SpecForge lacks (they would drop them and "
                               "draft differently); train it with drafter.qk_norm: false")
        depths = list(dcfg.capture)
        if len(depths) != 3:
            raise SpecjaxError(f"EAGLE-3's fc.weight reads 3 target layers; this drafter "
                               f"captures {depths}")
        if not all(1 <= d <= L - 1 for d in depths) or depths[0] != 2:
            raise SpecjaxError(
                f"capture depths {depths} cannot be written so that vLLM (layer inputs), "
                "SpecForge (layer outputs) and SGLang (outputs only when the first id is 1) "
                f"read the same layers: the first depth must be 2 and all in 1..{L - 1}")
        Vd = dcfg.vocab_size if hot is None else len(hot)
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                 "num_hidden_layers": 1, "draft_vocab_size": Vd,
                 "eagle_aux_hidden_state_layer_ids": depths,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [d - 1 for d in depths],
                                  "use_aux_hidden_state": True}}
    elif layout == DFLASH:
        if dcfg.kind != "block" or dcfg.context != "hidden":
            what = "merge_k (target KV context)" if dcfg.uses_kv else f"{dcfg.kind} weights"
            raise SpecjaxError(f"DFlash heads read target hidden states only; this "
                               f"{dcfg.kind} drafter's {what} has no counterpart")
        if not dcfg.qk_norm:
            raise SpecjaxError("DFlash layers have q_norm/k_norm; this drafter has none")
        bad = [d for d in dcfg.capture if not 1 <= d <= L - 1]
        if bad:
            raise SpecjaxError(f"capture depth {bad[0]} has no DFlash target_layer_id "
                               f"(ids index layer outputs 0..{L - 2}: depths 1..{L - 1})")
        extra = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                 "num_hidden_layers": dcfg.num_layers, "num_target_layers": L,
                 "block_size": dcfg.gamma + 1,
                 "dflash_config": {"mask_token_id": dcfg.mask_token_id,
                                   "target_layer_ids": [d - 1 for d in dcfg.capture]},
                 "layer_types": ["full_attention"] * dcfg.num_layers,
                 "use_sliding_window": False, "sliding_window": None}
        _dflash2_fields(dcfg, extra)
    else:
        raise SpecjaxError(f"--to {layout!r}; use one of {LAYOUTS}")
    out = {}
    for name, (attr, i) in tensor_table(dcfg).items():
        w = np.asarray(weights[attr])
        w = w if i is None else w[i]
        out[name] = np.ascontiguousarray(w.T if name in TRANSPOSED else w)
    if layout == EAGLE3:
        V = dcfg.vocab_size
        if head is None or tuple(head.shape) != (V, dcfg.hidden_size):
            raise SpecjaxError("an eagle3-hf export needs the target's LM head [V, D]")
        ids = np.arange(V) if hot is None else np.sort(np.asarray(hot, np.int64))
        out["lm_head.weight"] = np.ascontiguousarray(head[ids])
        out["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        out["t2d"] = np.isin(np.arange(V), ids)
    return out, extra


def export_dir(src: str, dst: str, layout: str, target_dir: str | None = None,
               dtype: str = "bfloat16") -> str:
    """Writes drafter directory `src` (train.py's) to `dst` in `layout` ("eagle3-hf" or
    "dflash"): config.json and model.safetensors (float weights in `dtype`, "bfloat16"
    or "float32"), into a temporary sibling renamed at the end. Returns dst.

    Raises: SpecjaxError for an existing dst, an unreadable src, a target without a recorded or given
      directory or of other shapes, and drafters the layout cannot hold."""
    from safetensors.numpy import save_file

    from specjax.drafters.io import load_drafter, param_tensors

    if dtype not in ("bfloat16", "float32"):
        raise SpecjaxError(f"--dtype {dtype!r}; use bfloat16 or float32")
    if os.path.exists(dst):
        raise SpecjaxError(f"{dst} exists; remove it or pick another destination")
    dcfg, params, record = load_drafter(src)
    target_dir = target_dir or record.get("path")
    if not target_dir:
        raise SpecjaxError(f"{src} records no target directory; pass --target")
    target = ModelConfig.from_dir(target_dir)
    dcfg.check_target(target, where=f"drafter {src}")
    np_dtype = storage_dtype(dtype)
    weights = param_tensors(params)
    head = hot = None
    if layout == EAGLE3:
        from specjax.drafters.vocab import load_draft_vocab

        head, hot = target_head(target_dir, target), load_draft_vocab(src, target.vocab_size)
    tensors, extra = export_tensors(dcfg, weights, layout, head, hot)
    tensors = {k: (v.astype(np_dtype) if np.issubdtype(v.dtype, np.floating) or
                   v.dtype == ml_dtypes.bfloat16 else v) for k, v in tensors.items()}
    config = {**extra, **_base_config(dcfg, target, dtype)}
    parent = os.path.dirname(os.path.abspath(dst)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        for name in ("config.json", "model.safetensors"):
            os.chmod(os.path.join(tmp, name), 0o644)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


if __name__ == "__main__":  # `python -m specjax.drafters.convert`: specjax.tools.convert
    from specjax.tools.convert import main

    sys.exit(main())
