# The ```python blocks of docs/guide.md, run in order in one namespace, each block's printed
# output compared with the ```text output block after it (only prose between), as guide_test
# does for the C++ blocks: a line "..." in the expected output stands for any number of lines.
import contextlib
import io
import os

from conftest import SOURCE_DIR


def blocks():
    """(python source, expected output or None, line number) for each ```python block."""
    lines = open(os.path.join(SOURCE_DIR, "docs", "guide.md"), encoding="utf-8").read().split("\n")
    out, i, previous = [], 0, None  # previous: the kind of the last fenced block
    while i < len(lines):
        if lines[i].startswith("```"):
            kind, start = lines[i][3:], i + 1
            i += 1
            while lines[i] != "```":
                i += 1
            body = lines[start:i]
            if kind == "python":
                out.append(["\n".join(body), None, start + 1])
            elif kind == "text output" and previous == "python":
                out[-1][1] = body
            previous = kind
        i += 1
    return out


def matches(got, want):
    if not want:
        return not got
    if want[0] == "...":
        return any(matches(got[k:], want[1:]) for k in range(len(got) + 1))
    return bool(got) and got[0] == want[0] and matches(got[1:], want[1:])


def test_every_python_block_runs_and_prints_what_the_guide_shows():
    found = blocks()
    assert len(found) >= 3, "the guide's Python section lost its blocks"
    namespace = {"__name__": "guide"}
    for source, want, line in found:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(source, f"docs/guide.md:{line}", "exec"), namespace)
        got = buffer.getvalue().rstrip("\n").split("\n") if buffer.getvalue() else []
        if want is not None:
            assert matches(got, want), f"docs/guide.md:{line} printed\n" + "\n".join(got) + \
                "\nbut the guide shows\n" + "\n".join(want)


def jax_table_rows():
    """(JAX column, Python column) of each row of the guide's "JAX to Tessera" table."""
    text = open(os.path.join(SOURCE_DIR, "docs", "guide.md"), encoding="utf-8").read()
    table = text.split("## JAX to Tessera", 1)[1].split("\n### ", 1)[0]
    rows = [l for l in table.split("\n") if l.startswith("| `") or l.startswith("| ")][2:]
    out = []
    for row in rows:
        # Cells split on " | " outside backticks.
        cells, cell, ticks = [], "", False
        for ch in row.strip()[1:-1]:
            if ch == "`":
                ticks = not ticks
            if ch == "|" and not ticks:
                cells.append(cell.strip())
                cell = ""
            else:
                cell += ch
        cells.append(cell.strip())
        out.append(cells)
    return out


def test_jax_table_python_column_names_resolve():
    # Every row the Python column calls "as JAX": each jax./jnp./lax. name of the JAX column is
    # in the package, each keyword of its call is a parameter, each x./mesh./sharding. attribute
    # is the Array's, Mesh's or NamedSharding's.
    import inspect
    import re
    import tessera
    import tessera.numpy
    import tessera.lax
    from tessera.sharding import Mesh, NamedSharding
    roots = {"jax": tessera, "jnp": tessera.numpy, "lax": tessera.lax}
    owners = {"x": tessera.Array, "mesh": Mesh, "sharding": NamedSharding, "s": NamedSharding}
    rows = jax_table_rows()
    assert len(rows) >= 40 and all(len(r) == 3 for r in rows), [r for r in rows if len(r) != 3]
    checked = 0
    for jax_cell, _, py_cell in rows:
        if not py_cell.startswith("as JAX"):
            continue
        for code in re.findall(r"`([^`]*)`", jax_cell):
            m = re.search(r"\b(jax|jnp|lax)((?:\.\w+)+)", code)
            if m:
                obj = roots[m.group(1)]
                for part in m.group(2)[1:].split("."):
                    assert hasattr(obj, part), f"{m.group(0)} (in {code!r}) is not in tessera"
                    obj = getattr(obj, part)
                if callable(obj) and code[m.end():m.end() + 1] == "(":
                    params = inspect.signature(obj).parameters
                    varkw = any(p.kind == p.VAR_KEYWORD for p in params.values())
                    for kw in re.findall(r"[(,]\s*(\w+)=", code[m.end():]):
                        assert kw in params or varkw, f"{m.group(0)} takes no {kw}= ({code!r})"
                checked += 1
            for owner, attr in re.findall(r"(?<![\w.])(x|mesh|sharding|s)\.(\w+)", code):
                assert hasattr(owners[owner], attr), f"{owner}.{attr} (in {code!r})"
    assert checked >= 35
