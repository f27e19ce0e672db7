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
