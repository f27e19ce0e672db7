"""jax.checkpoint_policies (jax/_src/ad_checkpoint.py), by the same names: what
`tessera.checkpoint(fun, policy=...)` keeps for grad's backward pass instead of computing it
again. A policy is called as JAX calls one, `policy(prim, *args, **params)`, once for each value
fun computes: `prim` names the op that computes it (`str(prim)` and `prim.name` are JAX's
primitive name, "dot_general", "tanh", ...), and a dot_general's params hold its
`dimension_numbers`, ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)). No avals
are passed as args. True keeps the value."""


class Primitive:
    """The op a policy is asked about (a stand-in for a JAX Primitive: name and str)."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return self.name

    __repr__ = __str__


def everything_saveable(*_, **__):
    """As if checkpoint were not used at all."""
    return True


def nothing_saveable(*_, **__):
    """checkpoint's default: everything is computed again."""
    return False


def dots_saveable(prim, *_, **__):
    """Keep the results of dot_generals (matrix products)."""
    return str(prim) == "dot_general"


def dots_with_no_batch_dims_saveable(prim, *_, **params):
    """Keep the results of dot_generals without batch dimensions (a transformer's projections,
    not its attention scores)."""
    if str(prim) != "dot_general":
        return False
    (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
    return not lhs_batch and not rhs_batch


checkpoint_dots = dots_saveable
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable
