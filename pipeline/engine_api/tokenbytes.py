"""The raw bytes of each token id, for the ``bytes`` field of OpenAI log-prob items.

OpenAI's contract for ``logprobs.content[i].bytes`` (and each ``top_logprobs`` item) is the
token's own UTF-8 bytes, so that concatenating the ``bytes`` of every token rebuilds the text
even when one character is split over several tokens (an emoji over two byte-level BPE tokens).
Decoding a single id with the tokenizer cannot give that: ``tokenizer.decode([id])`` of half a
character is ``"\\ufffd"`` (the replacement character), whose UTF-8 is ``[239, 191, 189]``.
SGLang fills ``bytes`` that way, and so did this package's CPU engine.

:class:`TokenBytes` asks llguidance for the byte string of each token: it reads the byte-level
BPE alphabet (GPT-2 style), SentencePiece byte-fallback pieces (``<0xAB>``) and tiktoken
vocabularies alike. Special tokens (``<|im_end|>``) are their text.

Used by the CPU engine (its own log-probs) and by the proxy (to repair an SGLang engine's).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pipeline.errors import PipelineError
from pipeline.models import ModelNotFound, resolve_model


class TokenBytesError(PipelineError, RuntimeError):
    """The tokenizer could not be loaded or read into a byte table."""


class TokenBytes:
    """Callable ``token id -> bytes`` for one Hugging Face tokenizer.

    Args:
        tokenizer: a ``transformers`` tokenizer (fast or slow).
    Raises:
        TokenBytesError: llguidance cannot read this tokenizer.

    Building the table takes ~1 s for a 49k vocabulary; lookups are cached.
    """

    def __init__(self, tokenizer: Any) -> None:
        import llguidance.hf

        try:
            self._ll = llguidance.hf.from_tokenizer(tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure means: no byte table for this tokenizer
            raise TokenBytesError(f"cannot read the tokenizer's byte vocabulary: {type(e).__name__}: {e}") from e
        self.vocab_size = int(self._ll.vocab_size)
        self._of = functools.lru_cache(maxsize=1 << 17)(self._lookup)

    @property
    def ll(self) -> Any:
        """The tokenizer as an ``llguidance.LLTokenizer`` (EOS: the tokenizer's own), which the CPU
        engine's constrained decoding also uses (:mod:`pipeline.engine.grammar`)."""
        return self._ll

    def _lookup(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise KeyError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return bytes(self._ll.decode_bytes([token_id]))

    def __call__(self, token_id: int) -> bytes:
        """The token's raw bytes. Raises ``KeyError`` for an id outside the vocabulary."""
        return self._of(int(token_id))

    def as_list(self, token_id: int) -> list[int]:
        """The token's raw bytes as the list of ints OpenAI's ``bytes`` field holds."""
        return list(self(token_id))


def load_token_bytes(model: str | os.PathLike, cache_dir: str | None = None) -> TokenBytes:
    """The :class:`TokenBytes` of a model name (``pipeline.models``) or Hugging Face folder.

    Raises:
        TokenBytesError: the model or its tokenizer cannot be found or read.
    """
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(resolve_model(str(model), cache_dir)))
    except (ModelNotFound, OSError, ValueError) as e:
        raise TokenBytesError(f"cannot load the tokenizer of {model!r}: {e}") from e
    return TokenBytes(tok)


__all__ = ["TokenBytes", "TokenBytesError", "load_token_bytes"]
