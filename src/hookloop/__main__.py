import sys

from hookloop.app.cli import main

sys.exit(main())
