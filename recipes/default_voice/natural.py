"""Natural sentences from redistributable offline text, one source per role.

| role | English | Mandarin |
| --- | --- | --- |
| training | docstrings of Python's standard library (PSF licence) | Debian `fortunes-zh`, file `chinese` (GPL-3.0+) |
| held out | Debian `fortunes` (BSD-style; never trained on) | zh_CN gettext catalogues of the installed Debian packages (each its package's licence) |

Every sentence passes the same filter: plain words and clause punctuation only (no digits,
symbols, code or markup), so the teacher, the G2P and the WER reference read the same words.
"""

from __future__ import annotations

import ast
import gettext
import random
import re
import sysconfig
from pathlib import Path

FORTUNES = Path("/usr/share/games/fortunes")
LOCALE_ZH = Path("/usr/share/locale/zh_CN/LC_MESSAGES")
_EN_SENTENCE = re.compile(r"[A-Z][a-z']*(?:[ ,;-]+[A-Za-z][a-z']*)*[.!?]")
_EN_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_ZH_OK = re.compile(r"[\u4e00-\u9fff，、；：]+[。！？]")
_ZH_SPLIT = re.compile(r"(?<=[。！？])")
# a modern-Mandarin marker: classical verse in the same file rarely uses these
_ZH_MODERN = re.compile(r"[的了们这吗呢吧很您]|没有|什么|可以|如果|因为|所以|已经|一个|我们|他们")
_ANSI = re.compile(r"\x1b\[[0-9;]*m|\[[0-9;]*m")
# English fortune files of everyday prose (the offensive set is a separate package, not used)
_FORTUNE_FILES = (
    "wisdom",
    "people",
    "literature",
    "love",
    "food",
    "pets",
    "work",
    "education",
    "kids",
    "platitudes",
    "miscellaneous",
    "humorists",
    "fortunes",
    "sports",
    "men-women",
)
_CODE_WORDS = {
    "self",
    "args",
    "kwargs",
    "none",
    "true",
    "false",
    "str",
    "int",
    "dict",
    "bool",
    "tuple",
    "iterable",
    "callable",
    "param",
    "params",
    "func",
    "obj",
    "attr",
    "stdin",
    "stdout",
    "stderr",
    "utf",
    "ascii",
    "unicode",
    "api",
    "url",
    "os",
    "sys",
    "xml",
}


def _english_ok(s: str, min_words: int, max_words: int) -> bool:
    words = s.replace(",", " ").replace(";", " ").split()
    if not min_words <= len(words) <= max_words or not _EN_SENTENCE.fullmatch(s):
        return False
    if "--" in s or "''" in s:
        return False
    return not any(w.strip(".!?-'").lower() in _CODE_WORDS for w in words)


def _english_sentences(texts: list[str], min_words: int, max_words: int) -> list[str]:
    seen, out = set(), []
    for text in texts:
        flat = re.sub(r"\s+", " ", text).strip()
        for s in _EN_SPLIT.split(flat):
            s = s.strip()
            if s not in seen and _english_ok(s, min_words, max_words):
                seen.add(s)
                out.append(s)
    return out


def stdlib_docstrings() -> list[str]:
    """Every module, class and function docstring of the standard library, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "tkinter"}
    texts = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.extend(
                        p for p in re.split(r"\n\s*\n", doc) if not p.lstrip().startswith(">>>")
                    )
    return texts


def english_training(count: int, seed: int) -> list[str]:
    """Standard-library docstring sentences of 5-28 words, shuffled by `seed`."""
    out = _english_sentences(stdlib_docstrings(), 5, 28)
    random.Random(seed).shuffle(out)
    if len(out) < count:
        raise RuntimeError(f"only {len(out)} natural English sentences in the standard library")
    return out[:count]


def _fortunes(folder: Path, names: tuple[str, ...]) -> list[str]:
    texts = []
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            body = [
                ln for ln in _ANSI.sub("", entry).splitlines() if not ln.strip().startswith("--")
            ]
            texts.append(" ".join(body))
    return texts


def english_held_out(count: int, seed: int) -> list[str]:
    """Sentences of 5-22 words from Debian's `fortunes` (apt-get install fortunes)."""
    out = _english_sentences(_fortunes(FORTUNES, _FORTUNE_FILES), 5, 22)
    if len(out) < count:
        raise RuntimeError(f"{len(out)} sentences in {FORTUNES}: apt-get install fortunes")
    random.Random(seed).shuffle(out)
    return out[:count]


def _chinese_sentences(texts: list[str], min_chars: int, max_chars: int) -> list[str]:
    seen, out = set(), []
    for text in texts:
        flat = re.sub(r"\s+", "", _ANSI.sub("", text))
        for s in _ZH_SPLIT.split(flat):
            if (
                _ZH_OK.fullmatch(s)
                and _ZH_MODERN.search(s)
                and min_chars <= len(s) <= max_chars
                and s not in seen
            ):
                seen.add(s)
                out.append(s)
    return out


def chinese_training(count: int, seed: int) -> list[str]:
    """Sentences of 6-40 characters from Debian's `fortunes-zh` (apt-get install fortunes-zh)."""
    out = _chinese_sentences(_fortunes(FORTUNES, ("chinese",)), 6, 40)
    if len(out) < count:
        raise RuntimeError(
            f"{len(out)} sentences in {FORTUNES / 'chinese'}: apt-get install fortunes-zh"
        )
    random.Random(seed).shuffle(out)
    return out[:count]


def chinese_held_out(count: int, seed: int) -> list[str]:
    """Sentences of 6-40 characters from the zh_CN gettext catalogues on this machine."""
    texts = []
    for path in sorted(LOCALE_ZH.glob("*.mo")):
        try:
            with path.open("rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog  # the parsed .mo
        except OSError:
            continue
        texts.extend(
            v for k, v in catalog.items() if isinstance(k, str) and k and isinstance(v, str)
        )
    out = _chinese_sentences(texts, 6, 40)
    if len(out) < count:
        raise RuntimeError(f"only {len(out)} zh_CN catalogue sentences under {LOCALE_ZH}")
    random.Random(seed).shuffle(out)
    return out[:count]
