"""Training text: the Python standard library, a BPE tokenizer, cached token streams.

    stdlib_root() -> corpus_files(root) -> split_of(relpath)        which files, which split
    train_tokenizer(out_dir, vocab_size, root)                         BPE on the train files
    tokenize_corpus(tokenizer_dir, cache_dir, root)                    train.npy, val.npy
    PackedStream(np.load(path), seq_len, seed).batch(position, B)      i32[B, T + 1] rows

The corpus is every `*.py` under the running interpreter's standard library (tests
included, site-packages excluded): about 1,790 files and 31.5 MB on every machine
(docs/design.md section 9). Files are named by their path relative to the root with '/'
separators, and the split hashes that name, so it is the same on every machine.

A token stream is a flat 1-D array: the files of one split in sorted path order,
each followed by EOS; files with no non-whitespace text are left out. Streams are
cached under a fingerprint of the tokenizer and the file list, so a second call
with the same inputs reads nothing but the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from specjax.data.packing import PackedStream
from specjax.errors import SpecjaxError
from specjax.fileio import atomic_write
from specjax.models.tokenizer import train_bpe

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["PackedStream", "VAL_FRACTION", "corpus_files", "load_manifest", "load_tokens",
           "read_source", "split_of", "stdlib_root", "tokenize_corpus", "train_tokenizer"]

VAL_FRACTION = 0.05  # share of files held out for validation (about 90 of 1,790)
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
MANIFEST = "manifest.json"
_FORMAT = 1  # bump when the stream layout changes, to invalidate old caches
_CHUNK_BYTES = 1 << 21  # source bytes handed to one encode_batch call (progress granularity)


# ----------------------------------------------------------------------------- corpus

def stdlib_root() -> str:
    """The running interpreter's standard-library directory (from `sysconfig`)."""
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str | None = None) -> list[str]:
    """Every `*.py` under `root` (default: `stdlib_root()`), tests included.

    Returns: sorted paths relative to `root`, with '/' separators. Directories named
    site-packages, dist-packages or __pycache__ are skipped, and so are files that
    cannot be opened (broken links, no permission).
    Raises: SpecjaxError if `root` is not a directory or holds no readable `*.py`.
    """
    root = stdlib_root() if root is None else root
    if not os.path.isdir(root):
        raise SpecjaxError(f"corpus root {root!r} is not a directory; pass an existing "
                           "directory of .py files (or None for the standard library)")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb"):
                    pass
            except OSError:
                continue
            out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    if not out:
        raise SpecjaxError(f"no readable .py files under corpus root {root!r}; pass a "
                           "directory that contains Python source")
    return sorted(out)


