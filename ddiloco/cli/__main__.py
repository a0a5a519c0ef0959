"""`python -m ddiloco.cli`: the same entry as the `ddiloco` command."""

from ddiloco.cli.main import main

raise SystemExit(main())
