"""`python -m harness.cli`: the same as the `pwbench` command."""

from harness.cli import main

main()
