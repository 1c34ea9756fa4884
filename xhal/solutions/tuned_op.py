"""An implementation with a config space, autotuned per shape bucket on first sight."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from xhal import env
from xhal.solutions.solution import Solution
from xhal.solutions.timing import Timer
from xhal.solutions.tuning_cache import TuningCache

logger = logging.getLogger("xhal.solutions")


class TunedOp:
    """Calls ``impl(*args, **config.params)`` with the config chosen for the call's bucket.

    A bucket's config comes, in order, from memory, the disk cache, or timing every config on the
    call's own inputs (ops are out of place, so extra calls are harmless) and keeping the fastest.
    Inside a graph capture nothing is timed: an unknown bucket takes the first config, not
    remembered, so a later eager call still tunes it. ``XHAL_AUTOTUNE=0`` turns timing off (the
    first config, or the cached winner). Per call: one bucket function and one dict lookup."""

    def __init__(
        self,
        solution: Solution,
        impl: Callable,
        bucket: Callable[..., str],
        cache: TuningCache,
        timer: Timer,
        is_capturing: Callable[[], bool],
    ) -> None:
        assert solution.configs, "TunedOp wraps a solution with configs"
        self.solution, self._impl, self._bucket = solution, impl, bucket
        self._cache, self._timer, self._is_capturing = cache, timer, is_capturing
        self._configs = {c.name: c.params for c in solution.configs}
        self.chosen: dict[str, str] = {}  # bucket -> config name
        self.tuned: set[str] = set()  # buckets timed by this process (the rest came from disk)
        self._params: dict[str, Mapping[str, object]] = {}

    def __call__(self, *args):
        bucket = self._bucket(*args)
        params = self._params.get(bucket)
        if params is None:
            params = self._resolve(bucket, args)
        return self._impl(*args, **params)

    def _resolve(self, bucket: str, args: tuple) -> Mapping[str, object]:
        key = self.solution.key
        name = self._cache.get(key, bucket)
        if name not in self._configs:  # unknown, or a config this version no longer has
            first = self.solution.configs[0].name
            if self._is_capturing():
                logger.debug(
                    "%s: bucket %s first seen inside a graph capture: config %s, untuned",
                    key,
                    bucket,
                    first,
                )
                return self._configs[first]
            name = self.tune(bucket, args) if env.autotune() else first
        self.chosen[bucket] = name
        self._params[bucket] = self._configs[name]
        return self._configs[name]

    def tune(self, bucket: str, args: tuple) -> str:
        """Time every config on ``args``, store the winner on disk, return its name."""
        times: dict[str, float] = {}
        for config in self.solution.configs:
            try:
                times[config.name] = self._timer.measure(
                    lambda p=config.params: self._impl(*args, **p)
                )
            except Exception as e:  # noqa: BLE001  (a config the device cannot run is not a winner)
                logger.info(
                    "%s: config %s failed on bucket %s: %s",
                    self.solution.key,
                    config.name,
                    bucket,
                    e,
                )
        if not times:
            raise RuntimeError(
                f"{self.solution.key}: every config failed on bucket {bucket}; see the log above"
            )
        name = min(times, key=times.__getitem__)
        try:
            self._cache.put(self.solution.key, bucket, name)
        except OSError as e:  # a read-only cache directory costs a retune next start, not a step
            logger.warning(
                "%s: cannot write the tuning cache %s (%s); set XHAL_CACHE_DIR to a writable "
                "directory",
                self.solution.key,
                self._cache.path,
                e,
            )
        self.tuned.add(bucket)
        logger.info(
            "%s: tuned bucket %s -> %s (%s)",
            self.solution.key,
            bucket,
            name,
            ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in times.items()),
        )
        return name
