"""Running tool calls: worker processes per rank (``pool``) and what each runs (``worker``)."""
