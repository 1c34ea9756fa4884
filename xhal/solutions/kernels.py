"""A platform's kernels: one solution chosen per op, once, and the objects built from them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from xhal import env
from xhal.interfaces.ops import DeviceOps
from xhal.solutions import registry
from xhal.solutions.op_names import ATTENTION_OPS, DEVICE_OPS, OPS, env_name
from xhal.solutions.row_limit import RowLimited
from xhal.solutions.selection import SolutionUnavailable, select, unmet
from xhal.solutions.solution import DeviceInfo, Solution, load_target
from xhal.solutions.solved_ops import REQUIRED, SolvedOps
from xhal.solutions.timing import Timer
from xhal.solutions.tuned_op import TunedOp
from xhal.solutions.tuning_cache import TuningCache

if TYPE_CHECKING:
    import torch

    from xhal.interfaces.attention import AttentionBackend, AttentionSpec
    from xhal.interfaces.platform import Platform

logger = logging.getLogger("xhal.solutions")


class Kernels:
    """Chooses every device op's solution at construction (logged in one line) and each
    attention spec's decode and prefill solutions when first asked (logged once per choice).

    ``defaults`` are the platform's own forced choices (``cuda-triton``: Triton attention);
    ``XHAL_KERNEL_<OP>`` settings override them. A setting naming a solution this device type
    does not have, but another does, is left to the platforms it fits (a CUDA server also
    creates the CPU platform); a name no device has raises."""

    def __init__(
        self,
        platform: Platform,
        device: DeviceInfo,
        *,
        defaults: Mapping[str, str] | None = None,
        is_capturing: Callable[[], bool] = lambda: False,
        timer: Timer | None = None,
        tuning_cache: TuningCache | None = None,
    ) -> None:
        self.platform, self.device = platform, device
        self._is_capturing = is_capturing
        self._timer = timer or Timer(platform.synchronize)
        self.tuning_cache = tuning_cache or TuningCache(device)
        self._overrides = self._applicable({**(defaults or {}), **forced_by_environment()})
        self._providers: dict[str, object] = {}
        self._attention_logged: set[tuple] = set()
        self.chosen: dict[str, Solution] = {
            op: select(op, device, forced=self._overrides.get(op))
            for op in DEVICE_OPS
            if op in REQUIRED or self.solutions(op)  # a newer op without solutions: its default
        }
        self.ops = self._solved_ops(self.chosen)
        logger.info(
            "kernels of %s (%s): %s", platform.name, device.name or device.device_type,
            ", ".join(s.key for s in self.chosen.values()),
        )

    def _applicable(self, overrides: Mapping[str, str]) -> dict[str, str]:
        out = {}
        for op, name in overrides.items():
            if any(s.name == name for s in registry.solutions(op, self.device.device_type)):
                out[op] = name
            elif not any(s.name == name for s in registry.solutions(op)):
                known = sorted({s.name for s in registry.solutions(op)})
                raise ValueError(
                    f"{op}={name}: {op} has no solution {name!r}; known: {', '.join(known)}"
                )
        return out

    # device ops ---------------------------------------------------------------------------------

    def solutions(self, op: str) -> list[Solution]:
        """Every solution of ``op`` registered for this device type, best first."""
        return registry.solutions(op, self.device.device_type)

    def unmet(self, solution: Solution, dtype: torch.dtype | None = None) -> str | None:
        return unmet(solution, self.device, dtype=dtype)

    def implementation(self, solution: Solution) -> Callable:
        """The solution's callable (its provider built once per target), autotuned when it has
        configs. Raises ``SolutionUnavailable`` for a solution this machine cannot run."""
        select(solution.op, self.device, forced=solution.name)  # its requirement, checked
        if solution.target not in self._providers:
            self._providers[solution.target] = load_target(solution.target)(self.platform)
        impl = getattr(self._providers[solution.target], OPS[solution.op])
        if solution.configs:
            bucket = load_target(solution.bucket)  # type: ignore[arg-type]
            impl = TunedOp(
                solution, impl, bucket, self.tuning_cache, self._timer, self._is_capturing
            )
        limit = solution.requires.max_rows
        if limit is not None:  # larger calls: the best solution that takes more rows
            larger = [
                s
                for s in self.solutions(solution.op)
                if (s.requires.max_rows is None or s.requires.max_rows > limit)
                and self.unmet(s) is None
            ]
            if not larger:
                raise SolutionUnavailable(
                    f"{solution.key} takes at most {limit} rows and no solution of {solution.op} "
                    "that takes more can run here"
                )
            impl = RowLimited(impl, self.implementation(larger[0]), limit)
        return impl

    def _solved_ops(self, chosen: Mapping[str, Solution]) -> SolvedOps:
        """The chosen implementations; a fused op whose chosen provider only inherits
        ``DeviceOps``' default (the plain sequence) is left out, so the ``SolvedOps`` runs that
        sequence on its own chosen ops rather than on the provider's (the reference's fused op
        would otherwise run the reference's plain ops on a platform that chose faster ones)."""
        impls = {}
        for op, solution in chosen.items():
            impl = self.implementation(solution)
            if op not in REQUIRED and inherits_default(impl, OPS[op]):
                continue
            impls[op] = impl
        return SolvedOps(impls, {op: s.name for op, s in chosen.items()})

    def ops_with(self, op: str, name: str) -> SolvedOps:
        """The chosen ops with ``op`` served by solution ``name`` (the conformance suite runs
        every solution this way)."""
        solution = select(op, self.device, forced=name)
        return self._solved_ops({**self.chosen, op: solution})

    # attention ----------------------------------------------------------------------------------

    def attention_solution(self, op: str, spec: AttentionSpec) -> Solution:
        assert op in ATTENTION_OPS, op
        return select(
            op,
            self.device,
            forced=self._overrides.get(op),
            dtype=spec.dtype,
            head_dim=spec.head_dim,
        )

    def attention_backend(self, spec: AttentionSpec) -> AttentionBackend:
        """The decode solution's backend for pure-decode steps, the prefill solution's for the
        rest: one backend when both are the same solution, a ``SplitAttention`` otherwise."""
        decode, prefill = (self.attention_solution(op, spec) for op in ATTENTION_OPS)
        for solution in (decode, prefill):
            seen = (solution.key, spec.dtype, spec.head_dim)
            if seen not in self._attention_logged:
                self._attention_logged.add(seen)
                logger.info(
                    "kernels of %s: %s for %s head dim %d",
                    self.platform.name,
                    solution.key,
                    str(spec.dtype).removeprefix("torch."),
                    spec.head_dim,
                )
        make_decode = self.implementation(decode)
        if decode.target == prefill.target:
            return make_decode(spec)
        from xhal.solutions.split_attention import SplitAttention

        return SplitAttention(spec, make_decode(spec), self.implementation(prefill)(spec))

    @contextlib.contextmanager
    def forcing(self, op: str, name: str) -> Iterator[None]:
        """Inside the block, ``op`` takes solution ``name`` (attention backends made then)."""
        if op not in OPS:
            raise KeyError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
        previous = self._overrides.get(op)
        self._overrides[op] = name
        try:
            yield
        finally:
            if previous is None:
                del self._overrides[op]
            else:
                self._overrides[op] = previous


def inherits_default(impl: Callable, attribute: str) -> bool:
    """Whether ``impl`` is a provider's method that is ``DeviceOps``' own default, not
    overridden anywhere in the provider's class (a ``TunedOp`` or ``RowLimited`` wrapper never
    is: those solutions have kernels of their own)."""
    provider = getattr(impl, "__self__", None)
    default = getattr(DeviceOps, attribute, None)
    return (
        provider is not None
        and default is not None
        and getattr(type(provider), attribute, None) is default
    )


def forced_by_environment() -> dict[str, str]:
    """op -> solution from the ``XHAL_KERNEL_<OP>`` settings; a setting that names no op raises,
    listing the settings there are."""
    by_env = {env_name(op): op for op in OPS}
    forced = {}
    for key, value in env.kernel_overrides().items():
        if key not in by_env:
            raise ValueError(f"{key}: no such op; settings: {', '.join(sorted(by_env))}")
        forced[by_env[key]] = value
    return forced
