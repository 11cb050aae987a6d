"""benchmarks/fault_campaign.py in modules: ``processes`` (the stores the runs write to and one rlctl
process under watch), ``trials`` (the workload, its uninterrupted reference, the plan and one trial:
signal, resume, judge). The script is the entry point: the table and the campaign."""
