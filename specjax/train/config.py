"""Training configuration: frozen dataclasses, validated from YAML plus `--set` overrides.

    cfg = load_config("configs/demo_target.yaml", ["train.steps=20", "optim.lr=1e-3"])

A YAML file holds the sections below (every key optional except `data`, and `model`
for objective lm, `drafter` for ttt and block); keys use the dataclass field names,
and `--set` overrides use the same dotted names (`train.batch_size=16`, `mesh.fsdp=2`,
`model.num_layers=4`, `drafter.gamma=5`). An unknown key, a value of the wrong type
or an inconsistent combination raises SpecjaxError with a one-line message; the CLI
turns it into exit code 2.

    objective: lm            # lm (a language model), ttt or block (a drafter, docs/design.md 6)
    run_dir: runs/NAME       # checkpoints, metrics.jsonl, config.yaml, hf/ or drafter/
    model:  specjax.models.config.ModelConfig fields (family, vocab_size, hidden_size, ...); lm only
    target: DIR              # ttt / block: the frozen target's HF directory
    drafter: DrafterTrainConfig   # ttt / block: the drafter and its loss
    data:   DataConfig       # corpus: stdlib, or tokens_npy (+ loss_mask_npy, tokenizer_dir)
    mesh:   MeshConfig       # data x fsdp x model devices
    optim:  OptimConfig      # AdamW, warmup + cosine, global-norm clipping
    train:  TrainLoopConfig  # steps, batch, accumulation, intervals
    export: ExportConfig     # HF directory written at the end
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import yaml

from specjax.errors import SpecjaxError
from specjax.mesh import MeshConfig  # noqa: F401  (part of the train config)
from specjax.models.config import ModelConfig

OBJECTIVES = ("lm", "ttt", "block")  # lm trains a Transformer; ttt and block a drafter
DRAFTER_OBJECTIVES = ("ttt", "block")
# Which drafter kinds each drafter objective trains (docs/design.md 6): each kind declares
# it (`specjax.drafters.registry.objective_kinds`): training-time test unrolls the chain
# drafters; block-wise training is the parallel block drafter's.
DEFAULT_TARGET = "checkpoints/demo/target"  # the bundled demo target (relative to the cwd)
CORPORA = ("stdlib",)
DTYPES = ("float32", "bfloat16")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise SpecjaxError(f"{name}={value} must be >= 1")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the token streams come from.

    Attributes:
      corpus: "stdlib" (the Python standard library: a BPE of `model.vocab_size`
        tokens is trained and the corpus tokenized into `cache_dir`), or None.
      corpus_root: directory of .py files for `corpus` (None: the running stdlib).
      tokens_npy: flat token streams (.npy, int) to train on, instead of `corpus`: one
        path, or a list read as the streams' concatenation in that order (a row may
        span two files, as in `np.concatenate`; nothing is copied).
      val_tokens_npy: optional validation stream for `tokens_npy` (None: no val loss).
      loss_mask_npy: optional loss masks for `tokens_npy` (.npy, 0/1 integers, e.g. the
        uint8 `loss_mask.npy` of `python -m specjax.prepare`): one per token file, each as
        long as its stream; the losses and the simulated alpha_k then average over the
        positions whose target token has mask 1 only (assistant tokens of chat data).
        None: every token is a target.
      val_loss_mask_npy: the loss mask of `val_tokens_npy` (e.g. prepare's
        `val_loss_mask.npy`); needs `loss_mask_npy`.
      tokenizer_dir: HF tokenizer saved with the export; with `corpus`, an existing
        tokenizer to use instead of training one.
      cache_dir: tokenizer and token cache for `corpus` (None: `<run_dir>/data`).
        Point the target and the draft at the same one: they must share a tokenizer.
      val_fraction: share of corpus files held out for validation.
      seq_len: T, tokens per training row (each row holds T + 1 tokens).
      seed: picks the order of rows in every epoch (specjax.data.packing.PackedStream).
    """

    corpus: str | None = None
    corpus_root: str | None = None
    tokens_npy: tuple[str, ...] | None = None
    val_tokens_npy: str | None = None
    loss_mask_npy: tuple[str, ...] | None = None
    val_loss_mask_npy: str | None = None
    tokenizer_dir: str | None = None
    cache_dir: str | None = None
    val_fraction: float = 0.05
    seq_len: int = 256
    seed: int = 0

    def __post_init__(self):
        if self.tokens_npy is not None and not self.tokens_npy:
            raise SpecjaxError("data.tokens_npy is an empty list; name at least one .npy")
        if (self.corpus is None) == (self.tokens_npy is None):
            raise SpecjaxError("data: set exactly one of data.corpus (stdlib) and "
                               "data.tokens_npy (a .npy token stream)")
        if self.corpus is not None and self.corpus not in CORPORA:
            raise SpecjaxError(f"data.corpus={self.corpus!r} is unknown; use one of {CORPORA}")
        if self.val_tokens_npy is not None and self.tokens_npy is None:
            raise SpecjaxError("data.val_tokens_npy needs data.tokens_npy; a corpus has its "
                               "own validation split")
        if self.loss_mask_npy is not None:
            if self.tokens_npy is None:
                raise SpecjaxError("data.loss_mask_npy needs data.tokens_npy: a mask belongs "
                                   "to a token stream (python -m specjax.prepare writes both)")
            if len(self.loss_mask_npy) != len(self.tokens_npy):
                raise SpecjaxError(f"data.loss_mask_npy names {len(self.loss_mask_npy)} "
                                   f"files but data.tokens_npy {len(self.tokens_npy)}; give "
                                   "one mask per token file, in the same order")
        if self.val_loss_mask_npy is not None and (
                self.val_tokens_npy is None or self.loss_mask_npy is None):
            raise SpecjaxError("data.val_loss_mask_npy needs data.val_tokens_npy and "
                               "data.loss_mask_npy")
        if (self.loss_mask_npy is not None and self.val_tokens_npy is not None
                and self.val_loss_mask_npy is None):
            raise SpecjaxError("data.loss_mask_npy is set but data.val_loss_mask_npy is not: "
                               "the validation loss would count every token; give the "
                               "validation mask too (prepare's val_loss_mask.npy)")
        _check_positive("data.seq_len", self.seq_len)
        if self.seed < 0:
            raise SpecjaxError(f"data.seed={self.seed} must be >= 0")
        if not 0.0 < self.val_fraction < 1.0:
            raise SpecjaxError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW (decoupled weight decay on matrices only) with linear warmup from 0 to
    `lr`, cosine decay to `lr * min_lr_ratio` at `train.steps`, and global-norm
    gradient clipping at `clip_norm` (0 = off). Loshchilov & Hutter 2019."""

    lr: float = 3e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self):
        if not self.lr > 0:
            raise SpecjaxError(f"optim.lr={self.lr} must be > 0")
        if self.warmup_steps < 0 or self.clip_norm < 0 or self.weight_decay < 0:
            raise SpecjaxError("optim.warmup_steps, optim.clip_norm and optim.weight_decay "
                               "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise SpecjaxError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise SpecjaxError("optim.b1 and optim.b2 must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig:
    """Attributes:
      steps: optimizer steps in the whole run (also the cosine schedule's length).
      batch_size: B, global rows per optimizer step (all processes together).
      grad_accum: micro-steps per optimizer step; each takes B / grad_accum rows,
        and that micro-batch must divide by data * fsdp.
      seed: parameter initialisation and the step RNG.
      dtype: parameter and activation dtype (float32 on CPU; bfloat16 halves memory).
      log_every: steps between metric lines (metrics.jsonl and the progress bar);
        each one waits for the device.
      eval_every: steps between validation losses (0 = only at the end).
      eval_batches: validation batches of B rows, always the same ones.
      checkpoint_every: steps between checkpoints (0 = only at the end or on SIGTERM).
      keep_checkpoints: checkpoints kept on disk (older ones are deleted).
      async_checkpointing: write checkpoints in a background thread.
      init_from: weights that start the run instead of a random initialisation (the
        optimizer state is fresh). Objective lm: an HF checkpoint directory whose
        config.json describes the same model as the `model` section (continued
        pre-training). Drafter objectives: an exported drafter directory trained against
        the same target; tensors of the same name and shape are loaded, the rest keep
        their random init (a hybrid from a trained eagle3, as KVShot did). Ignored when
        the run dir already holds a checkpoint (that one is resumed).
      init_from_other_target: drafter objectives: allow an init_from drafter that was
        trained against other target weights of the same shapes (re-fitting a drafter to
        a target trained on further, such as the long-context demo target). Off: such a
        drafter is refused.
      kernels: the attention of every training forward (`specjax/train/kernels.py`):
        "pallas" (`pallas_kernels.attention.packed_attention`, forward and backward
        kernels; interpret mode on CPU, slow), "reference" (jnp), "chunked" (jnp, one
        chunk of queries at a time with recomputation: rows of many thousand tokens on
        CPU), or "auto" (pallas on TPU and GPU, reference on CPU). `train.py --kernels`
        sets it.
      pose: objective lm: train at PoSE's skip-wise positions (Zhu et al., ICLR 2024,
        arXiv 2309.10400; `specjax.train.step.pose_positions`): each row of
        data.seq_len tokens is cut in two chunks and the second is moved to a random
        offset, so the RoPE distances up to model.max_position_embeddings are trained
        with short rows. Validation stays at positions 0..seq_len-1.
    """

    steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    dtype: str = "float32"
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    init_from: str | None = None
    init_from_other_target: bool = False
    kernels: str = "auto"
    pose: bool = False

    def __post_init__(self):
        if self.kernels not in ("auto", "pallas", "reference", "chunked"):
            raise SpecjaxError(f"train.kernels={self.kernels!r}; use one of auto, pallas, "
                               "reference, chunked")
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_batches",
                     "keep_checkpoints"):
            _check_positive(f"train.{name}", getattr(self, name))
        for name in ("seed", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise SpecjaxError(f"train.{name}={getattr(self, name)} must be >= 0")
        if self.batch_size % self.grad_accum:
            raise SpecjaxError(f"train.batch_size={self.batch_size} is not divisible by "
                               f"train.grad_accum={self.grad_accum}")
        if self.dtype not in DTYPES:
            raise SpecjaxError(f"train.dtype={self.dtype!r}; use one of {DTYPES}")

    @property
    def micro_batch(self) -> int:
        """Rows per micro-step: batch_size / grad_accum."""
        return self.batch_size // self.grad_accum


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """HF directory written when the run reaches `train.steps` (not on SIGTERM).

    Attributes:
      enabled: write it at all.
      dir: target directory (None: `<run_dir>/hf`).
      dtype: safetensors dtype, float32 or bfloat16.
    """

    enabled: bool = True
    dir: str | None = None
    dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise SpecjaxError(f"export.dtype={self.dtype!r}; use one of {DTYPES}")


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
    """The drafter a `ttt` / `block` run trains, and its loss (docs/design.md 5 and 6).

    The drafter's shapes follow the target (`DrafterConfig.for_target`); these fields
    choose the rest.

    Attributes:
      kind: a registered drafter kind (`specjax.drafters.registry`): eagle3 | kv | hybrid
        (objective ttt) or block (objective block) built in.
      gamma: G, draft length: TTT unroll steps, or mask tokens per block.
      num_layers: Ld, drafter layers (None: the kind's default; eagle3/hybrid: 1).
      intermediate_size: F of the drafter MLP (None: the target's).
      context: block only: hidden (DFlash), kv (merged target K/V) or both.
      num_kv_layers: Ls, target layers merged into the KV memory (kv, hybrid, block kv/both).
      capture: the target depths whose residual stream (the input of layer d) a drafter
        that reads hidden states takes (None: the kind's default, e.g. eagle3's {2, L/2,
        L-3}).
      kv_layers: the target layers whose K/V a drafter that reads the KV cache merges
        (None: `num_kv_layers` evenly spaced ones). K/V of layer d are projections of the
        same stream as capture depth d, so equal lists give both contexts the same
        target layers (the KVShot study's configs/study2/).
      mask_token_id: block only: id whose frozen target embedding fills the G draft
        slots (None: the target's pad id).
      soft_labels: train against the target's distribution (true) or against the data
        tokens (false, DFlash's hard labels).
      num_anchors: block only: blocks sampled per sequence per step.
      gamma_w: block only: loss weight exp(-(k-1)/gamma_w) of block position k.
      ttt_decay: ttt only: loss weight ttt_decay**k of unroll step k (EAGLE-3: 0.8).
      ttt_positions: ttt only: chains unrolled per sequence per step, at random anchors
        resampled every step (None: every position, as EAGLE-3). The LM head of every
        unroll step dominates the cost; 64 of 256 positions cut it 4x.
      selector_rank, selector_top_k: block only: DFlash2's path selector (rank R over the
        top-K candidates of each block position, `specjax.drafters.selector`; rank 0: none).
      selector_soft_labels: block with a selector only: train the selector against the
        target's distribution over its K candidates, renormalised, instead of the target's
        greedy token (DFlash2's; false). specjax's, for sampled drafting at T > 0: the
        one-hot target makes the selector's q sharper than p (`selector.train_terms`).
      conv_kernel_size, conv_group_size: block only: DFlash2's grouped dynamic causal
        convolution around each layer's attention and MLP (`specjax.drafters.conv`; taps
        0: none; DFlash2: 2 taps, groups of 16 channels).
      output_multiplier, final_logit_softcapping: block only: DFlash2's logit transforms
        (l * m, then tanh(l / c) * c for c > 0; 1.0 and 0: none).
      markov_rank, markov_head_type: block only: DSpark's Markov head (rank R, 0: none;
        vanilla, gated or rnn; `specjax.drafters.markov`), teacher-forced, its corrected
        logits in the cross-entropy.
      confidence_head, confidence_head_with_markov, confidence_alpha: block only: DSpark's
        confidence head (reading the Markov head's W1[x_{k-1}] too when with_markov),
        trained by BCE against 1 - TV(p_target, q_draft) with weight confidence_alpha
        (SpecForge: 1.0).
      sample_from_anchor: block only: DSpark's block layout ([anchor, G-1 masks], every
        slot drafts).
      block_causal: block only: causal attention inside the block (JetSpec's head).
      qk_norm: RMSNorm over each head of q and k (Qwen3-style). null (the default): off
        for eagle3, whose engines' layout (`LlamaForCausalLMEagle3` in vLLM, SGLang and
        SpecForge; `python -m specjax.drafters.convert --to eagle3-hf`) has none, so that
        what train.py makes exports to them; on for the other kinds.
    """

    kind: str
    gamma: int = 7
    num_layers: int | None = None
    intermediate_size: int | None = None
    context: str | None = None
    num_kv_layers: int = 3
    capture: tuple[int, ...] | None = None
    kv_layers: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    soft_labels: bool = True
    num_anchors: int = 32
    gamma_w: float = 7.0
    ttt_decay: float = 0.8
    ttt_positions: int | None = None
    qk_norm: bool | None = None
    selector_rank: int = 0
    selector_top_k: int = 16
    selector_soft_labels: bool = False
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False
    confidence_alpha: float = 1.0
    sample_from_anchor: bool = False
    block_causal: bool = False

    def __post_init__(self):
        if self.qk_norm is None:  # resolved here, so a saved run config records the value
            object.__setattr__(self, "qk_norm", self.kind != "eagle3")
        from specjax.drafters import registry

        if not registry.is_kind(self.kind):
            raise SpecjaxError(f"drafter.kind={self.kind!r} is unknown; use one of "
                               f"{registry.kinds()}")
        for name in ("gamma", "num_kv_layers", "num_anchors"):
            _check_positive(f"drafter.{name}", getattr(self, name))
        for name in ("num_layers", "intermediate_size"):
            if getattr(self, name) is not None:
                _check_positive(f"drafter.{name}", getattr(self, name))
        settings = registry.get(self.kind).settings
        for name in ("context", "mask_token_id"):
            value = getattr(self, name)
            if name in settings:
                choices = settings[name]
                if value is not None and choices is not None and value not in choices:
                    raise SpecjaxError(f"drafter.{name}={value!r} is unknown; use one of "
                                       f"{choices}")
            elif value is not None:
                owners = "/".join(registry.setting_kinds(name))
                raise SpecjaxError(f"drafter.{name} is a {owners} drafter setting; remove it "
                                   f"for drafter.kind={self.kind}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise SpecjaxError(f"drafter.mask_token_id={self.mask_token_id} must be >= 0")
        if not self.gamma_w > 0:
            raise SpecjaxError(f"drafter.gamma_w={self.gamma_w} must be > 0")
        if self.ttt_positions is not None:
            _check_positive("drafter.ttt_positions", self.ttt_positions)
        if not 0 < self.ttt_decay <= 1:
            raise SpecjaxError(f"drafter.ttt_decay={self.ttt_decay} must be in (0, 1]")
        if self.selector_soft_labels and not self.selector_rank:
            raise SpecjaxError("drafter.selector_soft_labels needs a path selector "
                               "(drafter.selector_rank > 0)")
        a = self.confidence_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a < float("inf"):
            raise SpecjaxError(f"drafter.confidence_alpha={a!r} must be a number >= 0")

    def for_target(self, target: ModelConfig):
        """The `specjax.drafters.config.DrafterConfig` of this drafter for `target`.

        Raises: SpecjaxError if the combination is invalid for that target (e.g. a
          mask_token_id outside its vocabulary, a capture depth or KV layer outside it,
          or `capture` / `kv_layers` for a drafter that reads no hidden states / no KV)."""
        from specjax.drafters.config import DrafterConfig, set_block_options

        try:
            cfg = DrafterConfig.for_target(
                target, self.kind, gamma=self.gamma, num_layers=self.num_layers,
                intermediate_size=self.intermediate_size, context=self.context,
                num_kv_layers=self.num_kv_layers, mask_token_id=self.mask_token_id,
                qk_norm=self.qk_norm)
            override = set_block_options(self)
            for name, uses in (("capture", cfg.uses_hidden), ("kv_layers", cfg.uses_kv)):
                value = getattr(self, name)
                if value is None:
                    continue
                if not uses:
                    what = "hidden states" if name == "capture" else "KV cache"
                    raise SpecjaxError(f"{name} is set but this {self.kind} drafter reads "
                                       f"no {what}; remove it")
                if not value or len(set(value)) != len(value):
                    raise SpecjaxError(f"{name}={list(value)} must list distinct layers")
                override[name] = tuple(sorted(value))
            return dataclasses.replace(cfg, **override) if override else cfg
        except SpecjaxError as e:
            raise SpecjaxError(f"drafter: {e}") from None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run; see the module docstring for the YAML layout.

    `model` is the Transformer an `lm` run trains; a drafter run (`ttt`, `block`) has
    none: its target's config.json (`target`, default DEFAULT_TARGET) fixes the shapes
    and the vocabulary, and `drafter` describes the network trained against it.
    """

    data: DataConfig
    model: ModelConfig | None = None
    objective: str = "lm"
    run_dir: str = "runs/default"
    target: str | None = None
    drafter: DrafterTrainConfig | None = None
    mesh: MeshConfig = MeshConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainLoopConfig = TrainLoopConfig()
    export: ExportConfig = ExportConfig()

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise SpecjaxError(f"objective={self.objective!r} is not implemented; use one of "
                               f"{OBJECTIVES}")
        if self.objective == "lm":
            if self.model is None:
                raise SpecjaxError("objective lm needs a model section (the Transformer to "
                                   "train); see configs/demo_target.yaml")
            for name in ("target", "drafter"):
                if getattr(self, name) is not None:
                    raise SpecjaxError(f"{name} is a drafter-training setting (objective ttt "
                                       "or block); remove it for objective lm")
            if self.train.pose and self.model.max_position_embeddings <= self.data.seq_len:
                raise SpecjaxError(
                    f"train.pose needs model.max_position_embeddings "
                    f"({self.model.max_position_embeddings}) above data.seq_len "
                    f"({self.data.seq_len}): it trains the positions beyond the rows")
            return
        if self.train.pose:
            raise SpecjaxError(f"train.pose trains a target's positions (objective lm); "
                               f"remove it for objective={self.objective}")
        if self.drafter is None:
            raise SpecjaxError(f"objective={self.objective} trains a drafter and needs a "
                               "drafter section (drafter.kind: ...); see configs/drafters/")
        if self.model is not None:
            raise SpecjaxError(f"objective={self.objective} takes the model from the target "
                               "directory; remove the model section (set target instead)")
        from specjax.drafters import registry

        kinds = registry.objective_kinds(self.objective)
        if self.drafter.kind not in kinds:
            other = registry.get(self.drafter.kind).objective
            raise SpecjaxError(f"objective={self.objective} trains drafter kinds {kinds}, not "
                               f"drafter.kind={self.drafter.kind}; use objective={other}")

    @property
    def trains_drafter(self) -> bool:
        """True for the drafter objectives (ttt, block)."""
        return self.objective in DRAFTER_OBJECTIVES

    @property
    def target_dir(self) -> str:
        """The frozen target's HF directory of a drafter run."""
        return self.target or DEFAULT_TARGET

    @property
    def cache_dir(self) -> str:
        """Tokenizer and token cache of a corpus run."""
        return self.data.cache_dir or os.path.join(self.run_dir, "data")

    @property
    def export_dir(self) -> str:
        """Where the export goes: export.dir, else `<run_dir>/hf` (lm) or
        `<run_dir>/drafter` (ttt, block)."""
        default = "drafter" if self.trains_drafter else "hf"
        return self.export.dir or os.path.join(self.run_dir, default)

    def to_dict(self) -> dict:
        """Plain YAML-able dict that `from_dict` turns back into an equal config."""
        out = dataclasses.asdict(self)
        model = out["model"]
        if model is not None and model["rope_scaling"] is not None:
            model["rope_scaling"] = dict(model["rope_scaling"])
        return _lists(out)


# ----------------------------------------------------------------------------- loading

def _lists(x):
    if isinstance(x, dict):
        return {k: _lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return x


def _coerce(tp, value, key: str):
    """`value` checked (and lightly converted) against the annotation `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, key)
    if origin is tuple:
        if args and typing.get_origin(args[0]) is tuple and isinstance(value, dict):
            # the one mapping of (key, value) pairs, model.rope_scaling: llama3 when the
            # mapping gives no rope_type
            from specjax.models.config import rope_scaling_pairs

            return rope_scaling_pairs(value, default="llama3")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # eos_token_ids: 0
        if isinstance(value, str) and args[0] is str:
            value = [value]  # data.tokens_npy: one path
        if not isinstance(value, (list, tuple)):
            raise SpecjaxError(f"config key {key} must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, key) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecjaxError(f"config key {key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecjaxError(f"config key {key} must be an integer, got {value!r}")
        return value
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # YAML reads 3e-4 (no dot) as a string
        except (TypeError, ValueError):
            raise SpecjaxError(f"config key {key} must be a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise SpecjaxError(f"config key {key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp} for {key}")


def from_dict(cls, raw, where: str = ""):
    """Builds dataclass `cls` from a mapping; unknown or missing keys raise SpecjaxError."""
    if not isinstance(raw, dict):
        name = where.rstrip(".") or "the config"
        raise SpecjaxError(f"config section {name} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in raw:
        if key not in names:
            raise SpecjaxError(f"unknown config key {where}{key}; known keys in this section: "
                               f"{', '.join(names)}")
    kwargs = {k: _coerce(hints[k], v, where + k) for k, v in raw.items()}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SpecjaxError(f"config key {where}{missing[0]} is required")
    return cls(**kwargs)


def apply_override(raw: dict, item: str) -> None:
    """Applies one `key.sub=value` override (value parsed as YAML) to `raw` in place."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise SpecjaxError(f"--set {item!r}: expected key=value, e.g. train.steps=20")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    parts = key.strip().split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        sub = node.setdefault(part, {})
        if not isinstance(sub, dict):
            raise SpecjaxError(f"--set {item!r}: {'.'.join(parts[:i + 1])} is not a section")
        node = sub
    node[parts[-1]] = value


def load_config(path: str, overrides=(), run_dir: str | None = None,
                target: str | None = None) -> TrainConfig:
    """Reads a YAML config, applies `--set` overrides, and validates it.

    Args:
      path: YAML file.
      overrides: "dotted.key=value" strings, applied in order.
      run_dir: replaces `run_dir` when given (default in the file: runs/<file stem>).
      target: replaces `target` (the frozen target of a drafter run) when given.
    Raises: SpecjaxError for an unreadable file, an unknown key or a bad value.
    """
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise SpecjaxError(f"config {path} is unreadable ({e.strerror}); pass an existing "
                           "YAML file") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: UnicodeDecodeError
        msg = " ".join(str(e).split())[:300]
        raise SpecjaxError(f"config {path} is not valid YAML ({msg})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise SpecjaxError(f"config {path} must hold a mapping of sections")
    raw.setdefault("run_dir", os.path.join("runs", os.path.splitext(os.path.basename(path))[0]))
    for item in overrides:
        apply_override(raw, item)
    if run_dir is not None:
        raw["run_dir"] = run_dir
    if target is not None:
        raw["target"] = target
    try:
        return from_dict(TrainConfig, raw)
    except SpecjaxError as e:
        raise SpecjaxError(f"{path}: {e}") from None


def dump_config(cfg: TrainConfig, path: str) -> None:
    """Writes the resolved config as YAML (loadable by `load_config`)."""
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
