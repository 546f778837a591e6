"""How the suite chooses numeric tolerances; tests/README.md says why.

A float32 result is exact to about one ulp of the largest magnitude that went into it, and XLA
is free to reorder a reduction (a CPU with wider vectors, another fusion, another device count),
so an absolute tolerance is stated in ulps of the compared values' scale, never as a bare number
that may sit below one ulp.
"""

import numpy as np

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
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=err_msg)
