"""The `streamload` command and its subcommands (nothing imports them)."""
