"""`python -m webchat ...`: the `webchat` command."""

from webchat.cli.main import main_entry

main_entry()
