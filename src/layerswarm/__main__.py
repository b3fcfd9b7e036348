import sys

from layerswarm.cli import main

sys.exit(main())
