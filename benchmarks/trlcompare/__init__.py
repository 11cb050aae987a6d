"""benchmarks/grpo_vs_trl.py in modules, one job each: ``common`` (the job, the shapes, a result, the
model), ``sides`` (rlctl and TRL in their workers), ``summary`` (the CPU table's figures and targets),
``device`` (--device). The script is the entry point."""
