"""One thin module per verb: parse, call the library, render. No training logic, no torch at import."""
