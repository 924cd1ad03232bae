"""One home for lnfree's errors: every error lnfree raises for a user to read is an `LnfreeError`.

Each specific error (`ConfigError`, `LoadError`, `ExportError`, …) lives beside the code that raises
it and subclasses `LnfreeError` and `ValueError` (or `RuntimeError`), so `except ValueError` callers
keep working. The CLI catches `LnfreeError` and `OSError` (missing or unreadable files) only: a plain
`ValueError` from inside lnfree is a bug and keeps its traceback (pydantic validators still raise
`ValueError`, which `lnfree.removal.config` turns into a `ConfigError`).
"""

from __future__ import annotations


class LnfreeError(Exception):
    """Base of every error lnfree raises for a user to read (the CLI prints it and exits with status 1)."""


class UsageError(LnfreeError, ValueError):
    """A request that cannot be carried out as asked: options, model labels, prompt templates."""
