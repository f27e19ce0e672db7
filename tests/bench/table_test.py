#!/usr/bin/env python3
"""bench/table.py --quick end to end (ctest bench_table): the real benches, run once at small sizes.

    table_test.py BENCH_TABLE_PY BIN_DIR

Checks what the table says, never how fast anything is (no timed assertion):
- every row of issue #18's table is there, once, in order, at the --quick sizes;
- each row's figure and reference are the fields of the JSON line the bench printed for it
  (--raw keeps them), restated here row by row from the bench sources;
- each ratio is figure / reference as printed, both in one unit, and "met" says whether that
  ratio is within the goal printed beside it;
- a row without a figure says why, and only Open MPI's absence may leave one out;
- the commands listed under the table are the ones run, each with --json.
Standard library only.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

MPI = "Open MPI"
LOCAL = "Client::local(8)"
SHARED = "co-located Client::connect (8 worker processes, shared memory)"
LAYOUT = "P('data', None)"

# (label, bench, which JSON line, figure field, reference field, scale to the printed unit).
# The --quick sizes: 4 KiB, 64 KiB and 256 KiB collectives, 8 MiB transfers.
EXPECTED = [
    ("cached jitted (8, 8) elementwise, call + wait, p50 vs a gRPC unary round trip p50", "dispatch", {},
     "p50_us", "grpc_p50_us", 1),
    ("chained calls, each consuming the last, per call vs back to back", "dispatch", {},
     "chained_us_per_call", "back_to_back_us_per_call", 1),
    ("jitted call with one scalar psum over 8 devices, p50 vs the same call without it", "dispatch", {},
     "psum_p50_us", "no_psum_p50_us", 1),
    ("all_reduce 4 KiB, shm path vs Open MPI TCP", "collectives",
     {"op": "all_reduce", "bytes": 4096, "path": "shm"}, "seconds", "mpi_seconds", 1e3),
    ("all_reduce 4 KiB, gRPC path vs Open MPI TCP", "collectives",
     {"op": "all_reduce", "bytes": 4096, "path": "grpc"}, "seconds", "mpi_seconds", 1e3),
]
for op in ("all_reduce", "all_gather", "reduce_scatter"):
    for size, nbytes in (("64 KiB", 65536), ("256 KiB", 262144)):
        EXPECTED.append((f"{op} {size}, shm path vs Open MPI shared memory", "collectives",
                         {"op": op, "bytes": nbytes, "path": "shm"}, "seconds", "mpi_shm_seconds", 1e3))
        EXPECTED.append((f"{op} {size}, gRPC path vs Open MPI TCP", "collectives",
                         {"op": op, "bytes": nbytes, "path": "grpc"}, "seconds", "mpi_seconds", 1e3))
EXPECTED += [
    (f"device_put 8 MiB {LAYOUT}, {LOCAL} vs memcpy", "transfer", {"cluster": "in_process", "layout": LAYOUT},
     "put_seconds", "memcpy_seconds", 1e3),
    (f"fetch 8 MiB {LAYOUT}, {LOCAL} vs memcpy", "transfer", {"cluster": "in_process", "layout": LAYOUT},
     "fetch_seconds", "memcpy_seconds", 1e3),
    (f"device_put 8 MiB P() (8 copies), {LOCAL} vs memcpy", "transfer", {"cluster": "in_process", "layout": "P()"},
     "put_seconds", "memcpy_seconds", 1e3),
    (f"fetch 8 MiB P(), {LOCAL} vs memcpy", "transfer", {"cluster": "in_process", "layout": "P()"},
     "fetch_seconds", "memcpy_seconds", 1e3),
    (f"device_put 8 MiB {LAYOUT}, {SHARED} vs memcpy", "transfer", {"cluster": "processes/shm", "layout": LAYOUT},
     "put_seconds", "memcpy_seconds", 1e3),
    (f"fetch 8 MiB {LAYOUT}, {SHARED} vs memcpy", "transfer", {"cluster": "processes/shm", "layout": LAYOUT},
     "fetch_seconds", "memcpy_seconds", 1e3),
    ("MLP 784→1024→1024→1024→10 (batch 1024) step, 8-way data parallel vs one device", "fsdp",
     {"program": "mlp_dp", "mesh": "(8,)"}, "step_ms", "one_device_step_ms", 1),
]

# The goals (its "Performance goals"), as time ratios at most; None: the issue sets none.
GOALS = [2, 1.2, 1.5, 1.0, None] + [1.0, 1.0, 1.0, 1.0] * 2 + [None, 1.0, None, 1.0] + [2, 2, 3, 2, 3, 3, 1.2]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def value(cell):
    """("12.3", "ms") from "12.3 ms"."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?) (µs|ms)", cell)
    if not m:
        fail(f"'{cell}' is not a number and a unit")
    return m.group(1), m.group(2)


