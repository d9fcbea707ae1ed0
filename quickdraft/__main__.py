"""`python -m quickdraft ...` runs the `quickdraft` command."""
from .cli import main

main()
