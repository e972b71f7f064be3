"""A character tokenizer for the tiny models: three specials, then printable ASCII.

One token per character (ids 3..97) fits the tiny models' 128-token vocabulary, so grammar
tests can constrain a random-weight model's output to a regex or a JSON schema.
"""

from __future__ import annotations

import string

SPECIALS = ["<pad>", "<s>", "</s>"]  # </s> is the tiny models' EOS (id 2)


def char_tokenizer():
    """A ``tokenizers.Tokenizer`` over ``SPECIALS`` and the 95 printable ASCII characters."""
    from tokenizers import Tokenizer, decoders, models

    chars = SPECIALS + list(string.printable[:95])  # digits, letters, punctuation, space
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.decoder = decoders.Fuse()
    return tokenizer
