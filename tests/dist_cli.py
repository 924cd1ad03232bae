"""Run under torchrun: the `lnfree` command line, watched at interpreter teardown.

    torchrun --nproc_per_node=2 tests/dist_cli.py REPORT_DIR remove --config CONFIG.json ...

Registered before lnfree is imported, the watcher runs last at exit: if the process reaches the
interpreter's teardown, it writes REPORT_DIR/rank<N>.json with the gloo threads still alive then
(the precondition of the teardown abort, `lnfree.removal.launch.exit_without_teardown`).
"""

import atexit
import json
import os
import sys
from pathlib import Path

report_dir = Path(sys.argv.pop(1))


def gloo_threads() -> list[str]:
    names = (Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name)


@atexit.register
def report() -> None:
    (report_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps({"gloo_threads": gloo_threads()}))


from lnfree.cli import app  # noqa: E402  (after the watcher, so that it runs last)

app(prog_name="lnfree")
