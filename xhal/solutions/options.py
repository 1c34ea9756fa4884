"""``OP=SOLUTION`` choices given on a command line (``xhal-serve --kernel``), checked and turned
into the ``XHAL_KERNEL_<OP>`` settings every process of a server reads."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

from xhal.solutions.op_names import OPS, env_name


def kernel_settings(values: Iterable[str]) -> dict[str, str]:
    """``["rms_norm=torch", ...]`` -> ``{"XHAL_KERNEL_RMS_NORM": "torch", ...}``. Raises
    ``ValueError`` naming what is wrong: not ``OP=SOLUTION``, an unknown op, or a solution no
    device has for that op (the list of those there are)."""
    from xhal.solutions import registry

    out: dict[str, str] = {}
    for value in values:
        op, sep, name = (part.strip() for part in value.partition("="))
        if not sep or not op or not name:
            raise ValueError(f"--kernel {value!r}: give OP=SOLUTION, e.g. rms_norm=torch")
        if op not in OPS:
            raise ValueError(f"--kernel {value!r}: unknown op {op!r}; ops: {', '.join(OPS)}")
        known = sorted({s.name for s in registry.solutions(op)})
        if name not in known:
            raise ValueError(
                f"--kernel {value!r}: {op} has no solution {name!r}; known: {', '.join(known)}"
            )
        out[env_name(op)] = name
    return out


def apply_kernel_options(
    values: Iterable[str], environ: MutableMapping[str, str]
) -> dict[str, str]:
    """Check ``values`` and set them in ``environ`` (child processes inherit them)."""
    settings = kernel_settings(values)
    environ.update(settings)
    return settings
