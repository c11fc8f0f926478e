import sys

from fitone.cli import main

sys.exit(main())
