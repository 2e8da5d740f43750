"""The `fairserve` command: run the stack or one service, show settings, print the version."""
