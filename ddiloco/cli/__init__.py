"""The `ddiloco` command line."""
