"""Byte-level BPE tokenizers trained with `tokenizers`, saved so that
`transformers.AutoTokenizer.from_pretrained(dir)` loads them offline.

Special tokens come first: id 0 is EOS `<|endoftext|>`, id 1 is pad `<|pad|>`.
The 256 byte symbols are always in the vocabulary, so any text (any unicode, tabs,
CRLF) encodes, and decoding gives back exactly the text that was encoded.
"""

from __future__ import annotations

from collections.abc import Iterable

from specjax.errors import SpecjaxError

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"
EOS_ID, PAD_ID = 0, 1
MIN_VOCAB = 256 + 2  # the byte alphabet + EOS + pad


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Trains a byte-level BPE of `vocab_size` tokens (specials and bytes included).

    The result may hold fewer than `vocab_size` tokens when `texts` has too few
    distinct pairs to merge; callers that need the exact size check `len(tok)`.

    Returns: a `transformers.PreTrainedTokenizerFast` with eos and pad declared.
    Raises: SpecjaxError if `vocab_size` < MIN_VOCAB (258).
    """
    if vocab_size < MIN_VOCAB:
        raise SpecjaxError(f"vocab_size {vocab_size} is too small for a byte-level BPE; "
                           f"use at least {MIN_VOCAB} (256 bytes + eos + pad)")
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # clean_up_tokenization_spaces would turn " ." into "." on decode: never for code.
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False)
