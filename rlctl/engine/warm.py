"""What a process that imports once and then forks builds before it forks (the local ranks' starter, the
tests' fork server): the tables a run's first model load and first sample build and keep for the life of
the process, built once there instead of in every forked process.

Each is the table the forked process would have built itself, to the bit; nothing here starts a thread.
"""


def warm_caches() -> None:
    """transformers' weight-renaming table (about 800 regular expressions compiled at the first
    ``from_pretrained``: 0.1-0.3 s of CPU) and the counter sampler's Gumbel table (about 0.05 s)."""
    from rlctl.engine.rollout.noise import gumbel_table

    gumbel_table()
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # (a transformers without the table builds nothing to keep)
        return
    get_checkpoint_conversion_mapping("llama")
