"""A byte-level BPE tokenizer trained on a few texts, for tests that need a real one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str]) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE (no prefix space) trained on ``texts`` up
    to ``vocab_size`` tokens, ``special_tokens`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer
