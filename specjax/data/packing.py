"""Fixed-length training rows cut from a flat token stream, in a resumable order.

The stream (see specjax.data.corpus.tokenize_corpus) is cut into num_sequences
non-overlapping windows of T + 1 tokens that share their end tokens:

    sequence j = tokens[j*T : j*T + T + 1]      j = 0 .. num_sequences - 1

A global index i >= 0 walks an endless sequence of epochs; epoch e = i // n visits
every window once, in the order np.random.default_rng([seed, e]).permutation(n).
The training state of the data is one int, the position (how many rows were
consumed so far): `batch(position, B)` depends on nothing else, so a run that
saves the position and restarts from it sees exactly the rows it would have seen.

A loss mask (chat data, `specjax.prepare`) is a second stream of the same length, cut
into the same windows: `mask_rows(position, B)` gives the mask of exactly the rows that
`batch(position, B)` gives, so the mask travels through resume, sharding and gradient
accumulation with the rows (`specjax.train.inputs.global_batch`).
"""

from __future__ import annotations

import numpy as np

from specjax.errors import SpecjaxError


class ConcatStream:
    """Several 1-D token arrays read as their concatenation, without copying them (each may
    be a read-only memmap of a file larger than memory): what `PackedStream` needs of an
    array (`ndim`, `dtype`, `len`, and reads at integer index arrays). Rows cut from it are
    exactly those cut from `np.concatenate(parts)`, including rows that span two parts; parts
    of different dtypes (a u16 file beside an i32 one) are read as their common dtype
    (`np.result_type`, as `np.concatenate` gives), cast per read, so none is loaded whole.

    Args:
      parts: non-empty sequence of int[n_i] arrays.
    Raises: ValueError for no parts, a part that is not 1-D, or parts with no common
      integer dtype (u64 beside a signed dtype).
    """

    ndim = 1

    def __init__(self, parts):
        parts = list(parts)
        if not parts:
            raise ValueError("ConcatStream needs at least one array")
        if any(p.ndim != 1 for p in parts):
            raise ValueError(f"parts must be 1-D, got shapes {[p.shape for p in parts]}")
        self.parts, self.dtype = parts, np.result_type(*parts)
        if not np.issubdtype(self.dtype, np.integer):  # u64 with a signed part: float64
            raise ValueError(f"parts have no common integer dtype: {[str(p.dtype) for p in parts]}")
        self.starts = np.cumsum([0] + [len(p) for p in parts])  # i64[P + 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, index):
        index = np.asarray(index, np.int64)
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"index out of range for a stream of {len(self)} tokens")
        part = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, self.dtype)
        for k in np.unique(part):
            mask = part == k
            out[mask] = self.parts[k][index[mask] - self.starts[k]]
        return out


class PackedStream:
    """Fixed-length training sequences from a flat token stream, in a deterministic order.

    Args:
      tokens: int[n] flat token stream (u16 or i32; a read-only memmap, or a
        `ConcatStream` of several, is fine).
      seq_len: T, the tokens per training input; each row holds T + 1 tokens.
      seed: non-negative int that picks the permutation of every epoch.
      loss_mask: optional int[n] (u8; a memmap or `ConcatStream` is fine), the same length
        as `tokens`: 1 where the token is a training target (an assistant token of chat
        data), 0 where it is only context. None: every token is a target.
    Raises: SpecjaxError if the stream is shorter than T + 1 tokens; ValueError if the
      mask's length differs from the stream's.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int,
                 loss_mask: np.ndarray | None = None):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if loss_mask is not None and (loss_mask.ndim != 1 or len(loss_mask) != len(tokens)):
            raise ValueError(f"loss_mask must be 1-D with the stream's {len(tokens)} entries, "
                             f"got shape {loss_mask.shape}")
        self.loss_mask = loss_mask
        if seq_len < 1 or seed < 0:
            raise ValueError(f"need seq_len >= 1 and seed >= 0, got {seq_len}, {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_sequences = (len(tokens) - 1) // seq_len
        if self.num_sequences < 1:
            raise SpecjaxError(f"a token stream of {len(tokens)} tokens holds no sequence of "
                               f"seq_len {seq_len} (+1 target); lower seq_len or add text")
        self._perms: dict[int, np.ndarray] = {}  # epoch -> i64[n], at most two kept

    def permutation(self, epoch: int) -> np.ndarray:
        """i64[n]: the order in which epoch `epoch` visits the sequences."""
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_sequences)
        return self._perms[epoch]

    def sequence_ids(self, position: int, batch_size: int) -> np.ndarray:
        """i64[B]: the sequence j of global indices position .. position + B - 1."""
        if position < 0 or batch_size < 1:
            raise ValueError(f"need position >= 0 and batch_size >= 1, got {position}, "
                             f"{batch_size}")
        index = position + np.arange(batch_size, dtype=np.int64)
        epoch, within = np.divmod(index, self.num_sequences)
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epoch):
            mask = epoch == e
            out[mask] = self.permutation(int(e))[within[mask]]
        return out

    def batch(self, position: int, batch_size: int) -> tuple[np.ndarray, int]:
        """The B rows at global indices position .. position + B - 1.

        Returns: (rows, position + B), rows i32[B, T + 1]; the model's inputs are
        rows[:, :-1] and its next-token targets rows[:, 1:].
        """
        rows = np.asarray(self.tokens[self._offsets(position, batch_size)], np.int32)
        return rows, position + batch_size

    def mask_rows(self, position: int, batch_size: int) -> np.ndarray | None:
        """u8[B, T + 1]: the loss mask of the rows `batch(position, B)` gives (entry i of a
        row: 1 where token i of that row is a training target), or None without a mask."""
        if self.loss_mask is None:
            return None
        return np.asarray(self.loss_mask[self._offsets(position, batch_size)], np.uint8)

    def _offsets(self, position: int, batch_size: int) -> np.ndarray:
        """i64[B, T + 1]: stream indices of the rows at global indices position ..."""
        starts = self.sequence_ids(position, batch_size) * self.seq_len
        return starts[:, None] + np.arange(self.seq_len + 1)[None, :]

    def epoch(self, position: int) -> float:
        """Epochs completed after consuming `position` rows (for logs)."""
        return position / self.num_sequences

    @staticmethod
    def shard(rows: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
        """This process's contiguous slice of a global batch: rows[B/P*p : B/P*(p+1)].

        Raises: SpecjaxError if the global batch B is not divisible by P processes.
        """
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        b = rows.shape[0]
        if b % process_count:
            raise SpecjaxError(f"global batch size {b} is not divisible by {process_count} "
                               "processes; use a batch size that is a multiple of it")
        per = b // process_count
        return rows[process_index * per:(process_index + 1) * per]
