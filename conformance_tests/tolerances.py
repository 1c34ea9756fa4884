"""The documented tolerance table: the worst error a conformant backend may show, per family and
dtype, against the suite's float64 references.

Errors are absolute on outputs whose magnitude is O(1) (the suite draws inputs so that they are).
bfloat16 carries 8 bits of mantissa (relative step 2^-8 = 3.9e-3): one rounding of an O(1) output
costs up to ~4e-3, and attention rounds its inputs (q, cached K/V) and its output, hence 2e-2.

| family    | float32 | bfloat16 | float16 |
|-----------|---------|----------|---------|
| attention | 1e-4    | 2e-2     | 4e-3    |
| ops       | 1e-5    | 1 ulp*   | 1 ulp*  |
| graph     | 0 (replay must equal eager exactly on the same backend)      |
| collective| 0 (sums of small integers are exact in every dtype)          |

(*) ops in bfloat16 / float16 are compared with the float64 reference rounded once to the dtype,
in units in the last place of that rounded value (magnitudes below 2^-6 measured at 2^-6, where
float32 accumulation error is absolute): computing in float32 and rounding the result once lands
on it or on a neighbour, while a kernel that skips the float32 upcast (RMSNorm's sum of squares
in bfloat16) rounds several times and lands 2 ulp away. ``ops_reference.max_ulps`` measures it;
the float entries below are used for float32 and for reporting.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[str, dict[torch.dtype, float]] = {
    "attention": {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3},
    "ops": {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3},
}


def tolerance(family: str, dtype: torch.dtype) -> float:
    return TOLERANCES[family][dtype]
