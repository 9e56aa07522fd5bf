"""`python -m localllm` = the `localllm` command."""

from .cli import main

main()
