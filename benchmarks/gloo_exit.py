"""Does a two-process gloo run of `lnfree.train.run` end cleanly? Exit codes over repeated torchrun runs.

A user's script under torchrun calls `run(config)` and simply ends. About one such run in ten aborted
in interpreter teardown on a loaded CPU machine ("terminate called without an active exception",
exit -6) after every result had been written; `lnfree.train.run` registers `close_distributed` at exit
(pytorch/pytorch#179291) against it. This measures whether it still happens: it runs `tests/dist_worker.py --natural-exit`
(the tiny preset, 2 gloo processes, no explicit teardown) `--runs` times, half of them beside a
process that keeps one core busy, and counts exit codes and aborts.

    python benchmarks/gloo_exit.py [--runs 20] [--steps 20] [--out benchmarks/results/gloo_exit.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lnfree.config import load_preset, with_overrides

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
SCHEDULE = {"stages": [{"kind": "ln_2", "start": 2, "gap": 1}, {"kind": "ln_1qk", "gap": 1},
                       {"kind": "ln_1v", "gap": 2}, {"kind": "ln_f", "gap": 0}]}
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: sum(range(10000))"


def one_run(config_file: Path, result_file: Path) -> tuple[int, bool, str]:
    """(torchrun's exit code, whether a worker aborted in teardown, the last error line if it failed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
         str(config_file), str(result_file), "--natural-exit"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    aborted = "terminate called" in proc.stderr or "SIGABRT" in proc.stderr or "exitcode  : -6" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "Error" in line]
    return proc.returncode, aborted, (errors[-1][-300:] if proc.returncode and errors else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (the tiny preset)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gloo_exit.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            loaded = i % 2 == 1
            run_dir = Path(folder) / f"run{i}"
            config = with_overrides(load_preset("tiny"), {
                "output_dir": str(run_dir), "train.max_steps": args.steps, "train.tokens_per_step": 512,
                "train.micro_batch_size": 4, "train.sigma_init_batches": 2, "train.eval_every": 0,
                "train.save_every": 0, "data.max_documents": 300, "data.context_length": 64,
                "data.eval_sequences": 4, "removal.schedule": SCHEDULE})
            config_file = Path(folder) / f"config{i}.json"
            config_file.write_text(config.model_dump_json())
            busy = subprocess.Popen([sys.executable, "-c", BUSY]) if loaded else None
            try:
                code, aborted, error = one_run(config_file, Path(folder) / f"result{i}.json")
            finally:
                if busy is not None:
                    busy.kill()
            written = (Path(folder) / f"result{i}.json").is_file()
            rows.append({"run": i, "loaded": loaded, "exit_code": code, "aborted": aborted, "result_written": written,
                         "error": error})
            print(rows[-1], flush=True)
    codes = collections.Counter(r["exit_code"] for r in rows)
    summary = {"runs": len(rows), "steps": args.steps, "exit_codes": {str(k): v for k, v in sorted(codes.items())},
               "aborts": sum(r["aborted"] for r in rows), "loaded_runs": sum(r["loaded"] for r in rows),
               "results_written": sum(r["result_written"] for r in rows), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    line = (f"{summary['aborts']} aborts and exit codes {summary['exit_codes']} in {len(rows)} two-process runs "
            f"({summary['loaded_runs']} beside a busy core); {summary['results_written']} wrote their result")
    args.out.with_suffix(".txt").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
