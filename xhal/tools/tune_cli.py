"""``xhal-tune MODEL --device NAME``: warm the autotuning cache for a model's shapes before
serving, so the server's first steps time nothing."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path

import click

_DTYPES = ("bfloat16", "float16", "float32")


def _config(model: str, load_format: str) -> dict:
    path = Path(model)
    config_file = path if path.name == "config.json" else path / "config.json"
    if not config_file.is_file():
        raise click.BadParameter(
            f"{model}: no config.json there (give a checkpoint directory)", param_hint="MODEL"
        )
    if load_format == "auto" and not any(config_file.parent.glob("*.safetensors")):
        raise click.BadParameter(
            f"{config_file.parent} holds no *.safetensors: pass --load-format dummy to tune for "
            f"its "
            "config.json's shapes alone",
            param_hint="MODEL",
        )
    return json.loads(config_file.read_text())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option(
    "--device",
    default="cuda",
    show_default=True,
    help="Platform name (cpu, cuda, npu or a plugin's).",
)
@click.option(
    "--load-format",
    type=click.Choice(["auto", "dummy"]),
    default="auto",
    show_default=True,
    help="auto: MODEL is a checkpoint; dummy: only its config.json is needed. Weights are never "
         "read.",
)
@click.option(
    "--dtype",
    type=click.Choice(_DTYPES),
    default=None,
    help="Activation dtype. [default: the config's torch_dtype, else bfloat16]",
)
@click.option(
    "--max-batch",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="The --max-num-seqs you serve with: every decode-graph bucket up to it is tuned (1, 2, "
         "4, 8, then steps of 16, as the executor captures them).",
)
@click.option(
    "--tensor-parallel-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tune the per-rank shapes of this many ranks.",
)
@click.option(
    "--plugin",
    "plugins",
    multiple=True,
    help="Import this module first (platforms, solutions); repeatable.",
)
def main(
    model: str,
    device: str,
    load_format: str,
    dtype: str | None,
    max_batch: int,
    tensor_parallel_size: int,
    plugins: tuple[str, ...],
) -> None:
    """Time the config space of every chosen solution that has one, and run the calls of every
    chosen solution that times its own choices, for MODEL's shapes; the winners are kept in
    $XHAL_CACHE_DIR/tuning (per device, library versions and shape bucket)."""
    if plugins:
        os.environ["XHAL_PLUGINS"] = ",".join(
            [*filter(None, os.environ.get("XHAL_PLUGINS", "").split(",")), *plugins]
        )
    config = _config(model, load_format)
    import torch

    import xhal
    from xhal.executor import ExecutorConfig
    from xhal.solutions.op_names import OPS
    from xhal.solutions.tuned_op import TunedOp
    from xhal.solutions.workloads import model_workloads

    if device not in xhal.platforms.names():
        raise click.BadParameter(
            f"unknown device {device!r}; known: {', '.join(xhal.platforms.names())}",
            param_hint="--device",
        )
    platform = xhal.platforms.get(device)
    kernels = platform.kernels
    if kernels is None:
        raise click.ClickException(
            f"platform {device!r} builds no ops from solutions: nothing to tune"
        )
    tunable = {op: impl for op, impl in kernels.ops.impls.items() if isinstance(impl, TunedOp)}
    self_timed = {op for op, s in kernels.chosen.items() if s.times_itself and op not in tunable}
    chosen = ", ".join(f"{op}={name}" for op, name in kernels.ops.names.items())
    if not tunable and not self_timed:
        click.echo(f"no chosen solution on {device} has a config space: nothing to tune ({chosen})")
        return
    torch_dtype = getattr(
        torch, dtype or str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    )
    workloads = [
        w
        for w in model_workloads(
            config,
            platform.device(),
            torch_dtype,
            ExecutorConfig(max_num_seqs=max_batch).decode_capture_sizes,
            tensor_parallel_size,
        )
        if w.op in tunable or w.op in self_timed
    ]
    before = kernels.tuning_cache.entries()
    with click.progressbar(
        workloads,
        label=f"tuning {len(workloads)} calls on {device}",
        item_show_func=lambda w: w.label if w else "",
    ) as bar:
        for w in bar:
            getattr(kernels.ops, OPS[w.op])(*w.make())
            platform.synchronize()
    winners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for op, impl in tunable.items():
        click.echo(
            f"{impl.solution.key}: {len(impl.tuned)} buckets tuned, "
            f"{len(impl.chosen) - len(impl.tuned)} from the cache"
        )
        for name in impl.chosen.values():
            winners[op][name] += 1
        click.echo("  winners: " + ", ".join(f"{n} x{c}" for n, c in sorted(winners[op].items())))
    calls = Counter(w.op for w in workloads if w.op in self_timed)
    after = kernels.tuning_cache.entries()
    # what the self-timed choices left, this run's and earlier ones: their keys start with the
    # solution's own ("linear=triton/...")
    prefixes = tuple(f"{kernels.chosen[op].key}/" for op in self_timed)
    own = {key for key in after if prefixes and key.startswith(prefixes)}
    for op in sorted(self_timed):
        click.echo(f"{kernels.chosen[op].key}: {calls[op]} calls run (it times its own choices)")
    for key in sorted(own):
        new = len(after[key]) - len(before.get(key, {}))
        counts = Counter(after[key].values())
        click.echo(
            f"  {key}: {new} buckets new, {len(after[key])} in the cache; winners: "
            + ", ".join(f"{n} x{c}" for n, c in sorted(counts.items()))
        )
    click.echo(f"cache: {kernels.tuning_cache.path}")


if __name__ == "__main__":
    main()
