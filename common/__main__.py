import sys

from prefixroute.cli import main

sys.exit(main())
