import sys

from dsmesh.cli import main

sys.exit(main())
