"""``python -m specdec.cli``: the ``specdec`` command line."""

import sys

from specdec.cli.main import main

sys.exit(main())
