import sys

from kiln_devtools.chaos.runner import main

sys.exit(main())
