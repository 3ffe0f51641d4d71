"""Model configuration: one frozen dataclass for the Qwen3 and Llama-3 families.

Built from a HF `config.json` through `transformers.AutoConfig` (which accepts both
the v5 `rope_parameters` layout and the older top-level `rope_theta` /
`rope_scaling`), and written back with `to_hf_config` so exported checkpoints load
in transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from specjax.errors import SpecjaxError
from specjax.fileio import read_config_json

FAMILIES = ("qwen3", "llama")

# RoPE scalings specjax computes: (required keys, optional keys) of each rope_type, as
# transformers names them in `rope_parameters` (modeling_rope_utils).
ROPE_TYPES = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
              "truncate")),
}


def rope_scaling_pairs(rope: dict, default: str = "default"):
    """`ModelConfig.rope_scaling` from a HF `rope_parameters` / `rope_scaling` mapping:
    None for plain RoPE, else (key, value) pairs: llama3's four fields as before (no
    rope_type pair), or ("rope_type", "yarn") followed by YaRN's fields (floats; truncate
    a bool). `default`: the type of a mapping without rope_type/type ("llama3" for a
    train config's model section, which predates YaRN).

    Raises: SpecjaxError for another rope_type, a missing field, or a non-numeric value."""
    kind = rope.get("rope_type", rope.get("type", default))
    if kind in ("default", None):
        return None
    if kind not in ROPE_TYPES:
        raise SpecjaxError(f"unsupported rope_type {kind!r}; expected default, "
                           f"{' or '.join(ROPE_TYPES)}")
    required, optional = ROPE_TYPES[kind]
    missing = [k for k in required if rope.get(k) is None]
    if missing:
        raise SpecjaxError(f"{kind} RoPE scaling needs {', '.join(missing)}")
    pairs = [] if kind == "llama3" else [("rope_type", kind)]
    for k in required + optional:
        v = rope.get(k)
        if v is None:
            continue
        if k == "truncate":
            if not isinstance(v, bool):
                raise SpecjaxError(f"rope scaling truncate={v!r} must be true or false")
            pairs.append((k, v))
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise SpecjaxError(f"rope scaling {k}={v!r} must be a number")
        pairs.append((k, float(v)))
    return tuple(pairs)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * float(np.log(scale)) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (shape letters from docs/design.md section 2).

    Attributes:
      family: "qwen3" (per-head q/k RMSNorm) or "llama".
      vocab_size: V.
      hidden_size: D.
      num_layers: L.
      num_heads: N (query heads).
      num_kv_heads: K (KV heads); N % K == 0 (GQA).
      head_dim: H, explicit: Qwen3-0.6B has N*H != D.
      intermediate_size: F (SwiGLU width).
      rms_norm_eps: epsilon inside every RMSNorm.
      rope_theta: RoPE base.
      rope_scaling: None, or the scaling's fields as a tuple of (key, value) pairs: llama3's
        (`factor`, `low_freq_factor`, `high_freq_factor`,
        `original_max_position_embeddings`), or ("rope_type", "yarn") and YaRN's
        (`factor`, `original_max_position_embeddings`, optionally `beta_fast`,
        `beta_slow`, `attention_factor`, `mscale`, `mscale_all_dim`, `truncate`); see
        `rope_scaling_pairs`.
      tie_word_embeddings: LM head shares the embedding matrix.
      attention_bias: q/k/v/o projections carry a bias.
      max_position_embeddings: the model's declared context length.
      eos_token_ids: ids that end a generation (from generation_config.json).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float | str | bool], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise SpecjaxError(f"unsupported model family {self.family!r}; expected one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecjaxError(f"{name}={v!r} must be a positive integer")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not np.isfinite(v) or v <= 0:
                raise SpecjaxError(f"{name}={v!r} must be a positive number")
        for name in ("bos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise SpecjaxError(f"{name}={v!r} must be a token id (an integer) or null")
        if self.num_heads % self.num_kv_heads:
            raise SpecjaxError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise SpecjaxError(f"head_dim={self.head_dim} must be even for RoPE")

    @functools.cached_property
    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included (tied counted once)."""
        D, H, N, K, F, V, L = (self.hidden_size, self.head_dim, self.num_heads,
                               self.num_kv_heads, self.intermediate_size, self.vocab_size,
                               self.num_layers)
        per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D
        if self.family == "qwen3":
            per_layer += 2 * H
        if self.attention_bias:
            per_layer += N * H + 2 * K * H + D
        head = 0 if self.tie_word_embeddings else V * D
        return V * D + L * per_layer + D + head

    @property
    def rope_type(self) -> str:
        """"default", "llama3" or "yarn"."""
        if self.rope_scaling is None:
            return "default"
        return str(dict(self.rope_scaling).get("rope_type", "llama3"))

    @property
    def attention_scaling(self) -> float:
        """The factor on RoPE's cos and sin (so on every attention logit, squared): YaRN's
        attention temperature, 1.0 for the other types. transformers
        `modeling_rope_utils._compute_yarn_parameters`: `attention_factor` if given, else
        mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
        0.1 ln(factor) + 1 (YaRN, arXiv 2309.00071, eq. 22)."""
        if self.rope_type != "yarn":
            return 1.0
        s = dict(self.rope_scaling)
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        if s.get("mscale") and s.get("mscale_all_dim"):
            return (_yarn_mscale(s["factor"], s["mscale"])
                    / _yarn_mscale(s["factor"], s["mscale_all_dim"]))
        return _yarn_mscale(s["factor"])

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies f64[H/2], with llama3 or YaRN scaling when configured.

        Source: transformers `modeling_rope_utils._compute_llama3_parameters` and
        `_compute_yarn_parameters`.
        """
        H = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H))
        if self.rope_scaling is None:
            return inv
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(inv)
        s = dict(self.rope_scaling)
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_ctx = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / lo, old_ctx / hi
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def _yarn_inv_freq(self, inv: np.ndarray) -> np.ndarray:
        """YaRN's blend (arXiv 2309.00071 section 3.2, "NTK-by-parts"): the dimensions that
        turn more than beta_fast times over the original context keep their frequency,
        those under beta_slow times are divided by `factor`, a linear ramp between."""
        s = dict(self.rope_scaling)
        H, base, factor = self.head_dim, self.rope_theta, s["factor"]
        old_ctx = s["original_max_position_embeddings"]
        beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0

        def dim_of(rotations):  # the dimension that turns `rotations` times over old_ctx
            return H * np.log(old_ctx / (rotations * 2 * np.pi)) / (2 * np.log(base))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if s.get("truncate", True):
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0.0), min(high, H - 1.0)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(H // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        keep = 1.0 - ramp  # 1: the unscaled frequency (extrapolation)
        return inv / factor * (1 - keep) + inv * keep

    # ------------------------------------------------------------------ HF I/O

    @classmethod
    def from_hf_config(cls, hf, eos_token_ids=None) -> ModelConfig:
        """Builds from a `transformers.PretrainedConfig` (Qwen3Config or LlamaConfig)."""
        model_type = getattr(hf, "model_type", None)
        family = {"qwen3": "qwen3", "llama": "llama"}.get(model_type)
        if family is None:
            raise SpecjaxError(
                f"unsupported architecture model_type={model_type!r}; specjax loads qwen3 and llama"
            )
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        scaling = rope_scaling_pairs(rope)
        if getattr(hf, "mlp_bias", False):
            raise SpecjaxError("mlp_bias=true is not supported")
        layer_types = getattr(hf, "layer_types", None) or ()
        if getattr(hf, "use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types):
            raise SpecjaxError("sliding-window attention (use_sliding_window / layer_types) "
                               "is not supported; specjax runs full attention only")
        N = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // N
        if eos_token_ids is None:
            eos_token_ids = getattr(hf, "eos_token_id", None)
        return cls(
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=N,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or N,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
            eos_token_ids=_as_id_tuple(eos_token_ids),
            bos_token_id=getattr(hf, "bos_token_id", None),
            pad_token_id=getattr(hf, "pad_token_id", None),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        """Reads `config.json` (and `generation_config.json` for EOS ids) in `path`.

        Raises:
          SpecjaxError: missing/unreadable directory or file, unsupported architecture.
        """
        cfg_path = os.path.join(path, "config.json")
        raw = read_config_json(path, "HF checkpoint", hint="pass a local HF model directory")
        model_type = raw.get("model_type")
        if model_type not in ("qwen3", "llama"):
            archs = raw.get("architectures")
            raise SpecjaxError(
                f"{cfg_path}: unsupported architecture model_type={model_type!r} "
                f"(architectures={archs}); specjax loads qwen3 and llama checkpoints"
            )
        import transformers  # configs only; no model code is imported

        try:
            hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers/huggingface_hub raise many validation types
            msg = " ".join(str(e).split())[:300]
            raise SpecjaxError(f"{cfg_path}: invalid config ({msg})") from None
        eos = None
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            try:
                with open(gen_path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as e:
                raise SpecjaxError(f"{gen_path} is unreadable ({e})") from None
        try:
            return cls.from_hf_config(hf, eos_token_ids=eos)
        except SpecjaxError as e:
            raise SpecjaxError(f"{cfg_path}: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            msg = " ".join(str(e).split())[:300]
            raise SpecjaxError(f"{cfg_path}: invalid config ({type(e).__name__}: {msg})") from None

    def to_hf_config(self, dtype: str = "float32"):
        """Returns the matching `transformers.Qwen3Config` / `LlamaConfig`."""
        import transformers

        rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update({k: v for k, v in self.rope_scaling if k != "rope_type"})
            rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
            eos_token_id=(list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                          else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            dtype=dtype,
        )
        if self.family == "qwen3":
            return transformers.Qwen3Config(**common)
        return transformers.LlamaConfig(**common)


def _as_id_tuple(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(int(i) for i in ids)
