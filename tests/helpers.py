"""The one numerics comparison helper used across tests."""

from __future__ import annotations

import numpy as np


def assert_close(actual, expected, *, atol: float, rtol_rms: float, name: str = "") -> None:
    """max |a - e| <= atol and ||a - e|| / ||e|| <= rtol_rms (both reported on failure)."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    assert np.all(np.isfinite(a)), f"{name}: non-finite values"
    err = np.abs(a - e)
    max_abs = float(err.max()) if err.size else 0.0
    denom = float(np.linalg.norm(e)) or 1.0
    rel = float(np.linalg.norm(a - e)) / denom
    assert max_abs <= atol and rel <= rtol_rms, (
        f"{name}: max_abs={max_abs:.3e} (atol {atol:.1e}), rel_rms={rel:.3e} (tol {rtol_rms:.1e})"
    )
