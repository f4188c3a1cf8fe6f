import sys

from adloco.cli import main

sys.exit(main())
