"""rlctl export RUN_DIR OUT_DIR [--step N]"""

from __future__ import annotations

import click


@click.command("export")
@click.argument("run_dir")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--step", "step", default="latest", show_default=True, help="latest, last-good, step-N or N.")
def export(run_dir: str, out_dir: str, step: str) -> None:
    """Write a snapshot's weights as a Hugging Face model directory (safetensors plus tokenizer),
    consolidated from any ZeRO stage. Prints OUT_DIR."""
    from rlctl.export import export_snapshot

    info = export_snapshot(run_dir, step, out_dir)
    click.echo(f"exported {info.name} of {run_dir}", err=True)
    click.echo(out_dir)
