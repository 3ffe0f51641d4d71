"""Training and validation token streams, and the tokenizer, for one run.

    check_paths(cfg)              # before the run dir is created: every named path exists
    data = prepare_data(cfg)      # checks every path first; SpecjaxError names the fix
    rows, position = data.train.batch(position, B)       # i32[B, T+1], deterministic

Two sources (TrainConfig.data):
  corpus: stdlib    a byte-level BPE of model.vocab_size tokens is trained on the
                    train files (or `tokenizer_dir` is used), then the corpus is
                    tokenized; both are cached under `cache_dir` (specjax.data.corpus).
  tokens_npy: PATH  a flat token stream (.npy, any integer dtype), or a list of them
                    read as their concatenation (`specjax.data.packing.ConcatStream`), with an
                    optional `val_tokens_npy` and `tokenizer_dir` (tests, custom
                    corpora, regenerated data sets), and optional loss masks
                    `loss_mask_npy` / `val_loss_mask_npy` (chat data from
                    `python -m specjax.prepare`: only assistant tokens are targets).
With several processes, process 0 builds the caches first and the others follow.

A drafter run (objective ttt / block) reads the vocabulary from its target instead of
`model.vocab_size`, never trains a tokenizer (the target's is used: data.tokenizer_dir,
else the target directory's own tokenizer), and refuses a tokenizer or a stream that
does not fit the target's vocabulary.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from specjax.data.packing import ConcatStream, PackedStream
from specjax.errors import SpecjaxError
from specjax.train import mesh as mesh_lib
from specjax.train.config import TrainConfig


@dataclasses.dataclass
class RunData:
    """train: rows for optimizer steps; val: held-out rows (None: no validation);
    tokenizer: a transformers tokenizer saved with the export (None if not known)."""

    train: PackedStream
    val: PackedStream | None
    tokenizer: object | None

    def eval_positions(self, batch_size: int, max_batches: int) -> list[int]:
        """Start positions of the fixed validation batches (at most one epoch's worth)."""
        if self.val is None:
            return []
        n = min(max_batches, -(-self.val.num_sequences // batch_size))
        return [i * batch_size for i in range(n)]


@dataclasses.dataclass(frozen=True)
class _Vocab:
    """The vocabulary the streams must fit: V, how messages name it, and the fix."""

    size: int
    target: str | None = None  # the target directory of a drafter run

    @classmethod
    def of(cls, cfg: TrainConfig, vocab_size: int | None) -> _Vocab:
        if not cfg.trains_drafter:
            return cls(cfg.model.vocab_size)
        return cls(vocab_size, cfg.target_dir)

    @property
    def name(self) -> str:
        if self.target is None:
            return "model.vocab_size"
        return f"target {self.target} vocab_size"

    @property
    def fix(self) -> str:
        if self.target is None:
            return "raise model.vocab_size"
        return "use the target's tokenizer (data.tokenizer_dir) and token streams"


def _load_tokenizer(path: str, vocab: _Vocab):
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and not os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):
        raise SpecjaxError(f"data.tokenizer_dir {path} holds no tokenizer.json; pass a "
                           "directory written by save_pretrained")
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # tokenizers raise many types
        raise SpecjaxError(f"data.tokenizer_dir {path} is unreadable ({e})") from None
    if len(tok) > vocab.size:
        raise SpecjaxError(f"the tokenizer in {path} has {len(tok)} tokens but "
                           f"{vocab.name}={vocab.size}; {vocab.fix}")
    return tok


def _need_file(path: str, key: str) -> None:
    if not os.path.isfile(path):
        raise SpecjaxError(f"{key} {path} does not exist; pass an existing .npy token file")


def _need_corpus_root(root: str | None) -> None:
    if root is not None and not os.path.isdir(root):
        raise SpecjaxError(f"data.corpus_root {root} is not a directory; pass a directory "
                           "of .py files or leave it unset for the standard library")


def check_paths(cfg: TrainConfig) -> None:
    """The cheap part of `prepare_data`, run before anything is written: every file and
    directory the data section names exists.

    Raises: SpecjaxError (the message `prepare_data` gives) for a missing token file,
      corpus root or tokenizer directory."""
    d = cfg.data
    if d.corpus is not None:
        _need_corpus_root(d.corpus_root)
        if d.tokenizer_dir is not None and not os.path.isdir(d.tokenizer_dir):
            raise SpecjaxError(f"data.tokenizer_dir {d.tokenizer_dir} does not exist; leave "
                               "it unset to train a tokenizer into data.cache_dir")
        return
    for path in d.tokens_npy:
        _need_file(path, "data.tokens_npy")
    if d.val_tokens_npy is not None:
        _need_file(d.val_tokens_npy, "data.val_tokens_npy")
    for path in d.loss_mask_npy or ():
        _need_file(path, "data.loss_mask_npy")
    if d.val_loss_mask_npy is not None:
        _need_file(d.val_loss_mask_npy, "data.val_loss_mask_npy")
    if d.tokenizer_dir is not None and not os.path.isdir(d.tokenizer_dir):
        raise SpecjaxError(f"data.tokenizer_dir {d.tokenizer_dir} does not exist; pass a "
                           "directory written by save_pretrained")


def _load_stream(path: str, key: str, vocab: _Vocab) -> np.ndarray:
    _need_file(path, key)
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"{key} {path} is not a readable .npy file ({e})") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise SpecjaxError(f"{key} {path} must be a 1-D integer array, got "
                           f"{tokens.dtype}{list(tokens.shape)}")
    if tokens.size and (int(tokens.max()) >= vocab.size or int(tokens.min()) < 0):
        raise SpecjaxError(f"{key} {path} holds token ids outside [0, {vocab.size}) "
                           f"({vocab.name}); {vocab.fix}")
    return tokens


def _load_mask(path: str, key: str, tokens: np.ndarray, tokens_path: str) -> np.ndarray:
    """The loss mask at `path` for the stream read from `tokens_path` (validated: 1-D,
    integer or bool, 0/1 only, as long as the stream, at least one 1)."""
    _need_file(path, key)
    try:
        mask = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise SpecjaxError(f"{key} {path} is not a readable .npy file ({e})") from None
    if mask.ndim != 1 or not (np.issubdtype(mask.dtype, np.integer) or mask.dtype == bool):
        raise SpecjaxError(f"{key} {path} must be a 1-D integer array of 0/1, got "
                           f"{mask.dtype}{list(mask.shape)}")
    if len(mask) != len(tokens):
        raise SpecjaxError(f"{key} {path} has {len(mask)} entries but its token stream "
                           f"{tokens_path} has {len(tokens)}; pass the mask written with it")
    if mask.size and (int(mask.max()) > 1 or int(mask.min()) < 0):
        raise SpecjaxError(f"{key} {path} holds values other than 0 and 1")
    if not mask.any():
        raise SpecjaxError(f"{key} {path} is all zeros: no token would be trained on")
    return mask


def _corpus_paths(cfg: TrainConfig) -> tuple[str, dict[str, str]]:
    """(tokenizer_dir, {"train": npy, "val": npy}), building the caches when missing."""
    from specjax.data import corpus

    d = cfg.data
    root = d.corpus_root
    _need_corpus_root(root)
    tok_dir = d.tokenizer_dir or _default_tokenizer_dir(cfg)
    if d.tokenizer_dir is not None and not os.path.isdir(tok_dir):
        raise SpecjaxError(f"data.tokenizer_dir {tok_dir} does not exist; leave it unset to "
                           "train a tokenizer into data.cache_dir")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        if cfg.trains_drafter:
            raise SpecjaxError(f"no tokenizer.json in {tok_dir}; set data.tokenizer_dir to "
                               "the tokenizer of the target")
        corpus.train_tokenizer(tok_dir, vocab_size=cfg.model.vocab_size, root=root,
                               val_fraction=d.val_fraction)
    paths = corpus.tokenize_corpus(tok_dir, os.path.join(cfg.cache_dir, "tokens"), root,
                                   val_fraction=d.val_fraction)
    return tok_dir, paths


def _default_tokenizer_dir(cfg: TrainConfig) -> str:
    """A corpus run's tokenizer when data.tokenizer_dir is unset: trained into the cache
    (lm), or the target directory's own (drafter runs)."""
    if cfg.trains_drafter:
        return cfg.target_dir
    return os.path.join(cfg.cache_dir, "tokenizer")


def prepare_data(cfg: TrainConfig, vocab_size: int | None = None) -> RunData:
    """Validates the data section, builds any missing caches, and opens the streams.

    Args:
      cfg: the run's config.
      vocab_size: V of the target (drafter runs; lm runs use model.vocab_size).
    Raises: SpecjaxError for a missing file or directory, a stream with ids outside
    the vocabulary, a tokenizer larger than the vocabulary, or a stream too short
    for one row of seq_len + 1 tokens.
    """
    import jax

    d, V = cfg.data, _Vocab.of(cfg, vocab_size)
    if d.corpus is not None:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if jax.process_index() == 0:
                _corpus_paths(cfg)
            multihost_utils.sync_global_devices("specjax.train.inputs: corpus cache")
        tok_dir, paths = _corpus_paths(cfg)
        train_path, val_path = paths["train"], paths["val"]
        train_key = val_key = "data.corpus cache"
    else:
        tok_dir, train_path, val_path = d.tokenizer_dir, d.tokens_npy, d.val_tokens_npy
        if tok_dir is None and cfg.trains_drafter and os.path.isfile(
                os.path.join(cfg.target_dir, "tokenizer.json")):
            tok_dir = cfg.target_dir
        train_key, val_key = "data.tokens_npy", "data.val_tokens_npy"
    tokenizer = None
    if tok_dir is not None:
        if not os.path.isdir(tok_dir):
            raise SpecjaxError(f"data.tokenizer_dir {tok_dir} does not exist; pass a directory "
                               "written by save_pretrained")
        tokenizer = _load_tokenizer(tok_dir, V)
    if isinstance(train_path, str):  # the corpus cache
        train_path = (train_path,)
    parts = [_load_stream(p, train_key, V) for p in train_path]
    masks = None
    if d.loss_mask_npy is not None:
        masks = [_load_mask(m, "data.loss_mask_npy", t, p)
                 for m, t, p in zip(d.loss_mask_npy, parts, train_path, strict=True)]
        masks = masks[0] if len(masks) == 1 else ConcatStream(masks)
    train = PackedStream(parts[0] if len(parts) == 1 else ConcatStream(parts), d.seq_len,
                         d.seed, loss_mask=masks)
    val = None
    if val_path is not None:
        val_tokens = _load_stream(val_path, val_key, V)
        val_mask = None
        if d.val_loss_mask_npy is not None:
            val_mask = _load_mask(d.val_loss_mask_npy, "data.val_loss_mask_npy", val_tokens,
                                  val_path)
        val = PackedStream(val_tokens, d.seq_len, d.seed, loss_mask=val_mask)
    return RunData(train=train, val=val, tokenizer=tokenizer)


def global_batch(stream: PackedStream, position: int, batch_size: int, sharding,
                 shape: tuple[int, ...] | None = None):
    """The B rows at `position` as the global jax.Array(s) a train or eval step takes, and
    the next position.

    Args:
      stream: the PackedStream; position, batch_size: as `PackedStream.batch`.
      sharding: the step's batch NamedSharding.
      shape: reshape the rows first (e.g. (A, B/A, T+1) for gradient accumulation).
    Returns: (batch, position + B): batch is i32[..., T+1] rows, or with a loss mask the
      pair (rows, u8[..., T+1] mask), the form `specjax.train.step.split_batch` reads.
    """
    rows, nxt = stream.batch(position, batch_size)
    mask = stream.mask_rows(position, batch_size)
    if shape is not None:
        rows = rows.reshape(shape)
        mask = None if mask is None else mask.reshape(shape)
    rows = mesh_lib.host_to_global(rows, sharding)
    if mask is None:
        return rows, nxt
    return (rows, mesh_lib.host_to_global(mask, sharding)), nxt


def special_ids(cfg: TrainConfig, tokenizer):
    """The model config with EOS / pad ids filled in from the tokenizer when the model
    section names none (so the export's generation_config.json stops at EOS)."""
    model = cfg.model
    if tokenizer is None:
        return model
    updates = {}
    if not model.eos_token_ids and tokenizer.eos_token_id is not None:
        updates["eos_token_ids"] = (int(tokenizer.eos_token_id),)
    if model.pad_token_id is None and tokenizer.pad_token_id is not None:
        updates["pad_token_id"] = int(tokenizer.pad_token_id)
    return dataclasses.replace(model, **updates) if updates else model
