"""`python -m models.cli ...`: the same command as the `llm-runtime` console script."""

from models.cli.main import run

run()
