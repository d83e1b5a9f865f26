"""Command-line entry points of jrl (run as `python -m launch.<name>`)."""
