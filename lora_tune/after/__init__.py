"""After training: merge, export, evaluation, serving checks and reports of a finished run (see
ARCHITECTURE.md for the map of rooms)."""
