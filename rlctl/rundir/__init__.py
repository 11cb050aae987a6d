"""The run directory on any fsspec storage."""
