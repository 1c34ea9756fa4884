"""Which xhal platform a server's ``--device`` runs on."""

from __future__ import annotations

from xhal import env


def serving_platform(device: str) -> str:
    """``device`` itself, except ``cpu``: the server runs on ``cpu-fast`` there (the reference
    ``cpu`` platform is the conformance oracle, not built for speed; ``XHAL_SERVE_CPU_PLATFORM=cpu``
    serves on it anyway). Every rank resolves the name the same way."""
    return env.serve_cpu_platform() if device == "cpu" else device