def split_of(relpath: str, val_fraction: float = VAL_FRACTION) -> str:
    """'train' or 'val' for a file, from the sha256 of its relative path.

    The first 8 bytes of the digest, read as a fraction of 2**64, go to 'val' when
    below `val_fraction`: stable across runs, machines and file orders.
    """
    if not 0.0 <= val_fraction <= 1.0:
        raise SpecjaxError(f"val_fraction {val_fraction} is outside [0, 1]; use e.g. 0.05")
    digest = hashlib.sha256(relpath.replace(os.sep, "/").encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2.0**64 else "train"


def read_source(root: str, relpath: str) -> str:
    """A file's text; bytes that are not UTF-8 become U+FFFD (4 stdlib test files)."""
    with open(os.path.join(root, relpath), "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def _splits(root: str | None, val_fraction: float,
            need: tuple[str, ...]) -> tuple[str, dict[str, list[str]]]:
    """The root and its sorted files by split; SpecjaxError if a split in `need` is empty."""
    root = stdlib_root() if root is None else root
    files = corpus_files(root)
    splits = {"train": [], "val": []}
    for rel in files:
        splits[split_of(rel, val_fraction)].append(rel)
    for name in need:
        if not splits[name]:
            raise SpecjaxError(f"the {name} split of corpus root {root!r} is empty "
                               f"({len(files)} files, val_fraction {val_fraction}); add "
                               "files or change val_fraction")
    return root, splits


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(out_dir: str, vocab_size: int = 8192, root: str | None = None, *,
                    val_fraction: float = VAL_FRACTION) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE (specjax.models.tokenizer.train_bpe) on the TRAIN files only.

    Writes `out_dir` with `save_pretrained`, so that
    `transformers.AutoTokenizer.from_pretrained(out_dir)` loads it offline. Files are
    written to a temporary directory first and moved in one by one.

    Returns: the `transformers.PreTrainedTokenizerFast`, `len(tok) == vocab_size`,
    eos `<|endoftext|>` id 0 and pad `<|pad|>` id 1.
    Raises: SpecjaxError for a missing or empty root, `vocab_size` below 258, or a
    corpus with too little text to learn `vocab_size` tokens.
    """
    root, splits = _splits(root, val_fraction, need=("train",))
    tok = train_bpe((read_source(root, rel) for rel in splits["train"]), vocab_size)
    if len(tok) != vocab_size:
        raise SpecjaxError(f"the train files under {root!r} only support {len(tok)} BPE "
                           f"tokens, not vocab_size {vocab_size}; lower vocab_size or add "
                           "files")
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".tmp-") as tmp:
        tok.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    return tok


# ----------------------------------------------------------------------------- token cache

def _encode_texts(backend, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (parallel, in Rust)."""
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fingerprint(tokenizer_dir: str, root: str, splits: dict[str, list[str]],
                 val_fraction: float) -> str:
    """sha256 of the tokenizer files, the split file lists and their sizes in bytes.

    The absolute root is not part of it, so a cache copied to another machine with
    the same standard library is still a hit. An edit that keeps a file's size is
    not noticed: delete the cache after editing corpus files.
    """
    tok_files = {name: _file_sha256(os.path.join(tokenizer_dir, name))
                 for name in ("tokenizer.json", "tokenizer_config.json")
                 if os.path.exists(os.path.join(tokenizer_dir, name))}
    files = {split: [[rel, os.path.getsize(os.path.join(root, rel))] for rel in rels]
             for split, rels in splits.items()}
    key = {"format": _FORMAT, "tokenizer": tok_files, "val_fraction": val_fraction,
           "files": files}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def load_manifest(cache_dir: str) -> dict | None:
    """The manifest of a token cache (fingerprint, dtype, per-split counts), or None."""
    try:
        with open(os.path.join(cache_dir, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_tokens(path: str) -> np.ndarray:
    """A cached token stream, memory-mapped read-only: u16[n] or i32[n]."""
    return np.load(path, mmap_mode="r")


def _cache_hit(cache_dir: str, fingerprint: str) -> bool:
    manifest = load_manifest(cache_dir)
    if manifest is None or manifest.get("fingerprint") != fingerprint:
        return False
    return all(os.path.exists(os.path.join(cache_dir, s["file"]))
               for s in manifest["splits"].values())


def _chunks(rels: list[str], sizes: list[int], max_bytes: int):
    """Consecutive runs of `rels` of about `max_bytes` source bytes: (rels, bytes)."""
    chunk, nbytes = [], 0
    for rel, size in zip(rels, sizes, strict=True):
        chunk.append(rel)
        nbytes += size
        if nbytes >= max_bytes:
            yield chunk, nbytes
            chunk, nbytes = [], 0
    if chunk:
        yield chunk, nbytes


def _tokenize_split(backend, root: str, rels: list[str], eos_id: int, dtype,
                    desc: str) -> tuple[np.ndarray, dict]:
    """One split's stream (each non-blank file's ids, then EOS) and its counts."""
    from tqdm import tqdm

    sizes = [os.path.getsize(os.path.join(root, rel)) for rel in rels]
    parts, docs = [], 0
    eos = np.array([eos_id], dtype)
    with tqdm(total=sum(sizes), desc=desc, unit="B", unit_scale=True, file=sys.stderr,
              mininterval=1.0) as bar:
        for chunk, nbytes in _chunks(rels, sizes, _CHUNK_BYTES):
            texts = [t for t in (read_source(root, rel) for rel in chunk) if t.strip()]
            for ids in _encode_texts(backend, texts):
                parts += [np.asarray(ids, dtype), eos]
            docs += len(texts)
            bar.update(nbytes)
    tokens = np.concatenate(parts) if parts else np.zeros([0], dtype)
    return tokens, {"files": len(rels), "documents": docs, "bytes": sum(sizes),
                    "tokens": int(tokens.size)}


def tokenize_corpus(tokenizer_dir: str, cache_dir: str, root: str | None = None, *,
                    val_fraction: float = VAL_FRACTION) -> dict[str, str]:
    """Tokenizes the train and val files into `cache_dir`/{train,val}.npy (cached).

    Each stream is u16[n] (i32[n] for vocabularies over 65,536): the split's files
    in sorted path order, each followed by the tokenizer's EOS id; files with no
    non-whitespace text are skipped. `cache_dir`/manifest.json records the
    fingerprint (tokenizer files, file list, sizes), the dtype and per-split counts
    (files, documents, source bytes, tokens). When the fingerprint matches, nothing
    is read or tokenized. Every file is written to a temporary name and renamed.

    Returns: {"train": path, "val": path}.
    Raises: SpecjaxError for a missing tokenizer.json, a missing or empty root, or an
    empty split.
    """
    tok_json = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(tok_json):
        raise SpecjaxError(f"no tokenizer.json in {tokenizer_dir!r}; run "
                           "specjax.data.corpus.train_tokenizer first or pass a fast HF tokenizer")
    root, splits = _splits(root, val_fraction, need=("train", "val"))
    paths = {split: os.path.join(cache_dir, f"{split}.npy") for split in splits}
    fingerprint = _fingerprint(tokenizer_dir, root, splits, val_fraction)
    if _cache_hit(cache_dir, fingerprint):
        return paths

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if tok.eos_token_id is None:
        raise SpecjaxError(f"the tokenizer in {tokenizer_dir!r} declares no eos token; "
                           "set eos_token in its tokenizer_config.json")
    dtype = np.uint16 if len(tok) <= 1 << 16 else np.int32
    streams, counts = {}, {}
    for split, rels in splits.items():
        streams[split], counts[split] = _tokenize_split(
            tok.backend_tokenizer, root, rels, tok.eos_token_id, dtype, f"tokenize {split}")

    os.makedirs(cache_dir, exist_ok=True)
    # Remove the old manifest first: a crash below leaves no manifest, never a stale one.
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(cache_dir, MANIFEST))
    for split, path in paths.items():
        atomic_write(path, lambda f, a=streams[split]: np.save(f, a))
    manifest = {"fingerprint": fingerprint, "format": _FORMAT,
                "dtype": np.dtype(dtype).name, "vocab_size": len(tok),
                "eos_id": tok.eos_token_id, "val_fraction": val_fraction,
                "splits": {s: {"file": os.path.basename(paths[s]), **counts[s]}
                           for s in splits}}
    atomic_write(os.path.join(cache_dir, MANIFEST),
                  lambda f: f.write(json.dumps(manifest, indent=1).encode("utf-8")))
    return paths
