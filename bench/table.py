#!/usr/bin/env python3
"""Issue #18's table in one run: each bench at the issue's sizes, one markdown table.

Runs bench_dispatch, bench_collectives (shm and gRPC paths, with Open MPI's shared memory and
TCP when mpirun is installed), bench_transfer and bench_fsdp with --json, one after the other,
and prints a row per figure of the issue's table: the Tessera figure, its reference measured in
the same run, the ratio figure / reference (both as printed), the goal and whether it is met,
then the exact commands it ran. A figure that cannot be produced (Open MPI absent, a bench that
failed) leaves its row saying why; the rest of the table is still printed.

    ./dev bench table                        # builds, then: bench/table.py --bin build/bin
    bench/table.py --bin build/bin [--quick] [--raw FILE]

--quick runs every bench at small sizes and few iterations (a smoke check: the rows are
labelled with the sizes actually run, and the figures are not the goals' sizes). --raw writes
the JSON lines each bench printed. Exit status: 0 with every bench run (Open MPI missing is not
a failure), 1 if a bench failed or timed out (its rows say so), 2 on bad arguments.
Standard library only.
"""

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

# What each mode runs. The full mode is the sizes; the bench defaults otherwise.
FULL = {
    "dispatch": ["--iters=300", "--back_to_back=300"],
    "collective_bytes": [4096, 16 << 20, 64 << 20],
    "collective_iters": 10,
    "transfer_mib": 256,
    "transfer_iters": 3,
    "fsdp_iters": 5,
    "timeout_s": 1800,
}
QUICK = {
    "dispatch": ["--iters=10", "--back_to_back=10", "--chain_rounds=1"],
    "collective_bytes": [4096, 64 << 10, 256 << 10],
    "collective_iters": 1,
    "transfer_mib": 8,
    "transfer_iters": 1,
    "fsdp_iters": 1,
    "timeout_s": 600,
}
COLLECTIVE_OPS = ["all_reduce", "all_gather", "reduce_scatter"]
MPI_MISSING = "Open MPI is not installed (no mpirun on the PATH; ./dev install or ./dev bench brings it)"


class NotProduced(Exception):
    """A row's figure could not be produced; the message says why."""


class Run:
    """One bench's command, its JSON lines, and why it failed (None if it did not)."""

    def __init__(self, name, command):
        self.name = name
        self.command = command
        self.lines = []
        self.failure = None
        self.stderr = ""
        self.seconds = 0.0

    def find(self, what, **fields):
        """The first JSON line whose fields have these values."""
        for line in self.lines:
            if all(line.get(k) == v for k, v in fields.items()):
                return line
        raise NotProduced(self.failure or f"{self.name} printed no line for {what}")


def run_bench(bin_dir, name, args, timeout_s):
    program = os.path.join(bin_dir, "bench_" + name)
    run = Run(name, [program, "--json"] + args)
    start = time.monotonic()
    try:
        done = subprocess.run(run.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout_s)
        out, run.stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        run.stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    except OSError as e:
        out, run.stderr, rc = "", str(e), -1
    run.seconds = time.monotonic() - start
    for text in out.splitlines():
        if text.startswith("{"):
            try:
                run.lines.append(json.loads(text))
            except json.JSONDecodeError:
                pass
    if rc is None:
        run.failure = f"bench_{name} did not finish in {timeout_s} s"
    elif rc != 0:
        last = [s for s in run.stderr.splitlines() if s.strip()]
        run.failure = f"bench_{name} exited {rc}" + (f": {last[-1].strip()}" if last else "")
    if run.failure:
        print(f"table: {run.failure}", file=sys.stderr)
    return run


def size_name(nbytes):
    if nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20} MiB"
    if nbytes % (1 << 10) == 0:
        return f"{nbytes >> 10} KiB"
    return f"{nbytes} B"


def number(v):
    """v with at least three significant digits, as printed in the table."""
    a = abs(v)
    decimals = 0 if a == 0 else max(0, 2 - math.floor(math.log10(a)))
    return f"{v:.{decimals}f}"


def ratio_text(r):
    return f"{r:.1f}" if r >= 10 else f"{r:.2f}"


class Row:
    """A row: its label, its unit, a goal (ratio at most; None: no goal) and how to measure it:
    measure(runs) returns (figure, reference, note) in the unit, or raises NotProduced."""

    def __init__(self, label, unit, goal, measure, goal_text=None):
        self.label, self.unit, self.goal, self.measure = label, unit, goal, measure
        self.goal_text = goal_text or (f"≤ {goal}×" if goal is not None else "—")


