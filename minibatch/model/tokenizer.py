"""A byte-level tokenizer for the tiny model that ships with minibatch.

Every string is turned into its UTF-8 bytes, and each byte is one token:
ids 0..255 are the raw byte values. Three ids above that carry special
meaning:

* 256 = BOS (beginning of sequence), put in front of every prompt;
* 257 = EOS (end of sequence), the model emits it when a paragraph is done;
* 258 = PAD, filler for batches of unequal length (never learned from).

``vocab_size`` is 260: id 259 is unused and only keeps the vocabulary a
multiple of 4. There is nothing to download and nothing to learn, so any
text round-trips exactly, and a byte sent to the wrong request shows up as
visible garbage in the decoded output.
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Maps text to UTF-8 byte ids plus BOS/EOS/PAD, and back."""

    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    vocab_size: int = 260

    def encode(self, text: str, add_bos: bool = True, add_special_tokens: bool | None = None) -> list[int]:
        """Return the byte ids of ``text``, with BOS in front if ``add_bos`` (``add_special_tokens``:
        transformers' name for it, which the server's /tokenize passes to any tokenizer)."""
        if add_special_tokens is not None:
            add_bos = add_special_tokens
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Turn ids back into text.

        Byte ids become UTF-8 text (an invalid byte sequence, such as a
        character cut in half, decodes to U+FFFD rather than raising).
        Special ids are dropped if ``skip_special``; otherwise they are
        written as ``<bos>``, ``<eos>``, ``<pad>`` or ``<unk>``.
        """
        names = {self.bos_token_id: "<bos>", self.eos_token_id: "<eos>",
                 self.pad_token_id: "<pad>"}
        parts: list[str] = []
        pending = bytearray()
        for i in (int(i) for i in ids):
            if 0 <= i < 256:
                pending.append(i)
                continue
            if skip_special:
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(names.get(i, "<unk>"))
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)
