"""``python -m launch <command>``: see ``launch.cli``."""

from launch.cli import main

raise SystemExit(main())
