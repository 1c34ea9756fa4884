"""``xhal-align``'s command line. It imports only click until the options are parsed, so
``xhal-align --help`` answers at once; the comparison itself (torch, transformers) is
``xhal.tools.align``."""

from __future__ import annotations

from typing import Any

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", help="Prompt text, tokenized with the checkpoint's tokenizer.")
@click.option("--token-ids", help="Comma-separated prompt token ids.")
@click.option("--num-tokens", default=24, show_default=True, help="Random prompt length otherwise.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random prompt.")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16.")
@click.option("--device", default="cpu", show_default=True, help="Torch device of both sides.")
@click.option(
    "--tol", type=float, default=None, help="max_rel that marks a divergence [per dtype]."
)
@click.option(
    "--override",
    multiple=True,
    metavar="KEY=VALUE",
    help="Change the xhal side's config only (dotted keys reach nested fields).",
)
def main(**options: Any) -> None:
    """Compare xhal with transformers on MODEL_DIR, layer by layer; exit 1 on a divergence."""
    # the options go to run() by name: its signature is their one typed list
    from xhal.tools.align import run

    run(**options)
