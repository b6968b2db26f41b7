import sys

from fastawq.cli import main

sys.exit(main())
