"""Natural-language text that no one here wrote, found on the machine: the second sample corpus.

``build_prose`` writes JSON lines (``{"id", "text", "source"}``, one document per line) for
``kiln corpus import FILE --format jsonl --id-field id``, so the sample goes through the same import a
platform team's own corpus does. Sources, in this order:

- ``pydoc``: the English prose of the Python language reference that ``help("assert")`` prints,
  ``pydoc_data.topics`` of the running interpreter (79 topics, ≈ 465 kB on 3.11). Every CPython
  ships it, Debian's included (``libpython3.X-stdlib``).
- ``licenses``: ``/usr/share/common-licenses`` (≈ 260 kB: GPL, Apache, BSD, MPL, …), from Debian's
  ``base-files``, an essential package: on every Debian and Ubuntu machine, slim container images
  included. A link (``GPL -> GPL-3``) is read once, under its target's name.
- ``man`` (only when asked, by section): the English man pages ``/usr/share/man/manN/*.N.gz``, gzip
  and roff markup stripped here (no ``groff`` needed). Not on every machine: Debian's slim container
  images drop ``/usr/share/man`` (a dpkg path-exclude), and what is there depends on the packages
  installed, so a corpus with man pages differs from machine to machine.

Each source text is first made into what a web-text extractor gives for a page (``extract_prose``):
the English prose only, each paragraph on one line. The sources are hard-wrapped at 70-80 columns,
while the web-text rules read a line as a paragraph (C4 keeps only lines that end in terminal
punctuation before it counts sentences; FineWeb wants punctuated line ends): left wrapped, 45 % of
the sample's documents were dropped and 2 of its 5 shards quarantined, although nothing in them is
bad. Indented blocks (code examples, grammar productions, literal listings) are left out, as the
sample is the prose, and so are heading underlines (``*****``). Then the text is cut at paragraph
boundaries (blank lines) into documents of at most ``MAX_DOC_BYTES`` UTF-8 bytes, lines intact; a
piece under ``MIN_DOC_CHARS`` characters (a lone heading) is dropped. Ids are ``<source>#<chunk
index>``. Deterministic: the same interpreter and the same files give the same bytes (sorted file
order, no time).
"""

from __future__ import annotations

import gzip
import json
import re
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kiln.data.corpus import MAX_DOC_BYTES, MIN_DOC_CHARS
from kiln.errors import ConfigError
from kiln.util.fs import atomic_write_bytes, unusable_target_reason

LICENSES_DIR = Path("/usr/share/common-licenses")
MAN_DIR = Path("/usr/share/man")
MAN_SECTIONS = tuple(str(n) for n in range(1, 10))


