"""How the suite chooses numeric tolerances; tests/README.md says why.

A float32 result is exact to about one ulp of the largest magnitude that went into it, and XLA
is free to reorder a reduction (a CPU with wider vectors, another fusion, another device count),
so an absolute tolerance is stated in ulps of the compared values' scale, never as a bare number
that may sit below one ulp.
"""

import ml_dtypes
import numpy as np

_assert_allclose = np.testing.assert_allclose
F32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7: one ulp of a float32 in [1, 2)


def ulp(x) -> float:
    """One float32 ulp at the largest magnitude in `x`."""
    return float(np.spacing(np.float32(np.max(np.abs(np.asarray(x, np.float32))))))


def assert_close(actual, desired, *, rtol: float, ulps: float = 8, scale=None, err_msg=""):
    """`np.testing.assert_allclose` whose absolute tolerance is `ulps` float32 ulps at `scale`
    (default: the largest |desired|), so elements that come out near zero from cancelling terms
    of that magnitude are held to what float32 can deliver, not to a fixed 1e-7."""
    desired = np.asarray(desired)
    atol = ulps * ulp(desired if scale is None else scale)
    checked_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=err_msg)


def _precision(*arrays) -> np.dtype | None:
    """The least precise floating dtype among the compared arrays (None: no float32 or less)."""
    dtypes = [np.asarray(a).dtype for a in arrays]
    floats = [d for d in dtypes if np.issubdtype(d, np.floating) or d == ml_dtypes.bfloat16]
    low = [d for d in floats if ml_dtypes.finfo(d).bits <= 32]
    return min(low, key=lambda d: ml_dtypes.finfo(d).bits) if low else None


def checked_allclose(actual, desired, rtol=1e-7, atol=0, equal_nan=True, err_msg="", **kw):
    """`np.testing.assert_allclose` that first refuses a tolerance float32 cannot meet: an
    absolute tolerance below one ulp of the compared values, or a relative one below machine
    epsilon with no absolute slack. conftest.py installs it for the whole suite; bitwise
    comparisons say so with `assert_array_equal`."""
    dtype = _precision(actual, desired)
    if dtype is not None:
        info = ml_dtypes.finfo(dtype)
        eps = float(info.eps)
        scale = float(np.max(np.abs(np.asarray(desired, np.float64)), initial=0.0))
        one_ulp = eps * 2.0 ** np.floor(np.log2(scale)) if scale > 0 else 0.0
        if 0 < atol < one_ulp:
            raise AssertionError(
                f"atol={atol:g} is below one {dtype} ulp ({one_ulp:g}) of the compared values "
                f"(max |desired| {scale:g}): state it in ulps (tests/tolerance.py)"
            )
        if atol == 0 and 0 < rtol < eps:
            raise AssertionError(
                f"rtol={rtol:g} is below {dtype} epsilon ({eps:g}) with atol=0: use "
                "assert_array_equal for a comparison that is exact by construction, or a "
                "tolerance in ulps"
            )
    _assert_allclose(
        actual, desired, rtol=rtol, atol=atol, equal_nan=equal_nan, err_msg=err_msg, **kw
    )
