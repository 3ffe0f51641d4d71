"""specjax.data.corpus and specjax.data.packing: corpus listing, split, tokenizer, token cache, batches.

Everything but one test runs on a small root (copies of the stdlib's json and email
packages plus a few odd files, about 0.4 MB), so the file runs in seconds.
"""

import hashlib
import os
import shutil
import sysconfig

import numpy as np
import pytest

from specjax.data import corpus as data
from specjax.data.corpus import (
    PackedStream,
    corpus_files,
    load_manifest,
    load_tokens,
    read_source,
    split_of,
    stdlib_root,
    tokenize_corpus,
    train_tokenizer,
)
from specjax.data.packing import ConcatStream
from specjax.errors import SpecjaxError

VOCAB = 512
VAL = 0.2  # a larger held-out share than the default, so the small root has val files
CODE = ("def f(x):\n\tgrüße = 'héllo → 世界 🚀'  # ü\n\treturn x . y , z 's\r\n"
        "    if a  !=  b :\n\t\t pass\n")


def _make_root(path):
    """json + email (with email/mime) from the stdlib, and files the lister must skip."""
    src = stdlib_root()
    ignore = shutil.ignore_patterns("__pycache__", "*.rst")
    for pkg in ("json", "email"):
        shutil.copytree(os.path.join(src, pkg), os.path.join(path, pkg), ignore=ignore)
    os.makedirs(os.path.join(path, "misc"))
    with open(os.path.join(path, "misc", "unicode_tabs.py"), "w", encoding="utf-8") as f:
        f.write(CODE)
    with open(os.path.join(path, "misc", "latin1.py"), "wb") as f:
        f.write(b"# caf\xe9 = 1\nx = 1\n")
    for name, text in [("misc/empty.py", ""), ("misc/blank.py", " \n\n"),
                       ("misc/notes.txt", "not python"),
                       ("site-packages/third_party.py", "x = 1\n"),
                       ("__pycache__/cached.py", "x = 1\n")]:
        os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    os.symlink(os.path.join(path, "nowhere.py"), os.path.join(path, "misc", "broken.py"))
    return str(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return _make_root(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tok_dir(root, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(out, VOCAB, root, val_fraction=VAL)
    return out


def _splits(root, val_fraction=VAL):
    files = corpus_files(root)
    return {s: [f for f in files if split_of(f, val_fraction) == s] for s in ("train", "val")}


# ----------------------------------------------------------------------------- corpus + split

def test_stdlib_file_list():
    """The one test that lists the whole standard library (it reads no file)."""
    assert stdlib_root() == sysconfig.get_paths()["stdlib"]
    files = corpus_files()
    assert len(files) > 1000
    assert files == sorted(files) and len(set(files)) == len(files)
    assert "json/__init__.py" in files and any(f.startswith("test/") for f in files)
    assert not any("site-packages" in f or "\\" in f or os.path.isabs(f) for f in files)
    val = sum(split_of(f) == "val" for f in files) / len(files)
    assert 0.03 < val < 0.07, val


def test_corpus_files_skips_and_nests(root):
    files = corpus_files(root)
    assert "email/mime/text.py" in files and "misc/unicode_tabs.py" in files
    assert "misc/empty.py" in files  # listed; left out of the token stream later
    for skipped in ("misc/broken.py", "misc/notes.txt", "site-packages/third_party.py",
                    "__pycache__/cached.py"):
        assert skipped not in files


def test_split_is_a_stable_hash():
    names = [f"pkg{i}/mod_{j}.py" for i in range(40) for j in range(100)]
    first = {n: split_of(n) for n in names}
    rng = np.random.default_rng(0)
    assert {n: split_of(n) for n in rng.permutation(names)} == first
    assert {n: split_of(n) for n in names} == first
    assert abs(sum(s == "val" for s in first.values()) / len(names) - 0.05) < 0.015
    for val_fraction in (0.05, 0.3):  # reference: first 8 digest bytes as a fraction of 2**64
        for n in names[:200]:
            h = int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2**64
            assert split_of(n, val_fraction) == ("val" if h < val_fraction else "train")
    assert {split_of(n, 0.0) for n in names} == {"train"}
    assert {split_of(n, 1.0) for n in names} == {"val"}


def test_split_does_not_depend_on_the_root(root, tmp_path):
    other = os.path.join(tmp_path, "elsewhere", "deeper")
    shutil.copytree(root, other, symlinks=True)
    assert corpus_files(other) == corpus_files(root)
    assert _splits(other) == _splits(root)
    assert _splits(root)["val"] and _splits(root)["train"]


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_loads_offline_and_round_trips(root, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == VOCAB
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|pad|>"]
    texts = [CODE, "\t\t\n", "λx: x  ", *(read_source(root, f) for f in corpus_files(root))]
    for text in texts:
        ids = tok.encode(text)
        assert 0 not in ids and 1 not in ids
        assert tok.decode(ids) == text


def test_tokenizer_trains_on_train_files_only(root, tmp_path, monkeypatch):
    seen = []

    def spy(texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return data_train_bpe(texts, vocab_size)

    data_train_bpe = data.train_bpe
    monkeypatch.setattr(data, "train_bpe", spy)
    train_tokenizer(str(tmp_path), 300, root, val_fraction=VAL)
    assert seen == [read_source(root, f) for f in _splits(root)["train"]]


def test_vocab_errors(root, tmp_path):
    with pytest.raises(SpecjaxError, match="vocab_size 100"):
        train_tokenizer(str(tmp_path), 100, root)
    small = tmp_path / "small"
    small.mkdir()
    for i in range(3):
        (small / f"m{i}.py").write_text(f"x{i} = {i}\n")
    with pytest.raises(SpecjaxError, match="lower vocab_size"):
        train_tokenizer(str(tmp_path / "tok"), 2000, str(small), val_fraction=0.0)


# ----------------------------------------------------------------------------- token cache

def test_tokenize_corpus_streams(root, tok_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    paths = tokenize_corpus(tok_dir, str(tmp_path), root, val_fraction=VAL)
    assert paths == {s: os.path.join(tmp_path, f"{s}.npy") for s in ("train", "val")}
    manifest = load_manifest(str(tmp_path))
    for split, rels in _splits(root).items():
        stream = load_tokens(paths[split])
        assert stream.dtype == np.uint16
        # Reference: each non-blank file encoded on its own (not batched), then EOS.
        docs = [read_source(root, f) for f in rels]
        want = [i for d in docs if d.strip() for i in [*tok.encode(d), 0]]
        np.testing.assert_array_equal(stream, want)
        assert stream[-1] == 0
        assert manifest["splits"][split]["documents"] == int((stream == 0).sum())
        assert manifest["splits"][split]["files"] == len(rels)
        assert manifest["splits"][split]["tokens"] == stream.size
    counts = manifest["splits"].values()  # blank files are listed, not streamed
    blank = [f for f in corpus_files(root) if not read_source(root, f).strip()]
    assert {"misc/empty.py", "misc/blank.py"} <= set(blank)
    assert sum(c["files"] for c in counts) == sum(c["documents"] for c in counts) + len(blank)
    assert not list(tmp_path.glob("*.tmp*"))


def test_tokenize_corpus_cache(root, tok_dir, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    paths = tokenize_corpus(tok_dir, cache, root, val_fraction=VAL)
    mtimes = {p: os.stat(p).st_mtime_ns for p in paths.values()}
    before = load_tokens(paths["train"]).copy()

    def boom(*args):
        raise AssertionError("tokenized on a cache hit")

    with monkeypatch.context() as m:
        m.setattr(data, "_encode_texts", boom)
        assert tokenize_corpus(tok_dir, cache, root, val_fraction=VAL) == paths
        assert {p: os.stat(p).st_mtime_ns for p in paths.values()} == mtimes
        # A new train file changes the fingerprint: the same call now tokenizes.
        extra = os.path.join(tmp_path, "root2")
        shutil.copytree(root, extra, symlinks=True)
        rel = next(f"new_{i}.py" for i in range(100) if split_of(f"new_{i}.py", VAL) == "train")
        with open(os.path.join(extra, rel), "w") as f:
            f.write("print('new file')\n")
        with pytest.raises(AssertionError, match="cache hit"):
            tokenize_corpus(tok_dir, cache, extra, val_fraction=VAL)
    tokenize_corpus(tok_dir, cache, extra, val_fraction=VAL)
    after = load_tokens(paths["train"])
    assert after.size > before.size
    assert load_manifest(cache)["splits"]["train"]["files"] == len(_splits(extra)["train"])


# ----------------------------------------------------------------------------- PackedStream

def _perm(seed, epoch, n):  # the documented order, computed independently
    return np.random.default_rng([seed, epoch]).permutation(n)


@pytest.mark.parametrize("seq_len", [1, 7, 16])
def test_packed_stream_order(seq_len):
    tokens = np.arange(1000, dtype=np.int32) * 3  # token value says its position
    ps = PackedStream(tokens, seq_len, seed=5)
    n = ps.num_sequences
    assert n == (len(tokens) - 1) // seq_len
    rows, nxt = ps.batch(0, 4)
    assert rows.shape == (4, seq_len + 1) and rows.dtype == np.int32 and nxt == 4
    np.testing.assert_array_equal(rows, ps.batch(0, 4)[0])
    inputs, targets = rows[:, :-1], rows[:, 1:]
    np.testing.assert_array_equal(targets, inputs + 3)  # targets are the next tokens
    # Every sequence exactly once per epoch, in the documented permutation.
    for epoch in range(2):
        rows, _ = ps.batch(epoch * n, n)
        starts = rows[:, 0] // 3
        np.testing.assert_array_equal(starts, _perm(5, epoch, n) * seq_len)
        np.testing.assert_array_equal(np.sort(starts), np.arange(n) * seq_len)
    assert not np.array_equal(_perm(5, 0, n), _perm(5, 1, n))
    # Across the boundary: the tail of epoch 0, then the head of epoch 1.
    rows, _ = ps.batch(n - 3, 6)
    want = np.concatenate([_perm(5, 0, n)[-3:], _perm(5, 1, n)[:3]]) * seq_len
    np.testing.assert_array_equal(rows[:, 0] // 3, want)


def test_packed_stream_resumes_exactly():
    tokens = np.random.default_rng(1).integers(0, 500, 5000).astype(np.uint16)
    ps = PackedStream(tokens, 32, seed=0)
    b = 8
    whole, pos = ps.batch(0, 2 * b)
    first, pos1 = ps.batch(0, b)
    second, pos2 = ps.batch(pos1, b)
    assert (pos, pos1, pos2) == (2 * b, b, 2 * b)
    np.testing.assert_array_equal(whole, np.concatenate([first, second]))
    # A fresh object given only the saved position continues the same stream, far out.
    far = 10 * ps.num_sequences + 3
    np.testing.assert_array_equal(PackedStream(tokens, 32, 0).batch(far, b)[0],
                                  ps.batch(far, b)[0])
    assert not np.array_equal(PackedStream(tokens, 32, 1).batch(0, b)[0], first)
    for r, j in zip(first, ps.sequence_ids(0, b), strict=True):
        np.testing.assert_array_equal(r, tokens[j * 32:j * 32 + 33])


def test_packed_stream_reads_a_memmapped_cache(tmp_path):
    tokens = np.arange(300, dtype=np.uint16)
    np.save(tmp_path / "t.npy", tokens)
    ps = PackedStream(load_tokens(str(tmp_path / "t.npy")), 10, seed=2)
    rows, _ = ps.batch(0, ps.num_sequences)
    assert type(rows) is np.ndarray and rows.dtype == np.int32
    assert ps.num_sequences == 29


@pytest.mark.parametrize("procs", [1, 2, 4, 8])
def test_shard_partitions_the_global_batch(procs):
    rows = np.arange(8 * 5).reshape(8, 5)
    parts = [PackedStream.shard(rows, p, procs) for p in range(procs)]
    assert all(len(p) == 8 // procs for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), rows)


def test_concat_stream_reads_as_the_concatenation(tmp_path):
    """Rows of a ConcatStream of memmapped files (one shorter than a row, so that rows
    span up to three parts) equal those of np.concatenate of the same arrays."""
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 60000, n).astype(np.uint16) for n in (50, 7, 300, 1)]
    parts = []
    for i, a in enumerate(arrays):
        np.save(tmp_path / f"{i}.npy", a)
        parts.append(load_tokens(str(tmp_path / f"{i}.npy")))
    whole = np.concatenate(arrays)
    cs = ConcatStream(parts)
    assert len(cs) == cs.shape[0] == whole.size and cs.dtype == np.uint16
    idx = rng.integers(0, whole.size, (5, 9))
    np.testing.assert_array_equal(cs[idx], whole[idx])
    a, b = PackedStream(cs, 10, seed=4), PackedStream(whole, 10, seed=4)
    assert a.num_sequences == b.num_sequences == 35
    for pos in (0, 30, 70):
        np.testing.assert_array_equal(a.batch(pos, 8)[0], b.batch(pos, 8)[0])
    with pytest.raises(IndexError):
        cs[np.array([whole.size])]
    with pytest.raises(ValueError, match="at least one"):
        ConcatStream([])
    # a u16 part beside an i32 one: read as i32, the parts left as they are (memmaps)
    mixed = parts[:2] + [arrays[2].astype(np.int32) + 70000] + parts[3:]
    whole = np.concatenate([np.asarray(m) for m in mixed])
    cm = ConcatStream(mixed)
    assert cm.dtype == whole.dtype == np.int32 and isinstance(cm.parts[0], np.memmap)
    idx = np.arange(whole.size)
    np.testing.assert_array_equal(cm[idx], whole)
    assert cm[idx].dtype == np.int32
    with pytest.raises(ValueError, match="common integer"):
        ConcatStream([arrays[0].astype(np.uint64), arrays[1].astype(np.int64)])


def test_packed_stream_errors():
    with pytest.raises(SpecjaxError, match="divisible"):
        PackedStream.shard(np.zeros((6, 3)), 0, 4)
    with pytest.raises(SpecjaxError, match="lower seq_len"):
        PackedStream(np.arange(10), 16, seed=0)


# ----------------------------------------------------------------------------- user errors

def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_user_errors(tmp_path):
    missing = str(tmp_path / "no_such_dir")
    with pytest.raises(SpecjaxError) as e:
        corpus_files(missing)
    _one_line(e, missing, "pass")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no python here")
    with pytest.raises(SpecjaxError) as e:
        corpus_files(str(empty))
    _one_line(e, str(empty), ".py")
    with pytest.raises(SpecjaxError) as e:
        train_tokenizer(str(tmp_path / "tok"), 512, missing)
    _one_line(e, missing)
    with pytest.raises(SpecjaxError) as e:
        tokenize_corpus(str(tmp_path / "no_tok"), str(tmp_path / "cache"), str(empty))
    _one_line(e, "tokenizer.json", "train_tokenizer")
