"""``python -m assets.cli``: the ``marl`` command."""

from assets.cli import app

app()
