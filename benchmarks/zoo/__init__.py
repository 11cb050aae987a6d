"""Real reward functions and tools for benchmarks/collapse_zoo.py: flawed the way real ones are, never drills."""
