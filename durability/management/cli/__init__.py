"""The pieces of ``manage.py durability`` (durability/management/commands/durability.py):
its arguments, what its subcommands share, and ``show``, the longest of them."""
