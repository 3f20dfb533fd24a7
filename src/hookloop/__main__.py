import sys

from hookloop.cli import main

sys.exit(main())
