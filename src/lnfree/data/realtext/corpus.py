"""Real English text for the 'realtext' model: the documentation that ships in Django's sdist.

Django's source distribution on PyPI (``django-5.2.8.tar.gz``, 10.8 MB, BSD-3-Clause like the rest
of Django) contains its full documentation as reStructuredText under ``docs/``: 639 ``.txt`` files,
6.1 MB of English prose about web development, with code samples and release notes. Each file is
one document. The sdist is fetched once with pip into a cache::

    python -m pip download --no-deps --no-binary :all: django==5.2.8 -d ~/.cache/lnfree/realtext

and checked against its sha256, so every machine reads byte-identical documents.

The documents split three ways, whole files only: train (92%), and the held-out 8% halved into a
*validation* part (what a run evaluates while it trains, and every choice of a step, a config or a
pilot) and a *test* part that only the final evaluation reads (`lnfree eval --dataset realtext`).
"""

from __future__ import annotations

import random
import subprocess
import sys
import tarfile
from pathlib import Path

from lnfree.errors import LnfreeError, UsageError
from lnfree.files import file_sha256

__all__ = [
    "SDIST_NAME", "SDIST_SHA256", "CorpusError", "fetch_command", "sdist_path", "load_documents",
    "split_documents", "split_heldout", "train_and_heldout", "HELD_OUT_PARTS",
]

DJANGO_VERSION = "5.2.8"
SDIST_NAME = f"django-{DJANGO_VERSION}.tar.gz"
SDIST_SHA256 = "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f"
#: Share of documents held out (whole files), and the seed of the shuffle that picks them.
HELDOUT_FRACTION = 0.08
SPLIT_SEED = 0
#: The seed of the shuffle that halves the held-out documents into validation and test.
TEST_SPLIT_SEED = 1
#: The held-out parts a caller may ask for.
HELD_OUT_PARTS = ("validation", "test")
_DOCS_PREFIX = f"django-{DJANGO_VERSION}/docs/"
_SKIPPED = ("_theme/", "requirements.txt")  # HTML-theme licence text and a pip requirements list


class CorpusError(LnfreeError, RuntimeError):
    """The corpus cannot be fetched or does not match the expected download."""


def default_cache_dir() -> Path:
    """Where the sdist is cached: ``~/.cache/lnfree/realtext``."""
    return Path.home() / ".cache" / "lnfree" / "realtext"


def fetch_command(cache_dir: Path) -> list[str]:
    """The pip command that downloads the sdist into ``cache_dir``."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            f"django=={DJANGO_VERSION}", "-d", str(cache_dir)]  # fmt: skip


def sdist_path(cache_dir: Path | None = None, *, download: bool = True) -> Path:
    """The verified sdist in ``cache_dir``, downloaded with pip first if it is not there."""
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    path = cache_dir / SDIST_NAME
    if not path.is_file() and download:
        cache_dir.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(fetch_command(cache_dir), capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [""]
            raise CorpusError(
                f"could not download the realtext corpus ({tail[0]}); run `{' '.join(fetch_command(cache_dir))}`"
            )
    if not path.is_file():
        raise CorpusError(f"realtext corpus not found; run `{' '.join(fetch_command(cache_dir))}`")
    if file_sha256(path) != SDIST_SHA256:
        raise CorpusError(f"{path} does not match the expected sha256; delete it and fetch it again")
    return path


def load_documents(cache_dir: Path | None = None) -> dict[str, str]:
    """Every documentation file of the sdist, ``{path under docs/: text}``, sorted by path."""
    docs: dict[str, str] = {}
    with tarfile.open(sdist_path(cache_dir)) as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(_DOCS_PREFIX)
            if member.isfile() and name != member.name and name.endswith(".txt") and not name.startswith(_SKIPPED):
                docs[name] = tar.extractfile(member).read().decode("utf-8").strip()
    return dict(sorted(docs.items()))


def split_documents(
    names: list[str], heldout_fraction: float = HELDOUT_FRACTION, seed: int = SPLIT_SEED
) -> tuple[list[str], list[str]]:
    """(train, held-out) document names: a seeded shuffle of the sorted names, whole files only."""
    order = sorted(names)
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(len(order) * heldout_fraction))
    return sorted(order[n_heldout:]), sorted(order[:n_heldout])


def split_heldout(sizes: dict[str, int], seed: int = TEST_SPLIT_SEED) -> tuple[list[str], list[str]]:
    """(validation, test) names of held-out documents: in a seeded shuffle, each document goes to the
    part with fewer characters so far, so that the halves hold about the same amount of text (one
    document is 22% of the held-out text)."""
    order = sorted(sizes)
    random.Random(seed).shuffle(order)
    parts: tuple[list[str], list[str]] = ([], [])
    totals = [0, 0]
    for name in order:
        side = 0 if totals[0] <= totals[1] else 1
        parts[side].append(name)
        totals[side] += sizes[name]
    return sorted(parts[0]), sorted(parts[1])


def train_and_heldout(cache_dir: Path | None = None, part: str = "validation") -> tuple[list[str], list[str]]:
    """The texts of the train documents and of one held-out `part` ("validation" or "test"), each
    list in sorted-path order."""
    if part not in HELD_OUT_PARTS:
        raise UsageError(f"unknown held-out part {part!r}; use one of {', '.join(HELD_OUT_PARTS)}")
    docs = load_documents(cache_dir)
    train, heldout = split_documents(list(docs))
    halves = dict(zip(HELD_OUT_PARTS, split_heldout({n: len(docs[n]) for n in heldout})))
    return [docs[n] for n in train], [docs[n] for n in halves[part]]


if __name__ == "__main__":  # `python -m lnfree.data.realtext.corpus`: fetch and check the corpus (a setup step)
    print(sdist_path())
