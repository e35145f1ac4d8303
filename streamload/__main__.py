import sys

from streamload.commands.cli import main

sys.exit(main())
