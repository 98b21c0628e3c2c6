"""What every service and command shares: logging, config, lifecycle."""
