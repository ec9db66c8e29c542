"""A transform for the CLI tests to import as ``tests.cli_helpers:double``."""

from __future__ import annotations

import numpy as np

from fastload import versioned


@versioned(1)
def double(x: np.ndarray) -> np.ndarray:
    return x * 2
