import sys

from kiln.chaos.runner import main

sys.exit(main())
