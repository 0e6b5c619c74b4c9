import sys

from duet.cli import main

sys.exit(main())
