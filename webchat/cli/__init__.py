"""The `webchat` command: pull, serve, chat, complete."""
