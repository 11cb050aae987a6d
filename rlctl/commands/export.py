"""rlctl export RUN_DIR OUT_DIR [--step latest|last-good|best|step-N|N] [--adapter-only]"""

from __future__ import annotations

import click

from rlctl.commands.options import SNAPSHOT, step_spec, timeout_option


@click.command("export")
@click.argument("run_dir")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--step",
    "step",
    callback=step_spec,
    default="latest",
    show_default=True,
    metavar=SNAPSHOT,
    help="latest, last-good, best, step-N or N. best: the good snapshot with the best validation metric "
    "(checkpoint.keep_best's, else the highest val/score/mean).",
)
@click.option(
    "--adapter-only",
    is_flag=True,
    help="LoRA runs: write the PEFT adapter directory (PeftModel.from_pretrained) instead of the merged model.",
)
@timeout_option
def export(run_dir: str, out_dir: str, step: str, adapter_only: bool, timeout: float) -> None:
    """Write a snapshot's weights as a Hugging Face model directory (safetensors plus tokenizer),
    consolidated from any ZeRO stage; a LoRA run's adapter merged into its base, or alone with
    --adapter-only. Prints OUT_DIR."""
    from rlctl.export import export_snapshot

    info = export_snapshot(
        run_dir,
        step,
        out_dir,
        note=lambda line: click.echo(line, err=True),
        adapter_only=adapter_only,
        timeout=timeout,
    )
    click.echo(f"exported {info.name} of {run_dir}", err=True)
    click.echo(out_dir)
