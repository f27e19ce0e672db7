#!/usr/bin/env python3
"""Prints the picture JAX draws for a sharding, for tests/client/visualize_test.cc's derived cases.

Runs visualize_sharding from JAX's own jax/_src/debugging.py (its text, not a copy) with rich
(Debian's python3-rich) and no colour, on a stand-in for NamedSharding that lays a mesh's device
ids row-major and splits dimensions as PartitionSpec does. Not run by the tests: it is how their
"derived from jax/_src/debugging.py" pictures were made, so they can be made again.

  python3 tests/client/visualize_reference.py DEBUGGING_PY '(16, 8)' '(4, 2)' "('x', 'y')" "('x', None)" [ids]
"""
import ast
import importlib
import importlib.util
import io
import sys
from typing import Callable, Sequence, Union

import numpy as np
import rich.console


class _Device:
  def __init__(self, i):
    self.id = i
    self.platform = 'cpu'


class _Sharding:
  def __init__(self, mesh_shape, axis_names, spec, device_ids):
    self.mesh_shape, self.axis_names, self.spec, self.ids = mesh_shape, axis_names, spec, device_ids

  @property
  def device_set(self):
    return {_Device(i) for i in self.ids}

  def devices_indices_map(self, shape):
    out = {}
    for pos, device in enumerate(self.ids):
      coords = np.unravel_index(pos, self.mesh_shape)
      index = []
      for d in range(len(shape)):
        axes = self.spec[d] if d < len(self.spec) else None
        if axes is None:
          index.append(slice(None))
          continue
        axes = (axes,) if isinstance(axes, str) else axes
        blocks, block = 1, 0
        for a in axes:
          i = self.axis_names.index(a)
          block = block * self.mesh_shape[i] + coords[i]
          blocks *= self.mesh_shape[i]
        size = shape[d] // blocks
        index.append(slice(block * size, (block + 1) * size))
      out[_Device(device)] = tuple(index)
    return out


def main():
  source = open(sys.argv[1]).read()
  code = source[source.index('def _slice_to_chunk_idx'):source.index('def inspect_array_sharding')]
  scope = {'np': np, 'Sequence': Sequence, 'Union': Union, 'Callable': Callable, 'importlib': importlib,
           'Sharding': object}
  exec(code, scope)
  shape, mesh_shape, names, spec = (ast.literal_eval(a) for a in sys.argv[2:6])
  n = int(np.prod(mesh_shape))
  ids = ast.literal_eval(sys.argv[6]) if len(sys.argv) > 6 else list(range(n))
  buf = io.StringIO()
  plain = rich.console.Console

  class Console(plain):  # what JAX prints when its output is not a colour terminal
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **{**kwargs, 'file': buf, 'color_system': None})

  rich.console.Console = Console
  scope['visualize_sharding'](shape, _Sharding(mesh_shape, list(names), spec, ids))
  sys.stdout.write(buf.getvalue())


if __name__ == '__main__':
  main()
