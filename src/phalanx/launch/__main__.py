"""``python -m phalanx.launch ...`` is ``phalanx launch ...``."""

import sys

from phalanx.launch.cli import main

sys.exit(main(["launch", *sys.argv[1:]]))
