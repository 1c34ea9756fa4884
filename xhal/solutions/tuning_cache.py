"""Autotuning winners on disk: one JSON file per device name and set of library versions under
``$XHAL_CACHE_DIR/tuning``, mapping solution -> shape bucket -> config name."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from xhal import env
from xhal.solutions.solution import DeviceInfo


def cache_path(device: DeviceInfo, root: str | os.PathLike | None = None) -> Path:
    """Where this device's winners live: a new device or any library upgrade starts afresh."""
    versions = json.dumps(sorted(device.library_versions))
    digest = hashlib.sha256(f"{device.device_type}|{device.name}|{versions}".encode()).hexdigest()[
        :12
    ]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{device.device_type}-{device.name}").strip("-")
    return Path(root or env.cache_dir()) / "tuning" / f"{slug}-{digest}.json"


class TuningCache:
    """Read once, written through on every new winner (a temporary file renamed into place, so
    a concurrent reader never sees half a file)."""

    def __init__(self, device: DeviceInfo, root: str | os.PathLike | None = None) -> None:
        self.device = device
        self.path = cache_path(device, root)
        self._winners: dict[str, dict[str, str]] | None = None

    def _load(self) -> dict[str, dict[str, str]]:
        if self._winners is None:
            try:
                self._winners = json.loads(self.path.read_text())["winners"]
            except OSError:  # none yet, or unreadable: tune (and try to write it) again
                self._winners = {}
            except (ValueError, KeyError, TypeError):  # a damaged file: tune again, rewrite it
                self._winners = {}
        return self._winners

    def get(self, solution_key: str, bucket: str) -> str | None:
        return self._load().get(solution_key, {}).get(bucket)

    def put(self, solution_key: str, bucket: str, config_name: str) -> None:
        winners = self._load()
        winners.setdefault(solution_key, {})[bucket] = config_name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "device": self.device.name,
            "device_type": self.device.device_type,
            "library_versions": dict(self.device.library_versions),
            "winners": winners,
        }
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
