"""Real text for the language-model trainer (``vramcal train --model lm``): byte-level documents, one per
definition, from source files on the machine, split by file; the rules are DESIGN.md's "A language model on real
text"."""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STDLIB = "stdlib"  # --text's default: the standard library's own modules
SUFFIXES = (".py", ".txt")
BYTE_VOCAB = 256  # token ids 0-255: the model's vocab_size must hold them
IGNORE_INDEX = -100  # the label of a padding position (transformers' cross-entropy ignores it)
# a line that starts a definition (or its first decorator), at any indentation: CodeSearchNet's (Husain et al. 2019)
# function-level documents
DEFINITION = re.compile(rb"^[ \t]*(?:async[ \t]+def[ \t]|def[ \t]|class[ \t]|@)", re.MULTILINE)


class CorpusError(ValueError):
    """Text the trainer cannot use; the one-line message names the folder, the problem and the fix."""


_PLAIN = frozenset(range(0x20, 0x7F)) | frozenset(b"\t\n\r\f\b\x1b")  # printable ASCII and whitespace
BINARY_SHARE = 1 / 3  # of a non-UTF-8 file's bytes outside _PLAIN, above which it is binary (is_binary)


def is_binary(text: bytes) -> bool:
    """Whether a file's bytes are binary: a NUL byte, or not UTF-8 with over :data:`BINARY_SHARE` of its bytes
    outside printable ASCII and whitespace (Perl's ``-B`` file test, perlfunc ``-X``)."""
    if b"\0" in text:
        return True
    try:
        text.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return sum(byte not in _PLAIN for byte in text) > BINARY_SHARE * len(text)


def text_files(source: str) -> tuple[Path, list[Path]]:
    """The folder and its text files, in the order of their relative paths.
    Raises: CorpusError: the folder is missing or holds no ``*.py`` or ``*.txt`` file."""
    if source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(root.glob("*.py"))
    else:
        root = Path(source)
        if not root.is_dir():
            raise CorpusError(f"--text {source}: no such folder: give a folder of *.py or *.txt files, or leave "
                              f"--text out for the standard library's own source")
        files = sorted((p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()),
                       key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise CorpusError(f"--text {source}: no *.py or *.txt file in {root}: give a folder that holds text files, "
                          f"or leave --text out for the standard library's own source")
    return root, files


def documents(text: bytes) -> list[bytes]:
    """A file's documents, in order, non-empty; their bytes joined are ``text``."""
    cuts = [0]
    for match in DEFINITION.finditer(text):
        start = match.start()
        if start == 0:
            continue
        line_start = text.rfind(b"\n", 0, start - 1) + 1  # the line before this one
        if not text[line_start:start].strip().startswith(b"@"):  # a decorated definition starts at its decorator
            cuts.append(start)
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


def windows(document: bytes, context: int) -> list[bytes]:
    """``document`` cut into consecutive windows of ``context`` tokens (bytes), the last one shorter."""
    return [document[i:i + context] for i in range(0, len(document), context)]


def in_validation(relative: str, val_fraction: float) -> bool:
    """Whether the file at ``relative`` (``/``-separated) is a validation file: the first 8 bytes of its path's
    SHA-256, as a fraction of 2^64, below ``val_fraction``."""
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


@dataclass(frozen=True)
class Corpus:
    """The documents of a text folder, cut to the context and split.

    Attributes:
        source: ``--text`` as given; root: the folder read.
        train, val: the training and validation documents (windows), bytes each (tokens = bytes).
        files, val_files, binary: files read, those in validation, and those left out as binary (relative paths).
        documents, cut, longest_document: documents found, those cut into windows, the longest's length (tokens).
        context: the longest window (tokens).
        identity: SHA-256 of every file's relative path and content, in order: the corpus a run trained on.
    """

    source: str
    root: str
    train: tuple[bytes, ...]
    val: tuple[bytes, ...]
    files: int
    val_files: int
    documents: int
    cut: int
    longest_document: int
    context: int
    identity: str
    binary: tuple[str, ...] = ()

    @property
    def held_bytes(self) -> int:
        """Bytes the documents hold in the process (:func:`sys.getsizeof`): the run's data term."""
        return sum(sys.getsizeof(d) for d in self.train) + sum(sys.getsizeof(d) for d in self.val)

    def stats(self) -> dict[str, Any]:
        """The corpus's facts for the run's record and its checks."""
        return {"text": self.source, "root": self.root, "files": self.files, "val_files": self.val_files,
                "documents": self.documents, "cut": self.cut, "longest_document": self.longest_document,
                "context": self.context, "train_windows": len(self.train), "val_windows": len(self.val),
                "train_tokens": sum(map(len, self.train)), "val_tokens": sum(map(len, self.val)),
                "identity": self.identity, "seq_len": self.context, "binary_files": list(self.binary)}


def load_corpus(source: str, context: int, val_fraction: float) -> Corpus:
    """Read ``source``'s files into documents of at most ``context`` tokens, split by file.

    Raises:
        CorpusError: no folder, no text file, no text in them, or a split that leaves one side empty.
        OSError: a file cannot be read.
    """
    root, files = text_files(source)
    train: list[bytes] = []
    val: list[bytes] = []
    found = cut = longest = val_files = 0
    identity, binary = hashlib.sha256(), []
    for path in files:
        relative, text = path.relative_to(root).as_posix(), path.read_bytes()
        identity.update(relative.encode() + b"\0" + len(text).to_bytes(8, "big") + text)
        if is_binary(text):
            binary.append(relative)
            continue
        side = in_validation(relative, val_fraction)
        val_files += side
        for document in documents(text):
            found, longest = found + 1, max(longest, len(document))
            cut += len(document) > context
            (val if side else train).extend(windows(document, context))
    if not found:
        what = (f"{_named(binary)} {'is' if len(binary) == 1 else 'are'} binary"
                + (", the rest empty" if len(binary) < len(files) else "") if binary else "every one is empty")
        raise CorpusError(f"--text {source}: its {len(files)} files hold no text ({what}): give a folder with text "
                          f"in its files")
    if not train or not val:
        side = "validation" if not val else "training"
        raise CorpusError(f"--text {source}: the split by file ({len(files) - len(binary)} text files, --val-fraction "
                          f"{val_fraction}) leaves no {side} file: give more files, or another --val-fraction")
    return Corpus(source, str(root), tuple(train), tuple(val), len(files) - len(binary), val_files, found, cut, longest,
                  context, identity.hexdigest(), tuple(binary))


def _named(paths: Sequence[str], shown: int = 3) -> str:
    """``a.py, b.py`` or ``a.py, b.py, c.py and 4 more``."""
    rest = len(paths) - shown
    return ", ".join(paths[:shown]) + (f" and {rest} more" if rest > 0 else "")


def binary_notice(corpus: Corpus) -> str | None:
    """The warning for the files a corpus left out as binary, or None."""
    if not corpus.binary:
        return None
    return (f"--text {corpus.source}: left out {len(corpus.binary)} binary file(s) named as text "
            f"({_named(corpus.binary)}): their bytes are not text; {corpus.files} text file(s) are trained on")


def lengths(docs: Sequence[bytes]) -> list[int]:
    """Each document's length in tokens."""
    return [len(d) for d in docs]
