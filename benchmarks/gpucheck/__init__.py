"""The parts of benchmarks/gpu_check.py: the report (report), the rlctl runs it watches (runs, plan), and
the checks (env, build, decode, training). gpu_check.py puts them in order under one budget."""
