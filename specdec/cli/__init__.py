"""The ``specdec`` command line (console script ``specdec``, or ``python -m specdec.cli``).

``main.py`` holds the parser and ``generate``; ``bench.py`` the ``bench`` command.
"""

from specdec.cli.main import main

__all__ = ["main"]
