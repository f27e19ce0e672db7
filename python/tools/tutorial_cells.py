#!/usr/bin/env python3
"""Runs the Python code cells of one of JAX's notebooks against tessera, with only the import
lines changed, and prints a table of which cells run.

    PYTHONPATH=build/python /usr/bin/python3 python/tools/tutorial_cells.py \
        path/to/jax/docs/notebooks/shard_map.md [--devices 8] [--replace 8192=512] [--show]

The notebook is a file the caller fetched (a MyST .md with ```{code-cell} blocks, or an
.ipynb); this script fetches nothing and holds no notebook text. The cells run in order in one
namespace, as a notebook runs them, and each cell's last expression is shown with repr as
IPython shows it. The only rewrites:
  - imports: `import jax` becomes `import tessera as jax`, `import jax.numpy as jnp` becomes
    `import tessera.numpy as jnp`, `from jax.X import Y` becomes `from tessera.X import Y`
    (any `jax` module path in an import statement is the same path under `tessera`);
  - an IPython `%timeit [options] stmt` line runs `stmt` once (it is not Python);
  - `--replace OLD=NEW` substitutes text in every cell (for shrinking array sizes a notebook
    meant for accelerators: a runtime change, not an API one; the table's header names it);
  - `--devices N` sets JAX_NUM_CPU_DEVICES before the first cell, for notebooks that assume N
    devices without setting XLA_FLAGS (JAX itself reads the same variable).
A cell that raises is reported with its exception; a NameError for a name that only a failed
cell defines is reported as depending on that cell. Each cell has a deadline (--timeout).
"""
import argparse
import ast
import contextlib
import hashlib
import io
import json
import os
import re
import signal
import sys
import time
import traceback

_IMPORT = re.compile(r"^(\s*)import\s+jax(\.[\w.]+)?(\s+as\s+\w+)?\s*(#.*)?$")
_FROM = re.compile(r"^(\s*)from\s+jax((?:\.\w+)*)\s+import\b")
_TIMEIT = re.compile(r"^(\s*)%%?timeit(?:\s+-\w+(?:\s+\d+)?)*\s+(.*)$")


def read_cells(path):
    """The notebook's Python code cells, as source strings, in order."""
    text = open(path, encoding="utf-8").read()
    if path.endswith(".ipynb"):
        nb = json.loads(text)
        return [("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
                for c in nb["cells"] if c.get("cell_type") == "code"], text
    cells = []
    for m in re.finditer(r"^```\{code-cell\}[^\n]*\n(.*?)^```", text, re.S | re.M):
        body = m.group(1)
        body = re.sub(r"\A---\n.*?\n---\n", "", body, flags=re.S)  # a YAML options block
        lines = body.split("\n")
        while lines and re.match(r"^:[\w-]+:", lines[0]):  # `:key: value` options
            lines.pop(0)
        cells.append("\n".join(lines))
    return cells, text


def rewrite(src, replacements):
    """The cell with its import lines changed (and the notes of what else changed)."""
    notes = []
    out = []
    for line in src.split("\n"):
        m = _IMPORT.match(line)
        if m:
            indent, sub, alias = m.group(1), m.group(2) or "", m.group(3)
            line = f"{indent}import tessera{sub}{alias if alias else ' as jax' if not sub else ''}"
            if sub and not alias:  # `import jax.numpy` binds `jax`
                line = f"{indent}import tessera{sub}; import tessera as jax"
        elif _FROM.match(line):
            line = _FROM.sub(lambda m: f"{m.group(1)}from tessera{m.group(2)} import", line)
        else:
            t = _TIMEIT.match(line)
            if t:
                line = f"{t.group(1)}{t.group(2)}"
                notes.append("IPython %timeit run once")
        out.append(line)
    src = "\n".join(out)
    for old, new in replacements:
        if old in src:
            src = src.replace(old, new)
            notes.append(f"{old}->{new}")
    return src, notes


def bound_names(src):
    """Names a cell binds at top level (assignments, defs, imports)."""
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


class CellTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CellTimeout("the cell's deadline passed")


def run_cell(src, namespace, timeout):
    """Executes `src` as IPython would (the last expression's repr shown); returns the output
    and the exception, if any."""
    buf = io.StringIO()
    error = None
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    try:
        with contextlib.redirect_stdout(buf):
            tree = ast.parse(src)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), namespace)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
                if value is not None:
                    print(repr(value))
    except BaseException as e:  # noqa: B902 - every failure is a verdict, KeyboardInterrupt aside
        if isinstance(e, KeyboardInterrupt):
            raise
        error = e
        tb = traceback.extract_tb(e.__traceback__)
        buf.write("".join(traceback.format_list([f for f in tb if f.filename == "<cell>"][-1:])))
    finally:
        signal.alarm(0)
    return buf.getvalue(), error


def short(e):
    msg = str(e).strip().split("\n")[0]
    if len(msg) > 160:
        msg = msg[:157] + "..."
    return f"{type(e).__name__}: {msg}".replace("|", "\\|")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook")
    ap.add_argument("--devices", type=int, help="JAX_NUM_CPU_DEVICES for a notebook that assumes N devices")
    ap.add_argument("--replace", action="append", default=[], metavar="OLD=NEW")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per cell")
    ap.add_argument("--show", action="store_true", help="print each cell's source and output")
    args = ap.parse_args()

    cells, text = read_cells(args.notebook)
    replacements = [tuple(r.split("=", 1)) for r in args.replace]
    if args.devices:
        os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    namespace = {"__name__": "__main__"}
    failed_names = {}  # name -> the failed cell that binds it
    rows = []
    for k, cell in enumerate(cells, 1):
        src, notes = rewrite(cell, replacements)
        if not src.strip():
            rows.append((k, "empty", ""))
            continue
        start = time.monotonic()
        output, error = run_cell(src, namespace, args.timeout)
        seconds = time.monotonic() - start
        if error is None:
            verdict, detail = "runs", "; ".join(notes)
            for n in bound_names(src):
                failed_names.pop(n, None)
        else:
            dep = None
            if isinstance(error, NameError):
                m = re.search(r"name '(\w+)' is not defined", str(error))
                dep = failed_names.get(m.group(1)) if m else None
            verdict = f"fails (needs cell {dep})" if dep else "fails"
            detail = short(error)
            for n in bound_names(src):
                if n not in namespace:
                    failed_names[n] = k
        rows.append((k, verdict, detail))
        if args.show:
            print(f"---- cell {k}: {verdict} ({seconds:.1f} s) {detail}\n{src}\n---- output\n{output}", flush=True)

    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    print(f"\n{os.path.basename(args.notebook)} (sha256 {digest}), {len(cells)} code cells"
          + (f", JAX_NUM_CPU_DEVICES={args.devices}" if args.devices else "")
          + (f", replaced {', '.join(args.replace)}" if args.replace else ""))
    print("| cell | verdict | detail |\n|---|---|---|")
    for k, verdict, detail in rows:
        print(f"| {k} | {verdict} | {detail} |")
    runs = sum(1 for _, v, _ in rows if v == "runs")
    print(f"\n{runs} of {len(rows)} cells run")
    sys.stdout.flush()
    os._exit(0)  # not the interpreter's teardown of a cluster a failed cell may have left busy


if __name__ == "__main__":
    main()
