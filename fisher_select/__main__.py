import sys

from fisher_select.cli import main

sys.exit(main())
