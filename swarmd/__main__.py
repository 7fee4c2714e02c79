"""`python -m swarmd` runs the CLI (tests use it to start nodes with this interpreter)."""

from swarmd.cli import app

app()
