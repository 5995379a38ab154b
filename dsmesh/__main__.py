import sys

from dsmesh.cli.main import main

sys.exit(main())
