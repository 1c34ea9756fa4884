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
    """Read once, written through on every new winner: the file is read again and merged before
    each write (several caches of one process, or several processes, may keep winners in the same
    file; each writes only its own entry over what the file holds), and replaced by a temporary
    file renamed into place, so a concurrent reader never sees half a file."""

    def __init__(self, device: DeviceInfo, root: str | os.PathLike | None = None) -> None:
        self.device = device
        self.path = cache_path(device, root)
        self._winners: dict[str, dict[str, str]] | None = None

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            winners = json.loads(self.path.read_text())["winners"]
        except OSError:  # none yet, or unreadable: tune (and try to write it) again
            return {}
        except (ValueError, KeyError, TypeError):  # a damaged file: tune again, rewrite it
            return {}
        return winners if isinstance(winners, dict) else {}

    def _load(self) -> dict[str, dict[str, str]]:
        if self._winners is None:
            self._winners = self._read()
        return self._winners

    def get(self, solution_key: str, bucket: str) -> str | None:
        return self._load().get(solution_key, {}).get(bucket)

    def entries(self) -> dict[str, dict[str, str]]:
        """Every winner the file holds now, solution -> bucket -> config name."""
        return self._read()

    def put(self, solution_key: str, bucket: str, config_name: str) -> None:
        winners = self._read()
        for key, buckets in self._load().items():  # what this cache learnt and the file lost
            for name, config in buckets.items():
                winners.setdefault(key, {}).setdefault(name, config)
        winners.setdefault(solution_key, {})[bucket] = config_name
        self._winners = winners
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
