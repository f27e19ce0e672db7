"""Exceptions for the C++ SDK's errors: each carries the absl::Status code's name as `.code`
and the C++ message. INVALID_ARGUMENT is a ValueError; every other code a RuntimeError
(TesseraError) subclass, UNIMPLEMENTED also a NotImplementedError (what JAX raises for what it
does not implement), so callers catch what they can act on:

    try:
        tessera.device_put(np.ones((10, 8)), NamedSharding(mesh, P("data")))
    except ValueError as e:          # tessera.errors.InvalidArgumentError
        print(e.code, e)             # INVALID_ARGUMENT device_put: dimension 0 of size 10 ...
"""


class TesseraError(RuntimeError):
    """A failed call of the SDK; `code` is the status code's name (UNAVAILABLE, ...)."""

    code = "UNKNOWN"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(ValueError):
    """INVALID_ARGUMENT: the input is wrong (a ValueError, as JAX raises for bad shapes)."""

    code = "INVALID_ARGUMENT"


class NotFoundError(TesseraError):
    code = "NOT_FOUND"


class FailedPreconditionError(TesseraError):
    code = "FAILED_PRECONDITION"


class UnavailableError(TesseraError):
    code = "UNAVAILABLE"


class DeadlineExceededError(TesseraError):
    code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(TesseraError):
    code = "RESOURCE_EXHAUSTED"


class AbortedError(TesseraError):
    code = "ABORTED"


class PermissionDeniedError(TesseraError):
    code = "PERMISSION_DENIED"


class UnauthenticatedError(TesseraError):
    code = "UNAUTHENTICATED"


class UnimplementedError(TesseraError, NotImplementedError):
    """UNIMPLEMENTED: what JAX raises NotImplementedError for (vmap of pcast(..., to='reduced'))."""

    code = "UNIMPLEMENTED"


_BY_CODE = {c.code: c for c in (NotFoundError, FailedPreconditionError, UnavailableError, DeadlineExceededError,
                                ResourceExhaustedError, AbortedError, PermissionDeniedError, UnauthenticatedError,
                                UnimplementedError)}


def from_status(code, message):
    """The exception for a status code's name and message (called by the extension)."""
    if code == "INVALID_ARGUMENT":
        return InvalidArgumentError(message)
    cls = _BY_CODE.get(code)
    return cls(message) if cls else TesseraError(message, code)


class JAXIndexError(IndexError):
    """jax.errors.JAXIndexError (jax/_src/errors.py): its message ends with the page that
    explains it, as _JAXErrorMixin writes it."""

    def __init__(self, message):
        super().__init__(f"{message}\nSee https://docs.jax.dev/en/latest/errors.html#jax.errors."
                         f"{type(self).__name__}")


class NonConcreteBooleanIndexError(JAXIndexError):
    """A traced boolean array used as an index (x[x > 0] in jit): the result's shape would
    depend on its values; jnp.where(mask, x, 0) keeps the shape. `aval` is the index's type."""

    def __init__(self, aval):
        super().__init__(f"Array boolean indices must be concrete; got {aval}\n")