def close(printed, exact):
    # The table prints at least three significant digits: within 0.5 % of the bench's value.
    return abs(printed - exact) <= 0.006 * abs(exact) + 1e-9


def main():
    table_py, bin_dir = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        done = subprocess.run([sys.executable, table_py, "--bin", bin_dir, "--quick", "--raw", raw_path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
        print(done.stdout)
        print(done.stderr, file=sys.stderr)
        if done.returncode != 0:
            fail(f"bench/table.py --quick exited {done.returncode}")
        with open(raw_path) as f:
            raw = json.load(f)

    lines = done.stdout.splitlines()
    header = "| row | Tessera | reference | ratio | goal | met | notes |"
    if header not in lines:
        fail("no table header")
    at = lines.index(header) + 2
    rows = []
    while at < len(lines) and lines[at].startswith("| "):
        cells = [c.strip() for c in lines[at].strip("|").split(" | ")]
        if len(cells) != 7:
            fail(f"row with {len(cells)} cells: {lines[at]}")
        rows.append(cells)
        at += 1
    labels = [r[0] for r in rows]
    if labels != [e[0] for e in EXPECTED]:
        fail(f"rows {labels}\n  expected {[e[0] for e in EXPECTED]}")

    mpi_installed = shutil.which("mpirun") is not None
    checked = 0
    for (label, figure, reference, ratio, goal, met, note), (_, bench, where, fig_field, ref_field, scale), want in zip(
            rows, EXPECTED, GOALS):
        want_goal = "—" if want is None else f"≤ {want}×"
        if not goal.startswith(want_goal):
            fail(f"{label}: goal '{goal}', the issue's is {want_goal}")
        if figure == "—":
            if mpi_installed or MPI not in label or MPI not in note or not note.startswith("not produced: "):
                fail(f"{label}: no figure ({note}), and only a missing Open MPI may leave one out")
            continue
        (fig_text, fig_unit), (ref_text, ref_unit) = value(figure), value(reference)
        if fig_unit != ref_unit:
            fail(f"{label}: figure in {fig_unit}, reference in {ref_unit}")
        # The figures are the bench's own fields.
        line = next((l for l in raw[bench]["lines"] if all(l.get(k) == v for k, v in where.items())), None)
        if line is None:
            fail(f"{label}: bench_{bench} printed no line {where}")
        if not close(float(fig_text), line[fig_field] * scale) or not close(float(ref_text), line[ref_field] * scale):
            fail(f"{label}: {figure} / {reference}, the bench's {fig_field} {line[fig_field]} / {ref_field} "
                 f"{line[ref_field]}")
        # The ratio is figure / reference as printed, to the digits printed.
        m = re.fullmatch(r"([0-9]+\.([0-9]+))×", ratio)
        if not m:
            fail(f"{label}: ratio '{ratio}'")
        exact = float(fig_text) / float(ref_text)
        if abs(float(m.group(1)) - exact) > 0.5 * 10 ** -len(m.group(2)) + 1e-9:
            fail(f"{label}: ratio {ratio}, but {fig_text} / {ref_text} = {exact:.4f}")
        expect_met = "—" if want is None else "met" if float(m.group(1)) <= want else "not met"
        if met != expect_met:
            fail(f"{label}: '{met}' for {ratio} against {goal}")
        checked += 1

    # The new field of bench_fsdp agrees with the ratio it printed before.
    for l in raw["fsdp"]["lines"]:
        if abs(l["step_ms"] / l["one_device_step_ms"] - l["time_vs_one_device"]) > 0.002 * l["time_vs_one_device"] + 0.001:
            fail(f"bench_fsdp: step_ms / one_device_step_ms != time_vs_one_device in {l}")

    # The commands under the table are the ones run, in order, each with --json.
    listed = [shlex.split(l.split("    #")[0]) for l in lines[at:] if l.startswith("    ") and "bench_" in l]
    ran = [raw[b]["command"] for b in ("dispatch", "collectives", "transfer", "fsdp")]
    if listed != ran:
        fail(f"commands listed {listed}, run {ran}")
    for command in ran:
        if not os.path.basename(command[0]).startswith("bench_") or "--json" not in command:
            fail(f"command {command}")
    print(f"ok: {len(rows)} rows, {checked} with figures checked against the benches' JSON")


if __name__ == "__main__":
    main()
