"""``python -m phalanx ...`` is the ``phalanx`` command."""

import sys

from phalanx.launch.cli import main

sys.exit(main())
