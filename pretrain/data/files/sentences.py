"""Offline sentence splitting for `--split-sentences`, with pysbd (its rules ship in the PyPI package).

Megatron uses NLTK punkt, whose model needs a download; pysbd needs none. Like Megatron, text is cut
into 1,000,000-character chunks before splitting. Without `--keep-newlines` each sentence is
stripped of surrounding whitespace (as punkt returns them); with it, trailing whitespace and
newlines stay with the sentence.
"""

from __future__ import annotations

from pretrain.errors import UserError

CHUNK_CHARS = 1_000_000
# NLTK punkt language names (Megatron's `--lang`) -> pysbd language codes
_NLTK_TO_PYSBD = {
    "english": "en",
    "german": "de",
    "french": "fr",
    "spanish": "es",
    "italian": "it",
    "dutch": "nl",
    "polish": "pl",
    "russian": "ru",
    "danish": "da",
    "greek": "el",
}


def pysbd_language(lang: str) -> str:
    """The pysbd language code for Megatron's (NLTK-style) `--lang` value."""
    import pysbd.languages

    code = _NLTK_TO_PYSBD.get(lang.lower(), lang.lower())
    if code not in pysbd.languages.LANGUAGE_CODES:
        known = sorted(set(_NLTK_TO_PYSBD) | set(pysbd.languages.LANGUAGE_CODES))
        raise UserError(
            f"--lang {lang}: no sentence rules for this language (use one of {', '.join(known)})"
        )
    return code


class SentenceSplitter:
    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        import pysbd

        self._segmenter = pysbd.Segmenter(language=pysbd_language(lang), clean=False)
        self._keep_newlines = keep_newlines

    def split(self, text: str) -> list[str]:
        sentences = []
        for start in range(0, len(text), CHUNK_CHARS):
            sentences.extend(self._segmenter.segment(text[start : start + CHUNK_CHARS]))
        if self._keep_newlines:
            return sentences
        return [s for s in (s.strip() for s in sentences) if s]
