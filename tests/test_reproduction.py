"""The committed CPU-scale results (experiments/results/tiny) are what the reproduction command regenerates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiny_reproduction_regenerates_the_committed_numbers():
    """Removal + control, verify, eval and every analysis, rerun and compared number by number (rtol 1e-3)."""
    result = subprocess.run([sys.executable, str(REPO / "experiments" / "tiny" / "reproduce.py"), "--check"],
                            cwd=REPO, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(result.stdout.splitlines()[-30:])
    assert result.returncode == 0, f"{tail}\n{result.stderr[-3000:]}"
    assert "0 differences" in result.stdout
