# python/tools/tutorial_cells.py on a small notebook written here (not JAX's text): imports
# rewritten, %timeit run once, the last expression shown, a failing cell and one that needs it.
import os
import subprocess
import sys

from conftest import SOURCE_DIR

NOTEBOOK = '''# A notebook

```{code-cell} ipython3
:id: a1

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
```

```{code-cell}
---
colab:
  height: 10
---
mesh = jax.make_mesh((2,), ('x',))
x = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P('x')))
%timeit -n 5 -r 5 (x * 2).block_until_ready()
x.sharding.spec
```

```{code-cell}
y = jnp.no_such_function(x)
```

```{code-cell}
print(y)
```
'''


def test_tool_rewrites_imports_runs_cells_and_reports(tmp_path):
    nb = tmp_path / "nb.md"
    nb.write_text(NOTEBOOK)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, os.path.join(SOURCE_DIR, "python", "tools", "tutorial_cells.py"), str(nb),
                          "--devices", "2", "--show", "--timeout", "60"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "import tessera as jax" in text and "import tessera.numpy as jnp" in text
    assert "from tessera.sharding import PartitionSpec as P" in text
    assert "P('x',)" in text  # the last expression's repr
    assert "| 1 | runs |  |" in text
    assert "| 2 | runs | IPython %timeit run once |" in text
    assert "| 3 | fails | AttributeError: module 'tessera.numpy' has no attribute 'no_such_function' |" in text
    assert "| 4 | fails (needs cell 3) | NameError: name 'y' is not defined |" in text
    assert "2 of 4 cells run" in text
