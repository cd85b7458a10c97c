"""``python -m knittrans.plan``: the ``knittrans-plan`` command."""

import sys

from knittrans.plan.cli import main

sys.exit(main())
