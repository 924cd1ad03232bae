"""One home for lnfree's errors: every error lnfree raises for a user to read is an `LnfreeError`.

Each specific error (`ConfigError`, `LoadError`, `ExportError`, …) lives beside the code that raises
it and subclasses `LnfreeError` and `ValueError` (or `RuntimeError`), so `except ValueError` callers
keep working. The CLI catches `LnfreeError` and `OSError` (missing or unreadable files), and for now
`ValueError` too: some messages for users are still raised as plain `ValueError` (e.g. `lnfree.analysis.folder`).
"""

from __future__ import annotations


class LnfreeError(Exception):
    """Base of every error lnfree raises for a user to read (the CLI prints it and exits with status 1)."""


class UsageError(LnfreeError, ValueError):
    """A request that cannot be carried out as asked: options, model labels, prompt templates."""