def pydoc_topics() -> Iterator[tuple[str, str]]:
    """``("pydoc/<topic>", text)`` for every topic of the running interpreter, sorted."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc/{name}", topics[name]


def license_texts(root: Path = LICENSES_DIR) -> Iterator[tuple[str, str]]:
    """``("licenses/<name>", text)`` of each regular file (links left out: their target is read)."""
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # not text this builder can vouch for
        yield f"licenses/{path.name}", text


def man_pages(sections: Sequence[str], root: Path = MAN_DIR) -> Iterator[tuple[str, str]]:
    """``("man/man<N>/<page>", text)`` of the English pages of ``sections``, roff stripped, sorted.
    A page that only includes another (``.so``) or is not UTF-8 is left out."""
    for section in sections:
        folder = root / f"man{section}"
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.is_symlink() or not path.name.endswith(".gz") or not path.is_file():
                continue
            try:
                roff = gzip.decompress(path.read_bytes()).decode("utf-8")
            except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile):
                continue
            if roff.lstrip().startswith(".so "):
                continue
            text = roff_to_text(roff)
            if text.strip():
                yield f"man/man{section}/{path.name.removesuffix('.gz')}", text


# -- roff -----------------------------------------------------------------------------------------

_NAMED = {"aq": "'", "dq": '"', "em": "—", "en": "–", "bu": "•", "co": "©", "rg": "®", "lq": "“", "rq": "”",
          "oq": "‘", "cq": "’", "hy": "-", "mi": "-", "pl": "+", "mu": "×", "di": "÷", "eq": "=", "ga": "`",
          "ha": "^", "ti": "~", "rs": "\\", "sl": "/", "ba": "|", "br": "|", "ul": "_", "lB": "[", "rB": "]",
          "lC": "{", "rC": "}", "la": "⟨", "ra": "⟩", "de": "°", "tm": "™", "Fo": "«", "Fc": "»", "->": "→",
          "<-": "←", ">=": "≥", "<=": "≤", "!=": "≠", "+-": "±", "fm": "′", "sc": "§", "ps": "¶", "ct": "¢"}
_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)"          # font changes
    r"|\*(?:\[[^\]]*\]|\(..|.)"              # strings
    r"|n[+-]?(?:\[[^\]]*\]|\(..|.)"          # number registers
    r"|s[+-]?(?:\d+|\(\d\d|\[[^\]]*\])"      # size changes
    r"|\((..)"                               # \(xx named characters
    r"|\[([^\]]*)\]"                         # \[name] named characters
    r"|([-e&|^,/%c~ 0'`.\\])"                # one-character escapes
    r"|(.))"                                 # any other: the character itself
)
_ONE = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "~": " ", "0": " ", "'": "'", "`": "`", ".": "."}
_FONT_REQUESTS = frozenset({"B", "I", "R", "SM", "SB", "BR", "RB", "BI", "IB", "IR", "RI"})
_BREAKS = frozenset({"PP", "LP", "P", "TP", "sp", "br", "HP", "TQ", "RS", "RE", "nf", "fi", "EX", "EE", "in"})


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        named = m.group(1) or m.group(2)
        if named is not None:
            return _NAMED.get(named, "")
        if m.group(3) is not None:
            return _ONE.get(m.group(3), "")
        return m.group(4) or ""

    return _ESCAPE.sub(one, text.split('\\"', 1)[0])


def _args(rest: str) -> list[str]:
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]


def roff_to_text(roff: str) -> str:
    """The words of a man page's roff source: requests become paragraph breaks, headings or their
    text, escapes their characters; macro definitions and comments go."""
    out: list[str] = []
    skipping = False
    for line in roff.splitlines():
        if skipping:
            skipping = line.strip() != ".."
            continue
        if line.startswith(('.\\"', "'\\\"")):
            continue
        if line.startswith((".", "'")):
            request, _, rest = line[1:].strip().partition(" ")
            if request in ("de", "de1", "ig", "am"):
                skipping = True
            elif request in ("SH", "SS"):
                out.extend(["", _unescape(" ".join(_args(rest))).strip(), ""])
            elif request in _FONT_REQUESTS:
                joiner = " " if request in ("B", "I", "R", "SM", "SB") else ""
                out.append(_unescape(joiner.join(_args(rest))))
            elif request == "IP":
                args = _args(rest)
                out.extend(["", _unescape(args[0])] if args else [""])
            elif request in _BREAKS:
                out.append("")
            continue
        out.append(_unescape(line))
    text = "\n".join(out)
    text = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) != "Cc")
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


# -- documents ------------------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    """Paragraphs with their trailing blank lines, so that joining them gives ``text`` back."""
    return [p for p in re.split(r"(?<=\n\n)(?=[^\n])", text.replace("\r\n", "\n")) if p]


def _pieces(paragraph: str) -> Iterator[str]:
    """A paragraph over the size limit, at line boundaries (a longer line at character boundaries)."""
    size = 0
    current: list[str] = []
    for line in paragraph.splitlines(keepends=True):
        while len(line.encode("utf-8")) > MAX_DOC_BYTES:
            cut = len(line.encode("utf-8")[:MAX_DOC_BYTES].decode("utf-8", "ignore"))
            if current:
                yield "".join(current)
                current, size = [], 0
            yield line[:cut]
            line = line[cut:]
        width = len(line.encode("utf-8"))
        if size + width > MAX_DOC_BYTES and current:
            yield "".join(current)
            current, size = [], 0
        current.append(line)
        size += width
    if current:
        yield "".join(current)


_UNDERLINE = re.compile(r"[ \t]*([*=~^#_+-])\1{2,}[ \t]*")
CODE_INDENT = 3
"""A block with a line indented this many columns (or a tab) is code, grammar or a literal listing
(reStructuredText's literal blocks are indented 3 in pydoc's text); prose paragraphs and list items
are indented less (the GPL's paragraphs by 2)."""


def extract_prose(text: str) -> str:
    """The prose of a hard-wrapped text as a web-text extractor gives it: every paragraph (a block
    between blank lines) on one line, paragraphs separated by a blank line; heading underlines and
    indented blocks left out (see the module docstring)."""
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = [line.rstrip() for line in block.split("\n") if line.strip() and not _UNDERLINE.fullmatch(line)]
        if not lines or any(line.startswith("\t") or len(line) - len(line.lstrip(" ")) >= CODE_INDENT for line in lines):
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs) + "\n" if paragraphs else ""


def chunk_text(text: str) -> list[str]:
    """``text`` cut into documents of at most ``MAX_DOC_BYTES`` bytes at paragraph boundaries, in order."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in _paragraphs(text):
        for piece in _pieces(paragraph):
            width = len(piece.encode("utf-8"))
            if size + width > MAX_DOC_BYTES and current:
                chunks.append("".join(current))
                current, size = [], 0
            current.append(piece)
            size += width
    if current:
        chunks.append("".join(current))
    return chunks


def prose_documents(man_sections: Sequence[str] = ()) -> Iterator[dict[str, str]]:
    """Every document, in order: pydoc, licenses, then the man pages of ``man_sections``."""
    seen: set[str] = set()
    for sources in (pydoc_topics(), license_texts(), man_pages(man_sections)):
        for source, text in sources:
            for i, chunk in enumerate(chunk_text(extract_prose(text))):
                # The chunk index counts every chunk, so ids stay put if the filter below changes.
                if len(chunk.strip()) < MIN_DOC_CHARS or chunk in seen:
                    continue
                seen.add(chunk)  # exact copies (two licence versions sharing a paragraph) kept once
                yield {"id": f"{source}#{i}", "text": chunk, "source": source}


def build_prose(out: str | Path, man_sections: Sequence[str] = ()) -> dict[str, Any]:
    """Write the documents as JSON lines to ``out`` (atomically); a JSON-safe summary."""
    out = Path(out)
    unknown = [s for s in man_sections if s not in MAN_SECTIONS]
    if unknown:
        raise ConfigError(f"man sections must be among {', '.join(MAN_SECTIONS)}, got {', '.join(unknown)}")
    problem = unusable_target_reason(out, directory=False)
    if problem:
        raise ConfigError(f"{out}: {problem}")
    lines: list[bytes] = []
    counts: dict[str, int] = {}
    text_bytes = 0
    for doc in prose_documents(man_sections):
        lines.append(json.dumps(doc, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\n")
        kind = doc["source"].split("/", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
        text_bytes += len(doc["text"].encode("utf-8"))
    if not lines:
        raise ConfigError("no text found: pydoc_data and /usr/share/common-licenses are both missing")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, b"".join(lines))
    return {"out": str(out), "documents": len(lines), "by_source": counts, "text_bytes": text_bytes,
            "man_sections": list(man_sections)}
