import sys

from streamload.cli import main

sys.exit(main())
