"""``python -m pipeline`` -> :func:`pipeline.cli.main`."""

import sys

from pipeline.cli import main

sys.exit(main())