def dispatch_rows():
    def latency(runs):
        d = runs["dispatch"].find("the call's p50")
        return d["p50_us"], d["grpc_p50_us"], (
            f"{d['transport']} channel; over TCP loopback the round trip is {number(d['grpc_tcp_p50_us'])} µs; "
            f"alternating call and round trip {ratio_text(d['interleaved_jit_over_rpc'])}×")

    def chained(runs):
        d = runs["dispatch"].find("chained calls")
        return d["chained_us_per_call"], d["back_to_back_us_per_call"], (
            f"median of the {d['chain_rounds']} rounds' ratios {ratio_text(d['chained_over_independent'])}× "
            f"({ratio_text(d['chained_over_independent_min'])}–{ratio_text(d['chained_over_independent_max'])})")

    def psum(runs):
        d = runs["dispatch"].find("the psum")
        return d["psum_p50_us"], d["no_psum_p50_us"], f"all_reduce {d['psum_algorithm']} on the {d['psum_path']} path"

    return [
        Row("cached jitted (8, 8) elementwise, call + wait, p50 vs a gRPC unary round trip p50", "µs", 2,
            latency),
        Row("chained calls, each consuming the last, per call vs back to back", "µs", 1.2, chained),
        Row("jitted call with one scalar psum over 8 devices, p50 vs the same call without it", "µs", 1.5, psum),
    ]


def collective_rows(sizes, mpi_why):
    small, mid, large = sizes
    # (op, bytes, path, Open MPI transport of the reference, goal)
    cases = [("all_reduce", small, "shm", "tcp", 1.0), ("all_reduce", small, "grpc", "tcp", None)]
    for op in COLLECTIVE_OPS:
        for nbytes in (mid, large):
            cases.append((op, nbytes, "shm", "shm", None if op == "reduce_scatter" else 1.0))
            cases.append((op, nbytes, "grpc", "tcp", 1.0))

    def measure(op, nbytes, path, transport):
        def f(runs):
            line = runs["collectives"].find(f"{op} {nbytes} on {path}", op=op, bytes=nbytes, path=path)
            key, other_key, other = (("mpi_shm_seconds", "mpi_seconds", "TCP") if transport == "shm" else
                                     ("mpi_seconds", "mpi_shm_seconds", "shm"))
            if key not in line:
                raise NotProduced(mpi_why() or "bench_collectives printed no Open MPI figure (see its stderr)")
            note = f"algorithm {line['algorithm']}; whole call {number(line['call_seconds'] * 1e3)} ms"
            if other_key in line:
                note += f"; Open MPI {other} {number(line[other_key] * 1e3)} ms"
            return line["seconds"] * 1e3, line[key] * 1e3, note
        return f

    rows = []
    for op, nbytes, path, transport, goal in cases:
        label = (f"{op} {size_name(nbytes)}, {'shm' if path == 'shm' else 'gRPC'} path vs Open MPI "
                 f"{'shared memory' if transport == 'shm' else 'TCP'}")
        goal_text = None
        if goal is not None and nbytes != small:
            goal_text = f"≤ {goal}× (bus bw ≥ 1.0×)"
        rows.append(Row(label, "ms", goal, measure(op, nbytes, path, transport), goal_text))
    return rows


def transfer_rows(mib):
    def measure(cluster, layout, what):
        def f(runs):
            line = runs["transfer"].find(f"{cluster} {layout}", cluster=cluster, layout=layout)
            return line[what + "_seconds"] * 1e3, line["memcpy_seconds"] * 1e3, f"{line['bytes']} bytes"
        return f

    size = f"{mib} MiB"
    local, shared = "Client::local(8)", "co-located Client::connect (8 worker processes, shared memory)"
    return [
        Row(f"device_put {size} P('data', None), {local} vs memcpy", "ms", 2,
            measure("in_process", "P('data', None)", "put")),
        Row(f"fetch {size} P('data', None), {local} vs memcpy", "ms", 2,
            measure("in_process", "P('data', None)", "fetch")),
        Row(f"device_put {size} P() (8 copies), {local} vs memcpy", "ms", 3, measure("in_process", "P()", "put")),
        Row(f"fetch {size} P(), {local} vs memcpy", "ms", 2, measure("in_process", "P()", "fetch")),
        Row(f"device_put {size} P('data', None), {shared} vs memcpy", "ms", 3,
            measure("processes/shm", "P('data', None)", "put")),
        Row(f"fetch {size} P('data', None), {shared} vs memcpy", "ms", 3,
            measure("processes/shm", "P('data', None)", "fetch")),
    ]


