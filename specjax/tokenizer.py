"""Byte-level BPE tokenizers trained with `tokenizers`, saved so that
`transformers.AutoTokenizer.from_pretrained(dir)` loads them offline.

Special tokens come first: id 0 is EOS `<|endoftext|>`, id 1 is pad `<|pad|>`.
"""

from __future__ import annotations

from collections.abc import Iterable

EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"


def train_bpe(texts: Iterable[str], vocab_size: int):
    """Trains a byte-level BPE of `vocab_size` tokens on `texts`.

    Returns: a `transformers.PreTrainedTokenizerFast` with eos and pad declared.
    """
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
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
