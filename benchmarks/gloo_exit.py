"""Does a two-process gloo run of `lnfree.removal.train.run` end cleanly? Exit codes over repeated torchrun runs.

A user's script under torchrun calls `run(config)` and simply ends. One such run in ten to thirty aborted
in interpreter teardown on a loaded CPU machine ("terminate called without an active exception",
exit -6) after every result had been written, despite `close_distributed` registered at exit (the cause and
the fix, `lnfree.removal.launch.exit_without_teardown`: benchmarks/results/README.md). This measures how often a
script that ends naturally aborts: it runs `tests/dist_worker.py --natural-exit`
(the tiny preset, 2 gloo processes, no explicit teardown) `--runs` times, half of them beside a
process that keeps one core busy, and counts exit codes and aborts.

Each run's processes may dump core (the soft core limit is raised to the hard one). When a run
aborts, its stderr and, where gdb and a core file are found in the run's folder (a `core_pattern`
without a leading `|`), every thread's backtrace are kept under `--aborts` (the cores themselves
are deleted): which thread called `std::terminate` is the cause.

    python benchmarks/gloo_exit.py [--runs 20] [--steps 20] [--out benchmarks/results/gloo_exit.json]
                                   [--aborts benchmarks/results/gloo_exit_aborts]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lnfree.removal.config import load_preset, with_overrides

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
SCHEDULE = {"stages": [{"kind": "ln_2", "start": 2, "gap": 1}, {"kind": "ln_1qk", "gap": 1},
                       {"kind": "ln_1v", "gap": 2}, {"kind": "ln_f", "gap": 0}]}
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: sum(range(10000))"


def one_run(config_file: Path, result_file: Path, folder: Path) -> tuple[int, bool, str, str]:
    """(torchrun's exit code, whether a worker aborted in teardown, the last error line if it failed,
    the whole stderr), run in `folder` so that core files land there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
         str(config_file), str(result_file), "--natural-exit"],
        env=env, capture_output=True, text=True, timeout=900, cwd=folder, preexec_fn=_allow_cores, check=False,
    )
    aborted = "terminate called" in proc.stderr or "SIGABRT" in proc.stderr or "exitcode  : -6" in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "Error" in line]
    return proc.returncode, aborted, (errors[-1][-300:] if proc.returncode and errors else ""), proc.stderr


def _allow_cores() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))


def keep_abort(run: int, stderr: str, folder: Path, aborts: Path) -> list[str]:
    """Keep an aborted run's stderr and every core's all-thread backtrace under `aborts`; delete the
    cores. Returns the files written."""
    aborts.mkdir(parents=True, exist_ok=True)
    written = [aborts / f"run{run}.stderr.txt"]
    written[0].write_text(stderr)
    for n, core in enumerate(sorted(folder.glob("core*"))):
        if shutil.which("gdb"):
            trace = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt", sys.executable, str(core)],
                                   capture_output=True, text=True, timeout=600, check=False)
            written.append(aborts / f"run{run}.core{n}.backtrace.txt")
            written[-1].write_text(trace.stdout + trace.stderr)
        core.unlink()
    return [str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path) for path in written]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (the tiny preset)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gloo_exit.json")
    parser.add_argument("--aborts", type=Path, default=ROOT / "benchmarks" / "results" / "gloo_exit_aborts",
                        help="where an aborted run's stderr and core backtraces are kept")
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
            cwd = Path(folder) / f"cwd{i}"  # where its cores land
            cwd.mkdir()
            try:
                code, aborted, error, stderr = one_run(config_file, Path(folder) / f"result{i}.json", cwd)
            finally:
                if busy is not None:
                    busy.kill()
            written = (Path(folder) / f"result{i}.json").is_file()
            kept = keep_abort(i, stderr, cwd, args.aborts) if aborted else []
            rows.append({"run": i, "loaded": loaded, "exit_code": code, "aborted": aborted, "result_written": written,
                         "error": error, "kept": kept})
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