def fsdp_rows():
    def measure(runs):
        line = runs["fsdp"].find("the data-parallel step on (8,)", program="mlp_dp", mesh="(8,)")
        return line["step_ms"], line["one_device_step_ms"], f"Client::local(8); {line['collectives']} collectives"

    return [Row("MLP 784→1024→1024→1024→10 (batch 1024) step, 8-way data parallel vs one device", "ms", 1.2,
                measure)]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description="Issue #18's table in one run (bench/table.py).")
    parser.add_argument("--bin", default=os.path.join(here, "..", "build", "bin"),
                        help="the directory holding the bench_* programs (default: build/bin)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few iterations: a smoke check")
    parser.add_argument("--raw", help="write each bench's command and JSON lines to this file (JSON)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL
    if not os.path.isdir(args.bin):
        print(f"table: --bin={args.bin} is not a directory (build first: ./dev build)", file=sys.stderr)
        return 2

    sizes = mode["collective_bytes"]
    mib = mode["transfer_mib"]
    plan = [
        ("dispatch", mode["dispatch"]),
        ("collectives", ["--path=both", "--ops=" + ",".join(COLLECTIVE_OPS),
                         "--bytes=" + ",".join(str(b) for b in sizes), f"--iters={mode['collective_iters']}"]),
        ("transfer", [f"--mib={mib}", f"--iters={mode['transfer_iters']}", "--cluster=both", "--path=shm"]),
        ("fsdp", [f"--iters={mode['fsdp_iters']}"]),
    ]
    load_before = os.getloadavg()
    start = time.monotonic()
    runs = {}
    for name, bench_args in plan:
        print(f"table: running bench_{name} ...", file=sys.stderr, flush=True)
        runs[name] = run_bench(args.bin, name, bench_args, mode["timeout_s"])
    elapsed = time.monotonic() - start
    load_after = os.getloadavg()

    def mpi_why():
        if shutil.which("mpirun") is None:
            return MPI_MISSING
        for text in runs["collectives"].stderr.splitlines():
            if "mpirun" in text or "mpicxx" in text:
                return text.strip()
        return None

    rows = dispatch_rows() + collective_rows(sizes, mpi_why) + transfer_rows(mib) + fsdp_rows()

    mode_text = ("--quick: small sizes and few iterations, a smoke check, not the goals' sizes" if args.quick else
                 "the issue's sizes")
    print(f"# Issue #18's table ({mode_text})")
    print()
    print(f"{os.cpu_count()} cores; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{elapsed:.0f} s in all. Ratio = Tessera / reference, both as printed (times: lower is better; "
          "a bus-bandwidth goal of ≥ 1.0× Open MPI is a time ratio ≤ 1.0).")
    print()
    print("| row | Tessera | reference | ratio | goal | met | notes |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        try:
            figure, reference, note = row.measure(runs)
        except (NotProduced, KeyError) as e:
            why = str(e) if isinstance(e, NotProduced) else f"field {e} missing from the bench's line"
            print(f"| {row.label} | — | — | — | {row.goal_text} | — | not produced: {why} |")
            continue
        fig_text, ref_text = number(figure), number(reference)
        ratio = ratio_text(float(fig_text) / float(ref_text)) if float(ref_text) > 0 else "—"
        if row.goal is None or ratio == "—":
            met = "—"
        else:
            met = "met" if float(ratio) <= row.goal else "not met"
        print(f"| {row.label} | {fig_text} {row.unit} | {ref_text} {row.unit} | {ratio}× | {row.goal_text} | "
              f"{met} | {note} |")
    print()
    print("Commands, in the order run:")
    print()
    for run in runs.values():
        status = run.failure or f"{run.seconds:.0f} s"
        print(f"    {shlex.join(run.command)}    # {status}")

    if args.raw:
        with open(args.raw, "w") as f:
            json.dump({name: {"command": r.command, "lines": r.lines, "failure": r.failure}
                       for name, r in runs.items()}, f, indent=1)
    return 1 if any(r.failure for r in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
