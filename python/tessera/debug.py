"""tessera.debug: jax.debug.visualize_array_sharding / visualize_sharding (the SDK's text
picture of a layout: one tile per block, labelled with its devices)."""
from . import _tessera as _t
from .sharding import _as_named


def visualize_sharding(shape, sharding):
    print(_t.visualize_sharding(list(shape), _as_named(sharding, "visualize_sharding")._cpp), end="")


def visualize_array_sharding(arr):
    visualize_sharding(arr.shape, arr.sharding)
